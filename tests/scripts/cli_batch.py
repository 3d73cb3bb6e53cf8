"""Run several `ckptrun` command lines through the CLI's entry point in one interpreter (torch is
imported once): argv lists as a JSON list in argv[1]; prints a JSON list of {rc, stdout, stderr,
seconds}.
An exception escaping the entry point is printed as its traceback into that command's stderr."""

import contextlib
import io
import json
import sys
import time
import traceback

from ckptrun.cli import main


def run(argv: list[str]) -> dict:
    out, err, start = io.StringIO(), io.StringIO(), time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except BaseException:  # noqa: BLE001 - reported to the test, which fails on it
            traceback.print_exc()
            rc = 99
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue(), "seconds": time.monotonic() - start}


if __name__ == "__main__":
    print(json.dumps([run(argv) for argv in json.loads(sys.argv[1])]))
