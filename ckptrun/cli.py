"""The `ckptrun` command. `run` is the default: `ckptrun [OPTIONS] SCRIPT [ARGS...]`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .errors import CkptrunError

app = typer.Typer(
    add_completion=False, no_args_is_help=True, rich_markup_mode=None,
    help="Frequent, low-overhead, crash-consistent checkpointing for unchanged PyTorch training "
         "scripts. `ckptrun [OPTIONS] SCRIPT [ARGS]...` runs SCRIPT (the `run` command is the "
         "default).",
)
err = Console(stderr=True, highlight=False)
out = Console(highlight=False)

Dir = Annotated[Path, typer.Option("--dir", help="Checkpoint directory.")]


@app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
def run(
    script: Annotated[str, typer.Argument(help="The training script; everything after it is its own.")],
    script_args: Annotated[list[str] | None, typer.Argument(help="Arguments passed to the script.")] = None,
    strategy: Annotated[str, typer.Option(help="Checkpointing strategy (see `ckptrun strategies`).")]
    = "checkfreq",
    dir: Annotated[str, typer.Option("--dir", help="Checkpoint directory.")] = "ckpts",
    every: Annotated[int, typer.Option(help="Optimizer steps between checkpoints.")] = 1,
    keep: Annotated[int, typer.Option(help="Full checkpoints retained (0 keeps all).")] = 2,
    resume: Annotated[bool, typer.Option(help="Resume from the latest committed step in --dir.")] = True,
    on_save_error: Annotated[str, typer.Option(help="warn: report a failed save and train on; fail: stop.")]
    = "warn",
    max_inflight: Annotated[int, typer.Option(help="Checkpoints in flight (staging slots) before the "
                                                   "trainer waits (back-pressure).")] = 2,
    writers: Annotated[int, typer.Option(help="Engine writer threads (checkpoints written at once).")] = 2,
    io_threads: Annotated[int, typer.Option(help="Threads writing chunks of one checkpoint file.")] = 1,
    metrics_dir: Annotated[str, typer.Option(help="Keep the raw per-rank metrics (JSONL) in this folder.")]
    = "",
    nproc_per_node: Annotated[str, typer.Option(help="Workers per node (torchrun).")] = "1",
    nnodes: Annotated[str, typer.Option(help="Number of nodes, or MIN:MAX (torchrun).")] = "1",
    node_rank: Annotated[int | None, typer.Option(help="Rank of this node (torchrun).")] = None,
    rdzv_backend: Annotated[str | None, typer.Option(help="Rendezvous backend (torchrun).")] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option(help="Rendezvous endpoint HOST:PORT (torchrun).")]
    = None,
    rdzv_id: Annotated[str | None, typer.Option(help="Rendezvous/job id (torchrun).")] = None,
    master_addr: Annotated[str | None, typer.Option(help="Master address, static rendezvous (torchrun).")]
    = None,
    master_port: Annotated[int | None, typer.Option(help="Master port, static rendezvous (torchrun).")]
    = None,
    max_restarts: Annotated[int, typer.Option(help="Restarts of failed workers before giving up.")] = 0,
    standalone: Annotated[bool, typer.Option(help="Single-node rendezvous on a free port (torchrun).")]
    = False,
) -> None:
    """Run SCRIPT under ckptrun: hooks installed, state checkpointed, failures restarted."""
    from .config import RunConfig
    from .launcher import LaunchOptions
    from .launcher import run as launch

    cfg = RunConfig(strategy=strategy, dir=dir, every=every, keep=keep, resume=resume,
                    on_save_error=on_save_error, max_inflight=max_inflight, writers=writers,
                    io_threads=io_threads, metrics_dir=metrics_dir)
    opts = LaunchOptions(nproc_per_node, nnodes, node_rank, rdzv_backend, rdzv_endpoint, rdzv_id,
                         master_addr, master_port, max_restarts, standalone)
    raise typer.Exit(launch(cfg, opts, script, list(script_args or [])))


@app.command()
def strategies() -> None:
    """List the checkpointing strategies."""
    from .strategies import REGISTRY

    for name, entry in REGISTRY.items():
        out.print(f"{name:<10} {entry.summary}")


@app.command()
def restore(
    dir: Dir = Path("ckpts"),
    step: Annotated[str, typer.Option(help="A committed step number, or `latest`.")] = "latest",
    out_file: Annotated[Path, typer.Option("--out", help="Output file.")] = Path("restored.pt"),
    format: Annotated[str, typer.Option(help="torch (torch.load(weights_only=True)) or safetensors.")]
    = "torch",
    rank: Annotated[int, typer.Option(help="Whose state to export, for multi-rank checkpoints.")] = 0,
) -> None:
    """Rebuild the state of a committed step, bit-exact, as one file."""
    from .export import export

    if format not in ("torch", "safetensors"):
        raise CkptrunError(f"--format must be torch or safetensors (got {format!r})", exit_code=2)
    if step != "latest" and not step.isdigit():
        raise CkptrunError(f"--step must be a step number or `latest` (got {step!r})", exit_code=2)
    m = export(dir, step, out_file, format, rank)
    err.print(f"restored step {m.step} ({m.name}, rank {rank}) -> {out_file}")


@app.command("ls")
def ls(dir: Dir = Path("ckpts"),
       as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """List committed steps."""
    from .store import Store

    store = Store(dir)
    if not dir.is_dir():
        raise CkptrunError(f"no checkpoint directory at {dir}; pass --dir", exit_code=2)
    rows = [{"step": m.step, "kind": m.kind, "record": m.name, "bytes": m.bytes, "ranks": m.world_size,
             "depends_on": m.depends_on, "first_step": m.first_step} for m in store.manifests()]
    if as_json:
        out.print_json(json.dumps(rows))
        return
    table = Table("step", "kind", "record", "bytes", "ranks", "depends_on")
    for r in rows:
        steps = str(r["step"]) if r["first_step"] == r["step"] else f"{r['first_step']}-{r['step']}"
        table.add_row(steps, r["kind"], r["record"], f"{r['bytes']:,}", str(r["ranks"]),
                      ", ".join(r["depends_on"]) or "-")
    out.print(table)


@app.command()
def verify(dir: Dir = Path("ckpts")) -> None:
    """Re-check every checksum and dependency; exit 1 listing the bad objects."""
    from .store import Store

    store = Store(dir)
    if not dir.is_dir():
        raise CkptrunError(f"no checkpoint directory at {dir}; pass --dir", exit_code=2)
    ms = store.manifests()
    problems = [p for m in ms for p in store.verify_record(m)]
    problems += [f"{name}: incomplete (no manifest; torn or still being written)" for name in store.incomplete()]
    for p in problems:
        out.print(f"BAD {p}")
    if problems:
        raise typer.Exit(1)
    out.print(f"ok: {len(ms)} committed record(s) verified in {dir}")


_COMMANDS = {"run", "restore", "ls", "verify", "strategies", "bench", "tune"}


def main(argv: list[str] | None = None) -> int:
    """Console entry point: `run` is the default command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in _COMMANDS and argv[0] not in ("--help", "-h"):
        argv.insert(0, "run")
    try:
        app(argv, prog_name="ckptrun")
    except CkptrunError as e:
        err.print(f"ckptrun: error: {e}", markup=False)
        return e.exit_code
    except SystemExit as e:  # typer's own exits: usage errors (2), --help (0), typer.Exit
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        err.print("ckptrun: interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
