"""torch elastic's rendezvous names each of its events after the calling method through
`inspect.stack()`, which reads the source of every frame and walks every loaded module: about 30
calls in a one-node run without restarts, 0.3 s of the launcher's CPU (more with each restart),
most of it before the workers start. The same name, read from the frame itself, costs microseconds."""

from __future__ import annotations

import sys


def method_name(depth: int = 2) -> str:
    """What `dynamic_rendezvous.get_method_name(depth)` returns: the name of the function `depth`
    frames above it, or "no_method_name" when the stack is not that deep."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def install() -> None:
    """Replace torch's stack-inspecting name lookup with `method_name` (call it in the launcher,
    before the rendezvous)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    dynamic_rendezvous.get_method_name = method_name
