"""Publish one record with the Store and die (`os._exit(137)`, like SIGKILL: no cleanup) at a
named fault point; exits 0 only if the point was never reached.

Usage: crash_commit.py DIR STEP PAYLOAD FAULT_POINT, where PAYLOAD.data holds the raw bytes and
PAYLOAD.json the tensor specs and skeleton.
"""

import json
import os
import sys
from pathlib import Path

from ckptrun.storage.store import Store, full_name


def main() -> None:
    root, step, payload, point = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]

    def fault(at: str) -> None:
        if at == point:
            os._exit(137)

    spec = json.loads(payload.with_suffix(".json").read_text())
    data = payload.with_suffix(".data").read_bytes()
    store, name = Store(root), full_name(step)
    store.write_rank(name, 0, memoryview(data), spec["tensors"], spec["skeleton"], {}, fault=fault)
    store.try_commit(name, kind="full", step=step, first_step=step, world_size=1, fault=fault)


if __name__ == "__main__":
    main()
