"""The job's key-value store: how the ranks of one attempt agree on small decisions (the step to
resume from, the interval `--every auto` chose) without touching the script's process group."""

from __future__ import annotations

import os
from datetime import timedelta


def job_store(restart_count: int, namespace: str = ""):
    """A client of the elastic agent's TCPStore, keyed per run and attempt (and `namespace`)."""
    import torch.distributed as dist

    prefix = f"ckptrun/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{restart_count}"
    return dist.PrefixStore(
        f"{prefix}/{namespace}" if namespace else prefix,
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                      timeout=timedelta(minutes=10)),
    )
