"""User-facing errors: one line naming the problem and the fix, and the exit code to use."""

from __future__ import annotations


class CkptrunError(Exception):
    """An error the CLI prints as one line (no traceback) before exiting with `exit_code`."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(CkptrunError):
    """Bad input on the command line (exit 2, like click)."""

    exit_code = 2


class CorruptCheckpoint(CkptrunError):
    """A checkpoint object whose bytes or metadata fail their checks; never loaded."""


class StepNotAvailable(CkptrunError):
    """A step that is not committed (or not restorable) was asked for."""

    exit_code = 2


class CheckpointMismatch(CkptrunError):
    """The checkpoint directory holds state of another model or world size."""

    exit_code = 2


class AlreadyCommitted(CkptrunError):
    """A write aimed at a record that is already committed; nothing was touched."""


class AbortRun(BaseException):
    """Carries a CkptrunError raised inside the script (from a hook) out to the bootstrap, past the
    script's own `except Exception` handlers."""

    def __init__(self, error: CkptrunError) -> None:
        super().__init__(str(error))
        self.error = error


def no_optimizer(what: str) -> CkptrunError:
    """The script trains (or ran) without a torch.optim optimizer: `what` says how it was noticed."""
    return CkptrunError(f"{what}; ckptrun captures state at optimizer steps, so run it with plain python, "
                        "or create the optimizer with torch.optim")
