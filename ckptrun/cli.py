"""The `ckptrun` command. `run` is the default: `ckptrun [OPTIONS] SCRIPT [ARGS...]`."""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from .errors import CkptrunError, CorruptCheckpoint, UsageError
from .strategies import DEFAULT

if TYPE_CHECKING:
    from .storage.store import Manifest, Store
    from .tuning.levels import FailureRates

app = typer.Typer(
    add_completion=False, no_args_is_help=True, rich_markup_mode=None,
    help="Frequent, low-overhead, crash-consistent checkpointing for unchanged PyTorch training "
         "scripts. `ckptrun [OPTIONS] SCRIPT [ARGS]...` runs SCRIPT (the `run` command is the "
         "default).",
)
err = Console(stderr=True, highlight=False)
out = Console(highlight=False)

Dir = Annotated[Path, typer.Option("--dir", help="Checkpoint directory.")]
ReadDir = Annotated[str, typer.Option("--dir", help="Checkpoint directory, or a --durable tier (s3://BUCKET/PREFIX "
                                                    "or a path).")]
# One name on every command, the name `run` had before accepted too (a recipe may use either).
Endpoint = Annotated[str, typer.Option("--endpoint", "--durable-endpoint",
                                       help="URL of the S3-compatible service behind s3:// URLs (--durable, or "
                                            "an s3:// --dir) (default: the client's standard chain, e.g. "
                                            "AWS_ENDPOINT_URL); --durable-endpoint is the same flag.")]
OptimizerClass = Annotated[
    list[str] | None,
    typer.Option("--optimizer-class", help="Trust this optimizer class (pkg.module:Class; repeatable) for "
                                            "replaying differential records; torch.optim's classes are always "
                                            "allowed, a class named only in the checkpoint never is.")]


def _duration(flag: str, text: str) -> float:
    from .tuning.durations import parse_duration

    try:
        return parse_duration(text)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None


def _recipe_defaults(ctx: typer.Context, path: str) -> str:
    """--recipe (processed first): its values become the run command's defaults, so explicit
    flags override them and click converts and checks them like the flags themselves. A key is
    any of an option's long names (an alias too), with underscores for dashes."""
    if path:
        from .tuning.recipes import load_recipe

        keys = {key: p.name for p in ctx.command.params if p.name not in _NOT_IN_RECIPES
                for key in (p.name, *(o.lstrip("-").replace("-", "_") for o in p.opts if o.startswith("--")))}
        ctx.default_map = load_recipe(path, keys)
    return path


_NOT_IN_RECIPES = {"script", "script_args", "recipe"}
Script = Annotated[str, typer.Argument(help="The training script; everything after it is its own.")]
ScriptArgs = Annotated[list[str] | None, typer.Argument(help="Arguments passed to the script as given, never read "
                                                                 "as ckptrun's or torchrun's.")]
Mtbf = Annotated[str, typer.Option(help="Mean time between failures of every kind: 90s, 45m, 2h, 1.5d "
                                        "(default 1h). run: used by --every auto and the strategies' auto "
                                        "settings. The kinds not given by --mtbf-KIND share it: process 50%, "
                                        "node 40%, job 10% by default (README: Tiers and failure rates).")]
MtbfProcess = Annotated[str, typer.Option(help="MTBF of process failures (a worker or engine dies, the machine "
                                               "stays): they resume from the engine's memory or --dir. "
                                               "Taken as given; --mtbf, if given, counts them too.")]
MtbfNode = Annotated[str, typer.Option(help="MTBF of node failures (a machine lost with its memory and local "
                                            "disk): they resume from partners (--replicas > 1), else from "
                                            "--dir unless --node-local-dir, else from --durable.")]
MtbfJob = Annotated[str, typer.Option(help="MTBF of job failures (the whole job, or --dir's storage, lost): "
                                           "they resume from --durable.")]
NodeLocalDir = Annotated[bool, typer.Option(help="Each node's --dir is its own (a node-local disk), lost with "
                                                 "its node: on several nodes a step commits once every rank's "
                                                 "part is written on its node (said through the job's store), "
                                                 "each node's --dir then holds the step's manifest and its own "
                                                 "ranks' parts, and every rank writes all of its state; node "
                                                 "failures resume from partners or --durable, not --dir (the "
                                                 "tiers' model). Only the strategies --replicas takes.")]


def _rates(mtbf_s: float, kinds: dict[str, str], source: str = "",
           logged: dict[str, int] | None = None) -> tuple[dict[str, float], FailureRates]:
    """The --mtbf-KIND flags given (seconds) and the failure rates they make with `mtbf_s` (0:
    --mtbf not given; `source`, `logged`: a failure log's); UsageError if they contradict each
    other."""
    from .tuning.intervals import DEFAULT_MTBF_S
    from .tuning.levels import rates_for

    given = {k: _duration(f"--mtbf-{k}", v) for k, v in kinds.items() if v}
    try:
        return given, rates_for(mtbf_s, given, DEFAULT_MTBF_S, source, logged)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _with_strategy_options(func: Callable) -> Callable:
    """Add every registered strategy's options (ckptrun/strategies/options.py) to the `run`
    command as typer options, a flag shared by several strategies once (its help per strategy,
    no default: each strategy's applies, `_chosen_options`); `run` receives them in
    `**strategy_options`."""
    from .strategies import options_by_flag

    sig = inspect.signature(func, eval_str=True)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    for name, owners in options_by_flag().items():
        helps: dict[str, list[str]] = {}
        for strategy, opt in owners:
            helps.setdefault(opt.help, []).append(strategy)
        longest_first = sorted(helps.items(), key=lambda kv: -len(kv[0]))
        text = " ".join(f"{', '.join(strategies)}: {h}" for h, strategies in longest_first)
        defaults = {opt.default for _, opt in owners}
        ann = Annotated[str | None, typer.Option(owners[0][1].flag, help=text)]
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                        default=defaults.pop() if len(defaults) == 1 else None, annotation=ann))
        func.__annotations__[name] = ann
    func.__signature__ = sig.replace(parameters=params)
    return func


EVERY_HELP = ("Optimizer steps between checkpoints, or auto: chosen and re-evaluated online from measured costs "
              "and --mtbf (docs/tuning.md). Given as N (here or in a recipe), every multiple of N is restorable "
              "once the run ends, within --keep's retention (a strategy may commit more steps, never fewer), "
              "or the run is refused at start "
              "naming the flag in the way; left unset, each strategy checkpoints every step with its own auto "
              "settings. How each strategy maps N onto its intervals: the end of this help.")


MAX_OVERHEAD_ENV = "CKPTRUN_MAX_OVERHEAD"
MAX_OVERHEAD_HELP = ("What checkpointing may cost the training loop, in percent of the step without checkpointing "
                     "(tune's --max-overhead): stall on the training thread plus the step's own slowdown, measured "
                     "online (a fresh run's first 4 steps take no checkpoint to measure that step). Every setting "
                     "left unset or auto is chosen within it: --every (every step when the budget allows), "
                     "persist, full and batch intervals; a strategy that cannot keep within it says so once. An "
                     "explicit --every N is kept, and its cost against the budget said once. off: no budget. "
                     f"Default: ${MAX_OVERHEAD_ENV} if set (a recipe's or this flag's value wins), else 5.")


def parse_budget(text: str) -> float:
    """--max-overhead: a fraction, 0 for `off`; unset ("") is $CKPTRUN_MAX_OVERHEAD, else 5%."""
    from .tuning.plan import parse_percent

    text = str(text).strip() or os.environ.get(MAX_OVERHEAD_ENV, "").strip() or "5"
    return 0.0 if text.lower() in ("off", "0", "0%") else parse_percent(text)


def _intervals_epilog(width: int = 76) -> str:
    """The end of `run --help`: per strategy, which intervals exist and how --every N maps onto
    them (each registry entry's `intervals`), laid out for 80 columns."""
    import textwrap

    from .strategies import REGISTRY

    rows = [textwrap.fill(entry.intervals, width, initial_indent=f"{name:<12}", subsequent_indent=" " * 12)
            for name, entry in REGISTRY.items() if entry.intervals]
    return "Intervals per strategy, and how --every N maps onto them:\n\n\b\n" + "\n".join(rows)


def _given(ctx: typer.Context, param: str) -> bool:
    """Was `param` given (command line or recipe), not left at its default?"""
    return getattr(ctx.get_parameter_source(param), "name", "") != "DEFAULT"


def _chosen_options(ctx: typer.Context, strategy: str, given: dict[str, str | None]) -> dict[str, str | None]:
    """The chosen strategy's option values (its defaults where none was given); an option only
    other strategies take, typed on the command line, is an error (it would be silently ignored)."""
    from .strategies import REGISTRY, options_by_flag

    for name, owners in options_by_flag().items():
        names = [owner for owner, _ in owners]
        if strategy not in names and getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE":
            raise UsageError(f"{owners[0][1].flag} is an option of --strategy {' or '.join(names)}, not of "
                             f"{strategy}; drop it or pass --strategy {names[0]}")
    entry = REGISTRY.get(strategy)
    chosen = {opt.name: opt.default if given[opt.name] is None else given[opt.name]
              for opt in entry.options} if entry else {}
    for opt in entry.options if entry else ():
        opt.check(chosen)
    return chosen


@app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
             epilog=_intervals_epilog())
@_with_strategy_options
def run(
    ctx: typer.Context,
    script: Script,
    script_args: ScriptArgs = None,
    strategy: Annotated[str, typer.Option(help="Checkpointing strategy (see `ckptrun strategies`).")]
    = DEFAULT,
    dir: Annotated[str, typer.Option("--dir", help="Checkpoint directory.")] = "ckpts",
    every: Annotated[str, typer.Option(help=EVERY_HELP)] = "1",
    max_overhead: Annotated[str, typer.Option(help=MAX_OVERHEAD_HELP, show_default=False)] = "",
    mtbf: Mtbf = "",
    mtbf_process: MtbfProcess = "",
    mtbf_node: MtbfNode = "",
    mtbf_job: MtbfJob = "",
    max_steps: Annotated[int, typer.Option(min=0, help="Stop the script cleanly after this many optimizer "
                                                       "steps (0: no limit); its checkpoints are finished.")] = 0,
    recipe: Annotated[str, typer.Option(is_eager=True, callback=_recipe_defaults,
                                        help="Take run options from this YAML recipe (recipes/, `ckptrun "
                                             "tune --write`); options given here override it.")] = "",
    keep: Annotated[int, typer.Option(help="Full checkpoints retained (0 keeps all).")] = 2,
    durable: Annotated[str, typer.Option(help="Remote tier: committed steps are copied there in the background "
                                              "(s3://BUCKET/PREFIX with the s3 extra, or a path on a shared "
                                              "file system); a resume takes the newest step of --dir and it.")]
    = "",
    durable_every: Annotated[str, typer.Option(help="N: copy the committed steps that are multiples of N to "
                                                    "--durable, as --every N means for --dir (where the uploads "
                                                    "fall behind, the newest multiple reached, older ones "
                                                    "skipped, said once; where the strategy committed no record "
                                                    "at a multiple, the first committed step after it). auto: "
                                                    "the newest committed step once the interval of the tiers' "
                                                    "model (as `ckptrun tune` prints it) is past the last copy: "
                                                    "Daly's interval for the measured upload time against the "
                                                    "failures that resume from --durable (job; node too with "
                                                    "--node-local-dir and --replicas 1), never more often than "
                                                    "the uploads drain. Either way the run's last committed "
                                                    "step is copied at its end.")]
    = "auto",
    durable_keep: Annotated[int, typer.Option(help="Full checkpoints retained on --durable (0 keeps all); one "
                                                   "goes only after a newer one is committed there.")] = 2,
    endpoint: Endpoint = "",
    replicas: Annotated[int, typer.Option(help="Copies of each committed step: 1 (--dir only) or K: also in "
                                               "the memory of K-1 partner ranks' engines on other nodes; a "
                                               "replaced node takes its ranks' parts back from them when its "
                                               "--dir lacks them. A strategy whose records a rank's part "
                                               "cannot restore alone is refused, naming those that can.")] = 1,
    replica_jump: Annotated[int, typer.Option(help="--replicas: a rank's copies go to every J-th node after its "
                                                   "own (1: the next nodes); nodes must be a multiple of "
                                                   "replicas x jump.")] = 1,
    node_local_dir: NodeLocalDir = False,
    resume: Annotated[bool, typer.Option(help="Resume from the latest committed step in --dir.")] = True,
    on_save_error: Annotated[str, typer.Option(help="warn: report a failed save and train on; fail: stop.")]
    = "warn",
    on_restart: Annotated[str, typer.Option(help="When a script that never calls ckptrun.resume_step() is "
                                                 "resumed at a committed step: resume (keep the restored "
                                                 "state, warn that its loop starts over), fresh (restarted "
                                                 "workers start from scratch) or fail.")] = "resume",
    max_inflight: Annotated[int, typer.Option(help="Checkpoints in flight (staging slots) before the "
                                                   "trainer waits (back-pressure). Raised where not given to "
                                                   "what the strategy holds: --persist-every needs 2, 3 with "
                                                   "--replicas.")] = 2,
    host_memory: Annotated[str, typer.Option(help="Host-memory budget per node for checkpoint staging, shared "
                                                  "equally by its ranks: 8G, 512M, 1.5GiB (default: 25% of the "
                                                  "memory available at start). Staging slots (x --max-inflight) "
                                                  "and what a strategy keeps in its engine (a batch of diffs, a "
                                                  "CPU replica) stay within it; tuners choose within it; "
                                                  "an explicit setting that does not fit is refused.")] = "",
    writers: Annotated[int, typer.Option(help="Engine writer threads (checkpoints written at once).")] = 2,
    io_threads: Annotated[int, typer.Option(help="Threads writing chunks of one checkpoint file.")] = 1,
    io_engine: Annotated[str, typer.Option(help="The engine's file writer: native (io_uring + O_DIRECT, "
                                                "native/), python (pwrite), or auto: CKPTRUN_IO_ENGINE if "
                                                "set, else the measured default (README, Native writer). "
                                                "native falls back to python, with a warning, where it "
                                                "is not built or io_uring is refused.")] = "auto",
    metrics_dir: Annotated[str, typer.Option(help="Keep the raw per-rank metrics (JSONL) in this folder.")]
    = "",
    metrics_file: Annotated[str | None, typer.Option(help="Append every metrics event (one JSON object per "
                                                          "line, per step per rank, per commit, per restart) "
                                                          "to this file as it happens.")] = None,
    dashboard: Annotated[bool, typer.Option(help="Live panel on a terminal (made for 80 columns: per rank "
                                                 "step, durable step, work at risk, stall, bandwidth, errors). "
                                                 "--no-dashboard, or off a terminal: a log line every "
                                                 "--log-interval seconds, each warning and error, and the exit "
                                                 "summary, through Python logging (logger `ckptrun`, on "
                                                 "stderr).")] = True,
    dashboard_wide: Annotated[bool, typer.Option("--dashboard-wide", help="The live panel with every column "
                                                                          "(snapshot, in-flight, queue, stall "
                                                                          "by cause, ...; about 160 "
                                                                          "columns).")] = False,
    log_interval: Annotated[float, typer.Option(min=0.1, help="Seconds between two progress lines of the "
                                                              "log (without the live panel).")] = 5.0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Errors only: no panel, no progress lines, no "
                                                              "summary (the script's own output is "
                                                              "unchanged).")] = False,
    nproc_per_node: Annotated[str, typer.Option(help="Workers per node (torchrun).")] = "1",
    nnodes: Annotated[str, typer.Option(help="Number of nodes, or MIN:MAX (torchrun).")] = "1",
    node_rank: Annotated[int | None, typer.Option(help="Rank of this node (torchrun).")] = None,
    rdzv_backend: Annotated[str | None, typer.Option(help="Rendezvous backend (torchrun).")] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option(help="Rendezvous endpoint HOST:PORT (torchrun).")]
    = None,
    rdzv_id: Annotated[str | None, typer.Option(help="Rendezvous/job id (torchrun).")] = None,
    rdzv_conf: Annotated[str | None, typer.Option(help="Rendezvous settings KEY=VALUE,... (torchrun), e.g. "
                                                       "join_timeout=60,last_call_timeout=1,close_timeout=10, "
                                                       "is_host=true.")] = None,
    local_addr: Annotated[str | None, typer.Option(help="This node's address that the other nodes reach "
                                                        "(torchrun); default: its host name, which nodes "
                                                        "sharing one host name cannot tell apart.")] = None,
    master_addr: Annotated[str | None, typer.Option(help="Master address, static rendezvous (torchrun).")]
    = None,
    master_port: Annotated[int | None, typer.Option(help="Master port, static rendezvous (torchrun).")]
    = None,
    max_restarts: Annotated[int, typer.Option(help="Restarts of failed workers before giving up.")] = 0,
    standalone: Annotated[bool, typer.Option(help="Single-node rendezvous on a free port (torchrun).")]
    = False,
    dist_env: Annotated[bool, typer.Option(help="Give the script torchrun's environment (RANK, WORLD_SIZE, "
                                                "MASTER_ADDR, ...). --no-dist-env: one process that sees "
                                                "none of it, as under plain `python SCRIPT` (for scripts "
                                                "that turn distributed, e.g. ask for NCCL, when RANK is set); "
                                                "restarts and checkpoints are unchanged.")] = True,
    term_timeout: Annotated[str, typer.Option(help="Grace period on SIGTERM/SIGINT: the workers hand over "
                                                   "their newest finished step, the engines commit it, and "
                                                   "ckptrun exits (143/130) within this time, e.g. 30s, 2m.")]
    = "30s",
    **strategy_options: str | None,
) -> None:
    """Run SCRIPT under ckptrun: hooks installed, state checkpointed, failures restarted."""
    from .config import RunConfig
    from .launcher.run import LaunchOptions, OutputOptions
    from .launcher.run import run as launch
    from .log import configure
    from .memory_budget import node_budget
    from .storage.iowriter import ENGINES
    from .strategies import REGISTRY
    from .tuning.levels import Layout

    configure(quiet=quiet)
    if every != "auto" and not every.lstrip("-").isdigit():
        raise UsageError(f"--every must be a number of steps or auto (got {every!r})")
    if durable_every != "auto" and not durable_every.isdigit():
        raise UsageError(f"--durable-every must be a number of steps or auto (got {durable_every!r})")
    if io_engine not in ENGINES:
        raise UsageError(f"--io-engine must be one of {', '.join(ENGINES)} (got {io_engine!r})")
    if endpoint and not durable:
        raise UsageError("--endpoint names the service of an s3:// --durable; give --durable "
                         "s3://BUCKET/PREFIX, or drop --endpoint")
    mtbf_s = _duration("--mtbf", mtbf) if mtbf else 0.0
    mtbf_kinds, rates = _rates(mtbf_s, {"process": mtbf_process, "node": mtbf_node, "job": mtbf_job})
    mtbf_s = mtbf_s or (1.0 / rates.total if mtbf_kinds else 0.0)  # the kinds alone give every failure's MTBF
    options = _chosen_options(ctx, strategy, strategy_options)
    # An explicit --every N (command line or recipe; not its default) is honoured as given.
    every_given = every != "auto" and _given(ctx, "every")
    if every_given and int(every) >= 1 and strategy in REGISTRY:
        options = REGISTRY[strategy].honour_every(options, int(every))
    if strategy in REGISTRY and not _given(ctx, "max_inflight"):  # (an explicit one too small is refused)
        max_inflight = max(max_inflight, REGISTRY[strategy].least_inflight(options, replicas))
    budget = parse_budget(max_overhead)
    node_bytes, node_source = node_budget(host_memory or None)
    cfg = RunConfig(host_memory_node=node_bytes, host_memory_source=node_source,
                    max_inflight_given=_given(ctx, "max_inflight"),
                    strategy=strategy, dir=dir, every=1 if every == "auto" else int(every), keep=keep,
                    resume=resume, on_save_error=on_save_error, max_inflight=max_inflight, writers=writers,
                    io_threads=io_threads, io_engine=io_engine, metrics_dir=metrics_dir, every_auto=every == "auto",
                    mtbf=mtbf_s, mtbf_kinds=mtbf_kinds, max_steps=max_steps, max_overhead=budget,
                    on_restart=on_restart, dist_env=dist_env,
                    every_given=every_given, durable=durable, durable_keep=durable_keep,
                    durable_every=0 if durable_every == "auto" else int(durable_every),
                    durable_endpoint=endpoint, replicas=replicas, replica_jump=replica_jump,
                    node_local_dir=node_local_dir,
                    options={**options, **({"mtbf": mtbf_s} if mtbf_s else {}), "max_overhead": budget,
                             "memory_lost_share": Layout(replicas, node_local_dir).memory_lost_share(rates)})
    opts = LaunchOptions(nproc_per_node, nnodes, node_rank, rdzv_backend, rdzv_endpoint, rdzv_id, rdzv_conf,
                         local_addr, master_addr, master_port, max_restarts, standalone,
                         term_timeout=_duration("--term-timeout", term_timeout))
    output = OutputOptions(dashboard=dashboard, wide=dashboard_wide, log_interval=log_interval, quiet=quiet)
    raise typer.Exit(launch(cfg, opts, script, list(script_args or []), output=output, metrics_file=metrics_file))


@app.command()
def strategies() -> None:
    """List the checkpointing strategies."""
    import textwrap

    from .strategies import REGISTRY

    width = max(40, min(out.width, 100))
    for name, entry in REGISTRY.items():
        out.print(textwrap.fill(entry.summary, width, initial_indent=f"{name:<11}", subsequent_indent=" " * 11),
                  soft_wrap=True)


@app.command()
def restore(
    dir: ReadDir = "ckpts",
    step: Annotated[str, typer.Option(help="A committed step number, or `latest`.")] = "latest",
    out_file: Annotated[Path, typer.Option("--out", help="Output file.")] = Path("restored.pt"),
    format: Annotated[str, typer.Option(help="torch (torch.load(weights_only=True)) or safetensors.")]
    = "torch",
    rank: Annotated[int, typer.Option(help="Whose state to export, for multi-rank checkpoints.")] = 0,
    optimizer_class: OptimizerClass = None,
    endpoint: Endpoint = "",
) -> None:
    """Rebuild the state of a committed step, bit-exact, as one file."""
    from .restore.export import export
    from .restore.recovery import plans
    from .storage.tiers.mirror import reading

    if format not in ("torch", "safetensors"):
        raise CkptrunError(f"--format must be torch or safetensors (got {format!r})", exit_code=2)
    if step != "latest" and not step.isdigit():
        raise CkptrunError(f"--step must be a step number or `latest` (got {step!r})", exit_code=2)

    def records(store: Store) -> list[str]:  # what a remote tier's copy needs: the step's plan
        found = plans(store)
        plan = found.get(max(found, default=-1) if step == "latest" else int(step))
        return [m.name for m in plan.records] if plan else []

    with reading(dir, endpoint or None, records) as store:
        plan = export(store, step, out_file, format, rank, optimizer_class)
    via = f" + {len(plan.diffs)} diff record(s) replayed" if plan.diffs else ""
    err.print(f"restored step {plan.step} (from {plan.base.name}{via}, rank {rank}) -> {out_file}")


def _time_or_none(value: object) -> float | None:
    """A time read from a manifest's free-form meta, if it is one."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


@app.command("ls")
def ls(dir: ReadDir = "ckpts",
       as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output, every field.")] = False,
       wide: Annotated[bool, typer.Option("--wide", help="Every record (a diff chain's records one by one) and "
                                                         "every column, however narrow the terminal (by "
                                                         "default a chain's consecutive diff records are one "
                                                         "row, and the less important columns are left out "
                                                         "where they do not fit).")] = False,
       endpoint: Endpoint = "",
       durable: Annotated[str, typer.Option("--durable", help="Also list this remote tier (s3://BUCKET/PREFIX "
                                                             "or a path), with a tiers column saying where each "
                                                             "step is (default: the URL the run's --dir records)."
                                            )] = "") -> None:
    """List committed steps, and the step a live run's engines hold in memory (kind `memory`:
    survives a worker crash, not a machine loss; lowdiff+). A tiers column says where each step
    is, when not only in --dir: `remote` (--durable), `copy:R` (an engine on this host holds
    rank R's part of it for its partner: --replicas).

    Diff chains (lowdiff, lowdiff+): consecutive diff records on one full checkpoint are one row
    (`N records`; --wide and --json list each), and a line per run of restorable steps says
    which full checkpoints they restore from, how many are diffs, and what restoring the newest
    takes: the bytes it reads (every rank's) and the steps it replays through the optimizer, the
    two costs of a restore (no time is given: none is recorded to estimate one from)."""
    from .storage.tiers.mirror import reading

    with reading(dir, endpoint or None) as store, _remote_tier(dir, durable, endpoint) as remote:
        _ls(store, as_json, wide, remote)


@contextlib.contextmanager
def _remote_tier(dir: str, durable: str, endpoint: str) -> Iterator[Store | None]:
    """The remote tier `ls` lists beside --dir: --durable, else the one --dir records (None if
    neither; a recorded one that cannot be read is said in one line and left out)."""
    from .storage.tiers import is_remote
    from .storage.tiers.mirror import reading
    from .storage.tiers.recorded import recorded

    given = bool(durable)
    if not given and not is_remote(dir):
        try:
            durable, endpoint = recorded(Path(dir)) or ("", endpoint)
        except CorruptCheckpoint as e:
            err.print(f"ckptrun: warning: {e}; listing {dir} alone")
    with contextlib.ExitStack() as stack:
        remote = None
        try:
            remote = stack.enter_context(reading(durable, endpoint or None)) if durable else None
        except CkptrunError as e:
            if given:
                raise
            err.print(f"ckptrun: warning: {durable}, which {dir} records, not read ({e}); listing {dir} alone")
        yield remote


def _ls(store: Store, as_json: bool, wide: bool, remote: Store | None = None) -> None:
    from .restore.chain_listing import group_diffs, restorable_lines
    from .storage import memory_status
    from .storage.store import full_name
    from .widthfit import Col, fit_table, left_out_line, print_tables

    ms = store.manifests()
    tiers = {m.name: ["local"] for m in ms}
    if remote is not None:  # (a step in both is listed from --dir; its format is the same there)
        there = remote.manifests()
        ms += [m for m in there if m.name not in tiers]
        for m in there:
            tiers.setdefault(m.name, []).append("remote")
        ms.sort(key=lambda m: (m.step, m.kind != "full"))
    for c in memory_status.live(store.root, of=memory_status.COPIES):
        if full_name(c["step"]) in tiers:
            tiers[full_name(c["step"])].append(f"copy:{c['rank']}")
    held = memory_status.live(store.root)
    step = min((h["step"] for h in held), default=None)
    copies = memory_status.live(store.root, of=memory_status.HELD_COPIES)  # of steps held in memory only
    listed = remote is not None or bool(copies) or any(len(t) > 1 for t in tiers.values())
    # (a remote --dir is read through a copy of its manifests: which ranks' parts it holds is no question there)
    here = {m.name: _ranks_here(store, m) for m in ms if "local" in tiers.get(m.name, []) and not store.copy_of}
    rows = [{"step": m.step, "kind": m.kind, "record": m.name, "bytes": m.bytes, "ranks": m.world_size,
             "ranks_here": here.get(m.name), "rank_bytes": m.rank_bytes or None,
             "depends_on": m.depends_on, "first_step": m.first_step, "layout": m.layout,
             # the two completions: the snapshot complete in host memory (the trainer could go on),
             # and persisted (committed: durable on every rank), as wall-clock times
             "snapshot_done_at": _time_or_none(m.meta.get("snapshot_done_at")), "persisted_at": m.committed_at,
             **({"tiers": tiers[m.name]} if listed else {})}
            for m in ms]
    if held:
        rows.append(_memory_row(step, held, "engine memory", ["memory"] if listed else None))
    for c in copies:
        rows.append(_memory_row(c["step"], [c], f"rank {c['rank']}'s copy", [f"copy:{c['rank']}"]))
    if as_json:
        out.print_json(json.dumps(rows))
        return
    shown = rows if wide else group_diffs(rows)
    columns = (Col("step", key=True), Col("kind", 1, justify="left"), Col("record", key=True, justify="left"),
               Col("bytes", 2), Col("ranks", 5), Col("bytes per rank", 4), Col("depends_on", 3, justify="left"),
               Col("layout", 6, justify="left"))
    cells = [[str(r["step"]) if r["first_step"] == r["step"] else f"{r['first_step']}-{r['step']}", r["kind"],
              r["record"], f"{r['bytes']:,}", str(r["ranks"]), _per_rank(r["rank_bytes"]),
              ", ".join(r["depends_on"]) or "-", r["layout"]] for r in shown]
    if all(r["ranks"] <= 1 for r in shown):  # bytes per rank would repeat bytes
        columns, cells = columns[:5] + columns[6:], [c[:5] + c[6:] for c in cells]
    if listed:
        columns += (Col("tiers", 1, justify="left"),)
        cells = [[*c, "+".join(r.get("tiers", ["memory"]))] for c, r in zip(cells, shown, strict=True)]
    table, left_out = fit_table(columns, cells, None if wide else out.width)
    print_tables([table], out)
    for line in restorable_lines(ms, out.width):
        out.print(line, soft_wrap=True)
    partial = [r for r in rows if r.get("ranks_here") is not None and len(r["ranks_here"]) < r["ranks"]]
    if partial:
        held = sorted({r for row in partial for r in row["ranks_here"]})
        out.print(f"note: {len(partial)} record(s) hold only rank(s) {', '.join(map(str, held)) or 'none'}'s "
                  "parts here (node-local --dir: see the other nodes' --dir, --durable or partners' memory)",
                  soft_wrap=True)
    if left_out:
        out.print(left_out_line(left_out, "--wide or --json shows them"))


def _memory_row(step: int, held: list[dict], layout: str, tiers: list[str] | None) -> dict:
    """`ls`'s row of a step held in engines' memory (`held`: memory_status.live's, by rank)."""
    return {"step": step, "kind": "memory", "record": "-", "bytes": sum(h["nbytes"] for h in held),
            "ranks": len(held), "rank_bytes": [h["nbytes"] for h in held], "depends_on": [], "first_step": step,
            "layout": layout, "snapshot_done_at": None, "persisted_at": None,
            **({"tiers": tiers} if tiers is not None else {})}


def _ranks_here(store: Store, m: Manifest) -> list[int] | None:
    """The ranks whose part of `m` --dir holds (None: it holds a part the manifest lacks)."""
    try:
        return store.ranks_held(m)
    except CorruptCheckpoint:
        return None


def _per_rank(sizes: list[int] | None) -> str:
    """Each rank's bytes (a few ranks), or their range (many)."""
    if not sizes:
        return "-"
    if len(sizes) <= 4:
        return " / ".join(f"{n:,}" for n in sizes)
    return f"{min(sizes):,} - {max(sizes):,}"


@app.command()
def verify(dir: ReadDir = "ckpts", optimizer_class: OptimizerClass = None, endpoint: Endpoint = "") -> None:
    """Re-check every field, checksum and dependency of the committed records; exit 1 listing the
    bad ones. Exit 0 means `restore` (with the same --optimizer-class) succeeds for every listed
    step. A record directory without a manifest is not committed (a crash leaves one torn, the next
    run removes it): it is noted, and does not fail the check."""
    from .storage.tiers.mirror import reading

    with reading(dir, endpoint or None, lambda store: None) as store:
        _verify(store, dir, optimizer_class)


def _verify(store: Store, dir: str, optimizer_class: list[str] | None) -> None:
    from .restore.recovery import optimizer_classes, verify_problems
    from .storage.dirlock import live_holder
    from .storage.schema import is_record_name

    running = live_holder(store.root)
    if running:
        out.print(f"note: a run is writing to {dir} ({running})", soft_wrap=True)
    # A record that retention removed while it was being checked (a run is writing) is no problem.
    problems = verify_problems(store, optimizer_classes(optimizer_class or []), torn=False)
    listed = {m.name for m in store.manifests(warn=False)}
    problems = [p for p in problems if (name := p.split(":", 1)[0]) in listed or store.is_committed(name)
                or not is_record_name(name)]  # (a region file's own problem names the file)
    n = len(listed)
    for p in problems:
        out.print(f"BAD {p}", soft_wrap=True)
    for name in store.incomplete():
        out.print(f"note: {name}: incomplete (no manifest; torn or still being written), not committed", soft_wrap=True)
    if problems:
        raise typer.Exit(1)
    out.print(f"ok: {n} committed record(s) verified in {dir}")


@app.command()
def bench(
    model: Annotated[str, typer.Option(help="Example GPT size: tiny (seconds, for tests), small (CPU; ~55 MB "
                                            "of state), wide (CPU; 1.7 GB of state, nearly all a wide "
                                            "embedding, against a step of ~2 s: more state per second of "
                                            "step than a disk writes), medium (GPU; ~1.3 GB), large (GPU; "
                                            "~4.3 GB).")] = "small",
    strategies: Annotated[str, typer.Option(help="What to measure, comma-separated: references (torch.save, "
                                                 "dcp-thread, dcp-process), ckptrun strategies and their variants "
                                                 "(an unknown name lists them all). `default`: "
                                                 "torch.save, dcp-thread and each strategy once at its defaults "
                                                 "(about 3 minutes on 2 cores with the other defaults, and a "
                                                 "short calibration run of none and each reference); `all`: "
                                                 "every reference, strategy and variant. NAME-nobudget: a "
                                                 "strategy at its defaults with --max-overhead off (beside NAME: "
                                                 "what the budget changes). `none` (no "
                                                 "checkpointing) always runs.")] = "default",
    every: Annotated[str, typer.Option(help="Checkpoint interval(s) in steps, comma-separated, e.g. 1,5,10,50; "
                                            "each configuration runs at each. `default` (shown as auto): "
                                            "each strategy at its own defaults (no --every), and the "
                                            "references (torch.save, DCP) every N steps, the fewest that "
                                            "keep them within the overhead budget: N from each one's cost "
                                            "per save, measured saving every step in a short calibration "
                                            "run against none's (for DCP, whose save then also waits for "
                                            "the previous one, an upper bound).")] = "default",
    steps: Annotated[int, typer.Option(help="Training steps per run (not with --failures: those runs last "
                                            "--duration).")] = 30,
    repeat: Annotated[int, typer.Option(help="Repetitions, interleaved; figures are their median, with their "
                                             "min-max in a second table (3 for figures to quote).")] = 1,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    trainer_threads: Annotated[int, typer.Option(help="torch threads of the trainer; the default 1 leaves "
                                                      "the checkpoint engine a core.")] = 1,
    warmup: Annotated[int, typer.Option(help="First steps of each run left out of step time and "
                                             "stall.")] = 2,
    dir: Annotated[str, typer.Option("--dir", help="Where runs write checkpoints (default: a temporary "
                                                   "folder on disk, not tmpfs, removed afterwards).")] = "",
    json_file: Annotated[str, typer.Option("--json", help="Write all figures and the machine description "
                                                          "to this JSON file.")] = "",
    plot: Annotated[str, typer.Option(help="Write a PNG chart here: overhead and stall per configuration; "
                                           "with --failures, goodput against MTBF (needs matplotlib: pip "
                                           "install 'ckptrun[plot]').")] = "",
    io_engine: Annotated[str, typer.Option(help="The strategies' file writer: auto, native or python; "
                                                "several, comma-separated (e.g. native,python), run each "
                                                "strategy with each, named STRATEGY:ENGINE.")] = "auto",
    failures: Annotated[str, typer.Option(help="Goodput mode: train each configuration for --duration while "
                                               "kills come at exponential times of mean --mtbf (seeded, the "
                                               "same for every configuration): `worker` kills the training "
                                               "processes (the launcher restarts them), `node` the whole "
                                               "process tree (the bench starts it again).")] = "",
    mtbf: Annotated[str, typer.Option(help="Mean time between failures: of the predicted waste column "
                                           "(default 1h); with --failures, of the kills (default 30s; "
                                           "several, comma-separated, give goodput against MTBF).")] = "",
    duration: Annotated[str, typer.Option(help="With --failures: wall-clock budget of each run, e.g. "
                                               "2m.")] = "2m",
    seed: Annotated[int, typer.Option(help="With --failures: seed of the kill schedule (repetition r uses "
                                           "seed + r).")] = 0,
    failure_log: Annotated[str, typer.Option(help="With --failures: replay this failure trace (ISO-8601 "
                                                  "timestamps, one per line, as `tune --failure-log` reads; "
                                                  "--traces writes them) instead of drawing kills.")] = "",
    traces: Annotated[str, typer.Option(help="With --failures: write each kill schedule used to this folder "
                                             "as a failure trace.")] = "",
    wide: Annotated[bool, typer.Option("--wide", help="Every column of the tables, however narrow the terminal "
                                                      "(by default the less important ones are left out where "
                                                      "they do not fit, and said so).")] = False,
    durable: Annotated[str, typer.Option(help="A --durable URL (s3://bucket/prefix, or a path): each strategy "
                                              "also runs draining to it (each run under a prefix of its own), "
                                              "as NAME+durable, whose ratio is against NAME: what the remote "
                                              "tier adds.")] = "",
    nodes: Annotated[int, typer.Option(help="1, or 2: each run on two nodes, each a network namespace of its "
                                            "own on this machine (needs root), DDP between them; `none` runs "
                                            "under torchrun, the references are left out; after the timed "
                                            "steps node 1 is lost and replaced, and its recovery timed "
                                            "(README: Replicated memory tier).")] = 1,
    replicas: Annotated[int, typer.Option(help="With --nodes 2: each strategy that takes --replicas also runs "
                                               "as NAME+node-local (a --dir per node, --node-local-dir; "
                                               "against NAME, one shared --dir) and as NAME+replicas (the "
                                               "same with --replicas K; against NAME+node-local): what the "
                                               "copies in the partner's memory add, and how much sooner a "
                                               "lost node is back.")] = 1,
    max_overhead: Annotated[str, typer.Option(help="The overhead budget in percent of the no-checkpoint step "
                                                   "(`off`: none), passed to every ckptrun run as "
                                                   "--max-overhead when given (else the runs keep their "
                                                   "default, 5%); the references' intervals at --every "
                                                   "default keep it too.")] = "",
    host_memory: Annotated[str, typer.Option(help="Passed to every ckptrun run as --host-memory when given "
                                                  "(e.g. 12G for a state the default 25% of memory cannot "
                                                  "stage twice).")] = "",
) -> None:
    """Measure every strategy against no checkpointing, torch.save and DCP async_save; with
    --failures, their goodput when failures really happen.

    Where a configuration's cost goes, per timed step (docs/performance.md): `fwd+bwd ms` is the
    script's forward, backward and gradient clipping (the work before optimizer.step(), ckptrun's
    gradient hooks included), `fwd+bwd ratio` that time against its reference's (`against`):
    above 1x, checkpointing slowed compute itself (a copy or the engine on the trainer's core or
    memory bandwidth). `trainer CPU ms`, `engine CPU ms` and `launcher CPU ms` are the CPU time
    (user + system) per step of the training process (every thread of it), of the checkpoint
    engine (ckptrun's engine; DCP's checkpoint daemon for dcp-process; 0 where there is none)
    and of ckptrun's launcher (- for the references: no launcher).

    A second table sets each configuration against the overhead budget: the overhead the run
    measured itself (`run says`; a configuration marked * said its strategy cannot keep within
    the budget), the stall by cause, the freshness of what is saved (steps from each timed step
    back to the newest step in host memory and on disk, median/max) and the predicted waste at
    --mtbf: the overhead plus each failure's lost work and recovery over the MTBF, by the tiers'
    model fed with the measured figures.
    """
    from .bench import BenchOptions, run_bench

    raise typer.Exit(run_bench(BenchOptions(model, strategies, every, steps, repeat, device, trainer_threads,
                                            warmup, dir, json_file, plot, io_engine, failures, mtbf, duration,
                                            seed, failure_log, traces, wide, durable, nodes, replicas,
                                            max_overhead, host_memory), out,
                                 err))


@app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
def tune(
    script: Script,
    script_args: ScriptArgs = None,
    strategies: Annotated[str, typer.Option(help="Comma-separated strategies to profile (default: every "
                                                 "registered one).")] = "",
    profile_steps: Annotated[int, typer.Option(min=2, help="Steps measured per profiling run (after a "
                                                           "few warm-up steps).")] = 20,
    mtbf: Mtbf = "",
    mtbf_process: MtbfProcess = "",
    mtbf_node: MtbfNode = "",
    mtbf_job: MtbfJob = "",
    failure_log: Annotated[Path | None, typer.Option(help="Estimate the MTBF from this file of past failure "
                                                          "times, one ISO-8601 timestamp per line, each "
                                                          "optionally followed by its kind (process, node, "
                                                          "job): the kinds logged then split it.")] = None,
    replicas: Annotated[int, typer.Option(min=1, help="The run's --replicas: with K > 1 node failures resume "
                                                      "from partners' memory in the tiers' model.")] = 1,
    node_local_dir: NodeLocalDir = False,
    max_overhead: Annotated[str, typer.Option(help="Overhead budget in percent of step time (PCcheck's "
                                                   "slowdown bound; no interval is chosen above it).")] = "5",
    dir: Annotated[str, typer.Option("--dir", help="Checkpoint directory whose filesystem is measured "
                                                   "(profiling writes into a scratch folder there).")] = "ckpts",
    write: Annotated[Path | None, typer.Option(help="Write the recommendation as a recipe YAML for "
                                                    "`ckptrun --recipe`.")] = None,
    json_file: Annotated[Path | None, typer.Option("--json", help="Write every measurement, setting and "
                                                                   "prediction to this JSON file.")] = None,
    upload_mbps: Annotated[float, typer.Option(min=0, help="Upload bandwidth to a --durable store in MB/s "
                                                           "(tune measures none): adds the remote tier, with "
                                                           "the --durable-every auto would take.")] = 0.0,
    durable_every: Annotated[str, typer.Option(help="With --upload-mbps: the remote tier's interval in steps, "
                                                    "kept as given (auto: the tiers' model).")] = "auto",
    repeat_budget: Annotated[str, typer.Option(help="Time for measuring again, in rounds interleaved with the "
                                                    "baseline, the strategies whose slowdown against no "
                                                    "checkpointing is within the noise of the baseline's steps "
                                                    "(e.g. 2m; 0: measure once). What is still within noise "
                                                    "then is reported as such and counted as 0.")] = "2m",
) -> None:
    """Profile SCRIPT briefly under each strategy; print the optimal settings and a recommendation."""
    from .tuning.durations import failure_log_kinds, mtbf_from_failure_log
    from .tuning.levels import Layout
    from .tuning.plan import parse_percent
    from .tuning.report import print_report, to_json, write_recipe
    from .tuning.tune import choose_strategies
    from .tuning.tune import tune as run_tune

    if mtbf and failure_log:
        raise UsageError("give either --mtbf or --failure-log, not both")
    if durable_every != "auto" and not (durable_every.isdigit() and int(durable_every) > 0):
        raise UsageError(f"--durable-every must be a number of steps or auto (got {durable_every!r})")
    if durable_every != "auto" and not upload_mbps:
        raise UsageError("--durable-every needs --upload-mbps: the remote tier's cost is its upload")
    mtbf_s, source, logged = (_duration("--mtbf", mtbf) if mtbf else 0.0), "", None
    if failure_log:
        try:
            mtbf_s, logged = mtbf_from_failure_log(failure_log), failure_log_kinds(failure_log)
        except (OSError, ValueError) as e:
            raise UsageError(f"--failure-log: {e}") from None
        source = f"estimated from {failure_log}"
    _, rates = _rates(mtbf_s, {"process": mtbf_process, "node": mtbf_node, "job": mtbf_job}, source, logged)
    budget = parse_percent(max_overhead)
    repeat_s = 0.0 if repeat_budget.strip() in ("0", "0s") else _duration("--repeat-budget", repeat_budget)
    result = run_tune(script, list(script_args or []), strategies=choose_strategies(strategies),
                      profile_steps=profile_steps, rates=rates, max_overhead=budget, ckpt_dir=dir,
                      progress=lambda line: err.print(f"tune: {line}", markup=False, soft_wrap=True),
                      repeat_budget_s=repeat_s, layout=Layout(replicas, node_local_dir), upload_Bps=upload_mbps * 1e6,
                      durable_every=None if durable_every == "auto" else int(durable_every))
    print_report(out, result)
    if json_file:
        json_file.write_text(json.dumps(to_json(result), indent=2) + "\n")
    if write:
        write_recipe(write, result)
        err.print(f"wrote {write}; run it with: ckptrun --recipe {write} {script}", markup=False, soft_wrap=True)


_COMMANDS = {"run", "restore", "ls", "verify", "strategies", "bench", "tune"}


def main(argv: list[str] | None = None) -> int:
    """Console entry point: `run` is the default command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in _COMMANDS and argv[0] not in ("--help", "-h"):
        argv.insert(0, "run")
    try:
        app(argv, prog_name="ckptrun")
    except CkptrunError as e:
        err.print(f"ckptrun: error: {e}", markup=False, soft_wrap=True)  # one line, however long
        return e.exit_code
    except SystemExit as e:  # typer's own exits: usage errors (2), --help (0), typer.Exit
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        err.print("ckptrun: interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
