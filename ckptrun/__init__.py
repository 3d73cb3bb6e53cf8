"""ckptrun: frequent, low-overhead, crash-consistent checkpointing for unchanged PyTorch scripts.

Scripts may call `ckptrun.resume_step()` (0 on a fresh run, and when run without ckptrun) to
know where to resume, and `ckptrun.track(name=obj)` to add state ckptrun cannot discover.
"""

from __future__ import annotations

import os
from typing import Any

__version__ = "0.1.0"


def resume_step() -> int:
    """The iteration to resume at: the completed optimizer steps restored at start-up, plus the
    steps a GradScaler skipped before them (also in $CKPTRUN_RESUME_STEP). Calling it tells
    ckptrun that the script starts its loop there (see --on-restart)."""
    from .worker.runtime import current

    rt = current()
    if rt is not None:
        rt.script_resumes = True
    return int(os.environ.get("CKPTRUN_RESUME_STEP", "0"))


def track(**objects: Any) -> None:
    """Checkpoint these objects too (anything with state_dict/load_state_dict, or a
    torch.Generator); on resume they are restored immediately. A no-op outside ckptrun."""
    from .worker.runtime import current

    rt = current()
    if rt is not None:
        for name, obj in objects.items():
            rt.track(name, obj)


def is_active() -> bool:
    """True inside a worker started by the ckptrun launcher."""
    from .worker.runtime import current

    return current() is not None
