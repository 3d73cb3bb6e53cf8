"""The check's one Markdown report: the device line, the command and date, each part's result
and budget, what it did not reach, and its log's telling lines (the bench's tables whole); and
`reached.json`: the last runs' record (plan.LAST_RUN's form) with this run's added, for the next
call's `--last`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .execute import Result

REPORT = "gpu-check.md"
REACHED = "reached.json"
TAIL_LINES = 40  # of a test part's log, after its failures
BENCH_LINES = 400


def write(out: Path, command: str, device: str, results: list[Result]) -> Path:
    lines = [f"# ckptrun GPU check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             f"- {device}", f"- command: `{command}`",
             f"- budget {sum(r.part.budget_s for r in results)} s, took {sum(r.seconds for r in results):.0f} s", "",
             "| part | budget s | took s | result |", "|---|---|---|---|"]
    lines += [f"| {r.part.name} | {r.part.budget_s} | {r.seconds:.0f} | {r.status} |" for r in results]
    for r in results:
        lines += ["", f"## {r.part.name}: {r.status}", "", r.part.what]
        if r.failed:
            lines += ["", "Failed: " + ", ".join(f"`{f}`" for f in r.failed)]
        if r.not_reached:
            lines += ["", f"Not reached ({len(r.not_reached)}): " + ", ".join(f"`{n}`" for n in r.not_reached)]
        log = out / r.part.log_name
        if log.is_file() and not r.status.startswith("not run"):
            text = section(log.read_text(errors="replace"), r.part.name)
            lines += ["", "```", *excerpt(text, bench=bool(r.part.configs)), "```"]
    path = out / REPORT
    path.write_text("\n".join(lines) + "\n")
    return path


def section(text: str, name: str) -> str:
    """The part's own section of a log several parts share (each starts with "==== NAME:")."""
    start = text.find(f"==== {name}:")
    end = text.find("\n==== ", start + 1) if start >= 0 else -1
    return text[max(start, 0): end if end >= 0 else len(text)]


def excerpt(text: str, *, bench: bool) -> list[str]:
    """A bench log whole (its progress lines and tables); of a test log, its failure and error
    lines and its tail."""
    lines = text.splitlines()
    if bench:
        return lines[-BENCH_LINES:]
    telling = [line for line in lines[:-TAIL_LINES] if line.startswith(("FAILED", "ERROR", "E "))]
    return [*telling[:60], *lines[-TAIL_LINES:]]


def reached(out: Path, last: dict, results: list[Result]) -> Path:
    """The tests passed (before, or now; a failure now takes one out) and the bench rows measured
    (before, or now without failing), for `--last`."""
    passed = set(last["passed"])
    bench = {every: set(configs) for every, configs in last["bench"].items()}
    for r in results:
        if r.part.tests:
            passed = (passed - set(r.failed)) | set(r.passed)
        elif r.part.configs:
            every = int(r.part.name.rsplit("-", 1)[1])
            bench[every] = bench.get(every, set()) | set(r.passed)
    path = out / REACHED
    path.write_text(json.dumps({"run": f"with the check of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
                                "passed": sorted(passed),
                                "bench": {str(k): sorted(v) for k, v in sorted(bench.items(), reverse=True)}},
                               indent=2) + "\n")
    return path
