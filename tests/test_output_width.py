"""Tables read at any width: the identifying column (record, configuration) is never cut; at a
narrow terminal the less important columns are left out and one line says which and how to see
them (`ls`, the bench table; ckptrun/widthfit.py)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from ckptrun import cli
from ckptrun.bench import plan, report, stats
from ckptrun.bench.figures import RunFigures
from ckptrun.bench.runner import Outcome


def _lines(console: Console) -> list[str]:
    return console.file.getvalue().splitlines()


@pytest.mark.parametrize("width", [80, 120])
def test_ls_keeps_record_names_whole_and_says_what_it_left_out(example_run, monkeypatch, width):
    ckpt = example_run("sync")
    console = Console(file=io.StringIO(), width=width)
    monkeypatch.setattr(cli, "out", console)
    assert cli.main(["ls", "--dir", str(ckpt)]) == 0
    lines = _lines(console)
    assert all(len(ln) <= width for ln in lines), lines
    names = {r["record"] for r in json.loads(_json_ls(ckpt, monkeypatch))}
    assert names and all(any(f" {n} " in ln for ln in lines) for n in names), lines
    header = lines[1]
    note = [ln for ln in lines if ln.startswith("not shown: ")]
    # (one rank: no bytes per rank column, it would repeat bytes)
    missing = [h for h in ("kind", "bytes", "ranks", "depends_on", "layout") if h not in header]
    if missing:
        assert note and all(h in note[0] for h in missing) and "--wide" in note[0], lines
    else:
        assert not note
    console = Console(file=io.StringIO(), width=width)
    monkeypatch.setattr(cli, "out", console)
    assert cli.main(["ls", "--dir", str(ckpt), "--wide"]) == 0
    assert "layout" in _lines(console)[1] and not [ln for ln in _lines(console) if ln.startswith("not shown")]


def _json_ls(ckpt, monkeypatch) -> str:
    console = Console(file=io.StringIO(), width=80)
    monkeypatch.setattr(cli, "out", console)
    assert cli.main(["ls", "--dir", str(ckpt), "--json"]) == 0
    return console.file.getvalue()


def _rows() -> list[dict]:
    configs = plan.configurations("torch.save,lightcheck-whole,lightcheck-region,lightcheck-host", "1")
    figures = [RunFigures(step_s=0.1 + 0.01 * k, stall_ms_per_step=12.0, bytes_per_step=55e6, write_MBps=812.0,
                          peak_rss_MB=900.0, committed=30, recovery_s=2.5) for k in range(3)]
    outcomes = {c.name: [Outcome(f, None, 1.0) for f in figures] for c in configs}
    outcomes["lightcheck-host"] = [Outcome(None, "boom\ntraceback", 1.0)]
    return stats.summarize(configs, outcomes)


@pytest.mark.parametrize("width", [80, 120])
def test_bench_table_names_every_configuration_and_puts_ranges_apart(width):
    console = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
    report.print_tables(report.tables(_rows(), "bench", report.report_width(console, False)), console)
    lines = _lines(console)
    assert all(len(ln) <= width for ln in lines), "\n".join(lines)
    text = "\n".join(lines)
    for name in ("lightcheck-whole", "lightcheck-region", "lightcheck-host", "torch.save"):
        assert f" {name} " in text
    assert "…" not in text
    main, _, rest = text.partition("min-max over the 3 repetitions")
    assert "[" not in main and "100.0-120.0" in rest  # medians first, ranges in their own table
    assert "not shown: " in text and "--wide" in text and "--json" in text
    assert "lightcheck-host failed: boom" in lines[-1]
    wide = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
    report.print_tables(report.tables(_rows(), "bench", report.report_width(wide, True)), wide)
    shown = wide.file.getvalue()
    assert all(h in shown for h in ("page cache MB", "fwd+bwd ratio", "trainer CPU ms", "engine CPU ms"))
    assert "not shown" not in shown


@pytest.mark.parametrize("width", [80, 120])
def test_strategies_lines_hang_under_their_summary(monkeypatch, width):
    """`ckptrun strategies`: each summary folded within the width, under itself, never mid-word."""
    from ckptrun.strategies import REGISTRY

    console = Console(file=io.StringIO(), width=width)
    monkeypatch.setattr(cli, "out", console)
    assert cli.main(["strategies"]) == 0
    lines = _lines(console)
    assert all(len(ln) <= width for ln in lines), lines
    starts = [ln.split()[0] for ln in lines if not ln.startswith(" ")]
    assert starts == list(REGISTRY), lines
    text = " ".join(ln.split(None, 1)[1] if not ln.startswith(" ") else ln.strip() for ln in lines)
    assert all(entry.summary in text for entry in REGISTRY.values()), lines
