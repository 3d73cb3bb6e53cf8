"""scripts/gpu-check: the prepared device check (issues 29 and 58), in two calls of one device
session (15 minutes, start-up included).

It prints the device line first, then runs its call's parts in order, each stopped at its own
time budget (saying what it did not reach): the install (the carried wheels, the working tree),
the tests the last device runs did not pass (CUDA tests, the crash matrix on CUDA), `ckptrun
bench --device cuda` at steady state (--every 10, then 1; rows not measured before first, the
stall split by cause), then the tests passed before, again. `--dry-run` shows both calls and
what neither reaches. One Markdown report, the bench JSON and `reached.json` (the next
session's `--last`) go to the output folder. Exit 0 when every part passed, 1 otherwise, 2 on
bad input.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import textwrap
from pathlib import Path

from . import execute, report
from .plan import CALL_S, LAST_RUN, PARTS, REPO, SETUP_LOG, last_run, plan, pythonpath, schedule

WIDTH = 80


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.splitlines()[0],
                                epilog="Before the device call, here: scripts/gpu-wheels (fills .whl, which the call "
                                       "carries).")
    p.add_argument("--dry-run", action="store_true", help="print what would run, in order, with each part's "
                                                          "time budget; run nothing")
    p.add_argument("--cpu", action="store_true", help="run the same parts on the CPU with tiny sizes (finds the "
                                                      "check's own bugs before a device is lent)")
    p.add_argument("--call", type=int, choices=range(1, len(CALL_S) + 1), default=1,
                   help="which call of the session this is (default 1); --dry-run shows every call")
    p.add_argument("--last", default=str(LAST_RUN), metavar="FILE",
                   help="what the last device runs passed and measured: the plan puts the rest first "
                        "(default: the record in scripts/gpucheck; a check leaves its own as reached.json)")
    p.add_argument("--parts", default=",".join(PARTS[2:]),
                   help=f"comma-separated parts to run after the device line and the install, which always run "
                        f"(default: all): {', '.join(PARTS[2:])}")
    p.add_argument("--budget", default="", metavar="PART=S[,PART=S]",
                   help="give parts other time budgets in seconds, e.g. bench-every-10=300 (a second call "
                        "that runs only what the first did not reach)")
    p.add_argument("--out", default="", help="where the report, logs and bench JSON go (default: $OUT, else "
                                             "gpu-check-out/ in the repository)")
    args = p.parse_args(argv)
    wanted = [w.strip() for w in args.parts.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in PARTS[2:]]
    if unknown or not wanted:
        p.error(f"--parts takes {', '.join(PARTS[2:])} (got {args.parts!r})")
    args.parts = [*PARTS[:2], *wanted]
    args.budget = budgets(p, args.budget)
    args.last = Path(args.last)
    try:
        last_run(args.last)
    except (OSError, ValueError, AttributeError, TypeError) as e:
        p.error(f"--last {args.last}: not a record of what the last runs passed and measured ({e})")
    return args


def budgets(p: argparse.ArgumentParser, text: str) -> dict[str, int]:
    given = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, _, seconds = item.partition("=")
        if name not in PARTS or not seconds.isdigit() or int(seconds) < 1:
            p.error(f"--budget takes PART=SECONDS with a part of {', '.join(PARTS)} (got {item!r})")
        given[name] = int(seconds)
    return given


def show_plan(args: argparse.Namespace, out: Path) -> None:
    """Every call's parts (as --parts and --budget leave them), and what neither reaches."""
    planned = schedule(args.cpu, out, args.last)
    print(wrap(f"gpu-check --dry-run: {len(planned.calls)} calls of one session on {'the CPU' if args.cpu else 'CUDA'}"
               f"; output: {out}; the parts import from PYTHONPATH={pythonpath(args.cpu)}; done before: "
               f"{args.last}", "", "  "))
    for call in range(1, len(planned.calls) + 1):
        parts = plan(args.cpu, out, args.parts, args.budget, call, args.last)
        total = sum(p.budget_s for p in parts)
        print(f"call {call}{' (this one)' if call == args.call else ''}: scripts/gpu-check --call {call}, "
              f"{len(parts)} parts, {total} s ({total / 60:.1f} min)")
        for i, part in enumerate(parts, 1):
            print(wrap(f"{i}. {part.name}, {part.budget_s} s: {part.what}", "", "   "))
            print(wrap(f"$ {part.shown()}", "   ", "     "))
    print(wrap(f"reached by neither call (a later session): {', '.join(planned.left) or 'nothing'}", "", "  "))


def wrap(text: str, first: str, rest: str) -> str:
    return "\n".join(textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest,
                                   break_on_hyphens=False))


def main(argv: list[str]) -> int:
    args = parse(argv)
    out = Path(args.out or os.environ.get("OUT") or REPO / "gpu-check-out").resolve()
    if args.dry_run:
        show_plan(args, out)
        return 0
    parts = plan(args.cpu, out, args.parts, args.budget, args.call, args.last)
    out.mkdir(parents=True, exist_ok=True)
    for name in {p.log_name for p in parts} | {report.REPORT, report.REACHED}:  # (an earlier check's)
        (out / name).unlink(missing_ok=True)
    env = execute.environment(pythonpath(args.cpu))
    results, device, blocked = [], "device: unknown", ""
    for part in parts:
        if blocked:
            results.append(execute.Result(part, f"not run ({blocked})"))
            print(f"gpu-check: {part.name}: not run ({blocked})", flush=True)
            continue
        result = execute.run(part, out, env if part.name != "device" else {**os.environ})
        results.append(result)
        if part.name == "device":
            log = (out / SETUP_LOG).read_text(errors="replace").splitlines()
            device = next((line for line in log if line.startswith("device:")), device)
            print(device, flush=True)
        print(summary(result), flush=True)
        if not result.ok and part.name in ("device", "install"):
            blocked = f"{part.name} failed"
    path = report.write(out, shlex.join(["scripts/gpu-check", *argv]), device, results)
    print(f"gpu-check: report {path}; for the next call's --last: "
          f"{report.reached(out, last_run(args.last), results)}", flush=True)
    return 0 if all(r.ok for r in results) else 1


def summary(r: execute.Result) -> str:
    line = f"gpu-check: {r.part.name}: {r.status} in {r.seconds:.0f} s (budget {r.part.budget_s} s)"
    if r.failed:
        line += f"; failed: {', '.join(r.failed)}"
    if r.not_reached:
        line += f"; not reached: {len(r.not_reached)}"
    return wrap(line, "", "  ")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
