"""The install part: pydantic and its needs from the carried wheels (no index: the device
reaches no registry) into SITE, then pydantic and ckptrun (from the working tree) imported the
way the later parts import them. `--cpu`: the wheels are installed (checked) but this machine's
own pydantic is imported (the wheels are for the device's Python 3.12)."""

from __future__ import annotations

import os
import subprocess
import sys

from .plan import SITE, WHEELS, pythonpath

PIP = ["-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(WHEELS), "--only-binary=:all:",
       "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64", "--upgrade",
       "--target", str(SITE), "pydantic"]
CHECK = ("import pydantic, ckptrun.cli; "
         "print(f'pydantic {pydantic.VERSION} from {pydantic.__file__}; ckptrun from {ckptrun.cli.__file__}')")


def main(cpu: bool) -> int:
    if not any(WHEELS.glob("pydantic-*.whl")):
        print(f"no pydantic wheel in {WHEELS}: run scripts/gpu-wheels here and carry .whl in the device call")
        return 1
    print(f"$ {sys.executable} {' '.join(PIP)}", flush=True)
    if subprocess.run([sys.executable, *PIP]).returncode:
        return 1
    env = {**os.environ, "PYTHONPATH": pythonpath(cpu)}
    return subprocess.run([sys.executable, "-c", CHECK], env=env).returncode


if __name__ == "__main__":
    sys.exit(main("--cpu" in sys.argv[1:]))
