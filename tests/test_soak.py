"""Memory stays flat over any run length (design notes, invariant 3): a tiny model checkpointed
every step for many steps, the RSS of the launcher, the engine and the worker sampled by step;
after warm-up none may grow by more than a few MB.

Default: 8,000 steps for SOAK_DEFAULT (lowdiff: its engine batches diffs and commits
records, its worker once kept one entry per step, and its launcher and worker run the code every
strategy shares; 35-40 s on 2 loaded cores): the default suite's budget does not allow every
strategy (checkfreq took 70 s). --full: every registered strategy for
50,000 steps. Each test prints every process's growth per 10,000 steps. A deliberate leak of
2.5 KB per step in the worker fails it (5,000 steps: worker +8.5 MB after warm-up, +26 MB per
10,000 steps; 8,000 steps hold 4,800 after warm-up: ~12 MB).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import psutil
import pytest
from conftest import SCRIPTS, full, kill_tree, spawn, strategy_params

DEFAULT_STEPS, FULL_STEPS = 8_000, 50_000
SOAK_DEFAULT = ("lowdiff",)
WARMUP = 0.4  # of the steps: lowdiff reaches its largest batch only after its first re-based chains (~3,000 steps)
LIMIT_MB = 5.0  # growth after warm-up allowed per process (a loaded machine moves an engine by 2-4 MB)
SAMPLE_S = 0.25
# The host-memory budget of the soak runs: what a strategy may hold is bounded by it, not by the
# run's length (lowdiff's auto batch, re-tuned up to F diffs of ~50 KB each for this model, holds
# at most ~300 of them, reached within the warm-up).
BUDGET = "16M"
MB = 2**20


def roles(launcher: psutil.Process) -> dict[str, int]:
    """RSS by role: the launcher, its engine(s) and worker(s) (summed per role)."""
    out = {"launcher": launcher.memory_info().rss}
    for p in launcher.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            role = ("worker" if "ckptrun.worker.bootstrap" in cmd else
                    "engine" if "spawn_main" in cmd and "resource_tracker" not in cmd else None)
            if role:
                out[role] = out.get(role, 0) + p.memory_info().rss
        except psutil.Error:
            continue
    return out


def soak(tmp_path: Path, strategy: str, steps: int, timeout_s: float) -> list[tuple[int, dict[str, int]]]:
    """Run the soak script; returns (step reached, RSS by role) samples."""
    progress = tmp_path / "progress"
    proc = spawn(tmp_path, "run", "--strategy", strategy, "--every", "1", "--dir", "ckpts", "--host-memory", BUDGET,
                 SCRIPTS / "soak.py", steps, progress)
    samples: list[tuple[int, dict[str, int]]] = []
    deadline = time.monotonic() + timeout_s
    try:
        launcher = psutil.Process(proc.pid)
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"soak of {strategy} ran past {timeout_s:.0f} s"
            try:
                step = int(progress.read_text())
                rss = roles(launcher)
            except (OSError, ValueError, psutil.Error):
                step, rss = 0, {}
            if step and len(rss) == 3:
                samples.append((step, rss))
            time.sleep(SAMPLE_S)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    log = (tmp_path / "ckptrun.log").read_text()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{log[-3000:]}"
    return samples


def growth(samples: list[tuple[int, dict[str, int]]], steps: int) -> dict[str, tuple[float, float, float]]:
    """{role: (MB after warm-up, MB at the end, growth in MB per 10,000 steps)}: medians of the
    first and last few samples after warm-up, before the script's last step."""
    warm = [(s, r) for s, r in samples if steps * WARMUP <= s < steps]
    assert len(warm) >= 8, f"too few samples after warm-up ({len(warm)}): {samples[-3:]}"
    first, last = warm[:4], warm[-4:]
    span = statistics.median(s for s, _ in last) - statistics.median(s for s, _ in first)
    out = {}
    for role in warm[0][1]:
        a = statistics.median(r[role] for _, r in first) / MB
        b = statistics.median(r[role] for _, r in last) / MB
        out[role] = (a, b, (b - a) / max(span, 1) * 10_000)
    return out


@pytest.mark.parametrize("strategy", strategy_params(SOAK_DEFAULT))
def test_memory_is_flat(strategy, tmp_path, request, capsys):
    steps = FULL_STEPS if full(request.config) else DEFAULT_STEPS
    samples = soak(tmp_path, strategy, steps, timeout_s=240 + steps * 0.05)
    found = growth(samples, steps)
    with capsys.disabled():
        print(f"\nsoak {strategy}, {steps} steps, RSS after warm-up -> end:  " + ";  ".join(
            f"{role} {a:.1f} -> {b:.1f} MB ({per10k:+.2f} MB per 10,000 steps)"
            for role, (a, b, per10k) in found.items()))
    grew = {role: b - a for role, (a, b, _) in found.items() if b - a > LIMIT_MB}
    assert not grew, f"{strategy}: RSS grew after warm-up by more than {LIMIT_MB} MB: " + ", ".join(
        f"{role} +{mb:.1f} MB" for role, mb in grew.items())
