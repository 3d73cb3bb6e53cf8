"""Tuning formulas (DESIGN §6): hand-computed values, closed forms against numeric minimisation,
unit consistency, and the duration / failure-log parsers."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from ckptrun.strategies.gockpt import model as gockpt_model
from ckptrun.strategies.lowdiff.model import (
    LowDiffCosts,
    continuous_optimum,
    numeric_optimal_fb,
    optimal_fb,
    paper_eq10,
    retune,
    waste_fraction,
    wasted_time,
)
from ckptrun.strategies.pccheck import model as pccheck_model
from ckptrun.tuning.durations import format_duration, mtbf_from_failure_log, parse_duration
from ckptrun.tuning.intervals import (
    checkfreq_min_interval_steps,
    daly_interval,
    expected_lost_work_s,
    expected_waste,
    young_interval,
)

GB = 1e9
H = 3600.0

# ---------------------------------------------------------------------------------------------
# Young / Daly / CheckFreq / first-order waste


def test_young_hand_value():
    # delta = 5 min, M = 24 h: sqrt(2 * 300 * 86400) = 7200 s = 120 min.
    assert young_interval(300, 86400) == pytest.approx(7200.0, rel=1e-12)


def test_daly_hand_value():
    # 120 min * (1 + (1/3)(1/24) + (1/9)(1/576)) - 5 min = 116.6898148... min
    assert daly_interval(300, 86400) / 60 == pytest.approx(116.68981481481, rel=1e-9)
    assert round(daly_interval(300, 86400) / 60, 1) == 116.7


@pytest.mark.parametrize("delta,mtbf", [(200.0, 100.0), (1000.0, 10.0), (7200.0, 3600.0)])
def test_daly_large_delta_gives_mtbf(delta, mtbf):
    assert daly_interval(delta, mtbf) == mtbf


def test_daly_just_below_two_mtbf_uses_formula():
    # 2M*(1 + 1/3 + 1/9) - 2M = 8M/9, not M: the branch boundary is at delta = 2M exactly.
    assert daly_interval(199.999999, 100.0) == pytest.approx(800 / 9, rel=1e-6)


def test_expected_waste_hand_value():
    # 60/3600 + (1800 + 600)/86400
    assert expected_waste(3600, 60, 86400, restart_s=600) == pytest.approx(1 / 60 + 2400 / 86400)
    assert expected_lost_work_s(3600) == 1800


@pytest.mark.parametrize("delta,mtbf", [(300.0, 86400.0), (5.0, 3600.0), (40.0, 4 * H)])
def test_young_minimises_first_order_waste(delta, mtbf):
    taus = np.geomspace(1.0, 100 * mtbf, 200_001)
    waste = delta / taus + (taus / 2) / mtbf
    best = taus[np.argmin(waste)]
    assert young_interval(delta, mtbf) == pytest.approx(best, rel=1e-3)
    assert expected_waste(young_interval(delta, mtbf), delta, mtbf) == pytest.approx(waste.min(), rel=1e-6)


@pytest.mark.parametrize(
    "persist,step,expected", [(10, 3, 4), (0.3, 0.1, 3), (0.6, 0.2, 3), (0.05, 1, 1), (6, 2, 3)]
)
def test_checkfreq_bound(persist, step, expected):
    assert checkfreq_min_interval_steps(persist, step) == expected


@pytest.mark.parametrize(
    "call",
    [
        lambda: young_interval(0, 100),
        lambda: young_interval(5, -1),
        lambda: daly_interval(float("nan"), 100),
        lambda: checkfreq_min_interval_steps(1, 0),
        lambda: expected_waste(-1, 5, 100),
        lambda: expected_waste(10, 5, 100, restart_s=-1),
    ],
)
def test_interval_validation(call):
    with pytest.raises(ValueError, match="must be"):
        call()


# ---------------------------------------------------------------------------------------------
# LowDiff eq. (8) / (10)


def _ld(t, size_gb, bw_gbs, load, replay, mtbf_h, diff_gb=0.1, gpus=1):
    return LowDiffCosts(
        step_time=t,
        full_ckpt_bytes=size_gb * GB,
        diff_bytes=diff_gb * GB,
        write_bandwidth=bw_gbs * GB,
        full_load_time=load,
        diff_replay_time=replay,
        mtbf=mtbf_h * H,
        num_gpus=gpus,
    )


# step s, full ckpt GB, write GB/s, load s, replay s/record, MTBF h
REALISTIC = [
    _ld(0.1, 0.5, 2.0, 2.0, 0.02, 24),  # ResNet-class, fast steps
    _ld(0.3, 1.4, 2.0, 5.0, 0.05, 12),  # GPT2-S
    _ld(0.5, 8.7, 2.0, 20.0, 0.20, 2),  # GPT2-L, flaky cluster
    _ld(1.0, 10.0, 2.0, 30.0, 0.10, 24),
    _ld(2.0, 50.0, 5.0, 60.0, 0.50, 6),
    _ld(5.0, 100.0, 10.0, 120.0, 1.00, 1),  # big model on spot VMs
    _ld(0.05, 0.2, 1.0, 1.0, 0.01, 168),  # small model, reliable
    _ld(1.5, 16.0, 0.5, 40.0, 0.30, 0.5),  # slow disk, very frequent failures
    _ld(0.8, 3.8, 3.0, 10.0, 0.08, 48, gpus=8),
    _ld(3.0, 30.0, 1.5, 90.0, 2.00, 4),
    _ld(0.2, 1.3, 5.0, 3.0, 0.03, 72),
    _ld(10.0, 200.0, 8.0, 300.0, 1.50, 12),
]


def test_wasted_time_hand_value():
    c = LowDiffCosts(step_time=2, full_ckpt_bytes=100, diff_bytes=1, write_bandwidth=10,
                     full_load_time=5, diff_replay_time=1, mtbf=1000, num_gpus=2)
    # per failure: B*t/2 + R_F + R_D/2*(F/B - 1) = 5 + 5 + 4.5; 10 failures; 100 fulls of 10 s.
    assert wasted_time(c, 50, 5, horizon_s=10_000) == pytest.approx(2 * (10 * 14.5 + 100 * 10))
    assert waste_fraction(c, 50, 5) == pytest.approx((10 * 14.5 + 100 * 10) / 10_000)


@pytest.mark.parametrize("costs", REALISTIC, ids=range(len(REALISTIC)))
def test_lowdiff_closed_form_matches_grid_argmin(costs):
    f_max, b_max = 2_000_000, 400
    f_num, b_num = numeric_optimal_fb(costs, f_max, b_max)
    assert f_num < f_max and b_num < b_max, "optimum must be inside the searched grid"
    f_cf, b_cf = optimal_fb(costs)
    assert 1 <= b_cf <= f_cf
    assert waste_fraction(costs, f_cf, b_cf) == pytest.approx(waste_fraction(costs, f_num, b_num), rel=1e-12)
    assert abs(f_cf - f_num) <= 1 and abs(b_cf - b_num) <= 1


@pytest.mark.parametrize("costs", REALISTIC, ids=range(len(REALISTIC)))
def test_lowdiff_continuous_optimum_is_stationary(costs):
    f_c, b_c = continuous_optimum(costs)
    w0 = waste_fraction(costs, f_c, b_c)
    for df in (0.98, 1.0, 1.02):
        for db in (0.98, 1.0, 1.02):
            f, b = f_c * df, max(1.0, b_c * db)
            if (df, db) != (1.0, 1.0) and b <= f:
                assert waste_fraction(costs, f, b) > w0


def test_numeric_search_equals_exhaustive_grid():
    # Small optimum so that a plain double loop over every (F, B) is cheap.
    c = LowDiffCosts(step_time=1.0, full_ckpt_bytes=2e9, diff_bytes=1e7, write_bandwidth=1e9,
                     full_load_time=3.0, diff_replay_time=0.5, mtbf=600.0)
    f_max, b_max = 400, 40
    grid = [(waste_fraction(c, f, b), f, b) for b in range(1, b_max + 1) for f in range(b, f_max + 1)]
    _, f_best, b_best = min(grid)
    assert 1 < f_best < f_max and 1 < b_best < b_max
    assert numeric_optimal_fb(c, f_max, b_max) == (f_best, b_best)
    assert optimal_fb(c) == (f_best, b_best)


def _in_ms(c: LowDiffCosts) -> LowDiffCosts:
    return replace(c, step_time=c.step_time * 1e3, write_bandwidth=c.write_bandwidth / 1e3,
                   full_load_time=c.full_load_time * 1e3, diff_replay_time=c.diff_replay_time * 1e3,
                   mtbf=c.mtbf * 1e3)


@pytest.mark.parametrize("costs", REALISTIC, ids=range(len(REALISTIC)))
def test_lowdiff_unit_consistency_ms_vs_s(costs):
    ms = _in_ms(costs)
    assert optimal_fb(ms) == optimal_fb(costs)
    assert continuous_optimum(ms) == pytest.approx(continuous_optimum(costs), rel=1e-9)
    # The waste is a fraction of run time, so it is unit-free too.
    assert waste_fraction(ms, 100, 4) == pytest.approx(waste_fraction(costs, 100, 4), rel=1e-9)


def test_paper_eq10_is_in_time_units_not_steps():
    c = REALISTIC[3]
    f_s, b_s = paper_eq10(c)
    f_ms, b_ms = paper_eq10(_in_ms(c))
    # Read literally as step counts, eq. (10) changes with the time unit ...
    assert f_ms == pytest.approx(f_s / 1e3) and b_ms == pytest.approx(b_s * 1e3)
    # ... and is a rate per second and a duration: F = 1/(f t), B = b/t.
    f_c, b_c = continuous_optimum(c)
    assert f_c == pytest.approx(1 / (f_s * c.step_time)) and b_c == pytest.approx(b_s / c.step_time)


def test_lowdiff_boundary_b_equals_f_when_replay_is_slow():
    # Replaying a record costs more than Young's interval: diffs do not pay, B = F (no replay),
    # and F is Young's interval in steps.
    c = LowDiffCosts(step_time=1.0, full_ckpt_bytes=1e9, diff_bytes=1e6, write_bandwidth=1e9,
                     full_load_time=1.0, diff_replay_time=200.0, mtbf=3600.0)
    f_u, b_u = paper_eq10(c)[0], paper_eq10(c)[1]
    assert b_u / c.step_time > 1 / (f_u * c.step_time)  # unconstrained point is infeasible
    f, b = optimal_fb(c)
    assert b == f
    assert abs(f - young_interval(c.full_write_time, c.mtbf) / c.step_time) <= 1
    assert waste_fraction(c, f, b) == pytest.approx(waste_fraction(c, *numeric_optimal_fb(c, 5000, 500)))


def test_lowdiff_boundary_b_one_for_long_steps():
    c = LowDiffCosts(step_time=30.0, full_ckpt_bytes=25e9, diff_bytes=1e8, write_bandwidth=5e9,
                     full_load_time=60.0, diff_replay_time=0.05, mtbf=3600.0)
    assert continuous_optimum(c)[1] == 1.0
    assert optimal_fb(c) == numeric_optimal_fb(c, 100_000, 50)
    assert optimal_fb(c)[1] == 1


def test_lowdiff_validation():
    c = REALISTIC[0]
    with pytest.raises(ValueError, match="cannot exceed"):
        wasted_time(c, 4, 8, 100)
    with pytest.raises(ValueError, match=">= 1"):
        wasted_time(c, 0.5, 0.5, 100)
    with pytest.raises(ValueError, match="mtbf must be positive"):
        replace(c, mtbf=0)
    with pytest.raises(ValueError, match="write_bandwidth must be positive"):
        replace(c, write_bandwidth=-1)


def test_retune_keeps_setting_when_inputs_do_not_move():
    c = REALISTIC[3]
    prev = optimal_fb(c)
    assert retune(prev, c) == (prev, None)
    # 0.1% more bandwidth moves the optimum by a step or two but gains nothing worth a change.
    nudged = replace(c, write_bandwidth=c.write_bandwidth * 1.001)
    assert optimal_fb(nudged) != prev
    assert retune(prev, nudged) == (prev, None)


def test_retune_follows_a_drop_in_mtbf():
    c = REALISTIC[3]
    prev = optimal_fb(c)
    flaky = replace(c, mtbf=1 * H)
    (f, b), reason = retune(prev, flaky)
    assert (f, b) == optimal_fb(flaky)
    assert f < prev[0]
    assert reason is not None and "\n" not in reason
    assert "MTBF 1h" in reason and f"{prev[0]}->{f}" in reason
    assert waste_fraction(flaky, f, b) < waste_fraction(flaky, *prev)


# ---------------------------------------------------------------------------------------------
# PCcheck §3.4


@pytest.mark.parametrize(
    "write_s,n,q,step_s",
    [(12.0, 1, 1.05, 0.5), (12.0, 3, 1.05, 0.5), (37.0, 2, 1.10, 0.8), (5.3, 4, 1.02, 0.07),
     (100.0, 1, 1.5, 2.0), (0.9, 2, 1.0, 1.0)],
)
def test_pccheck_interval_matches_runtime_model(write_s, n, q, step_s):
    iters = 1e12  # long job: the first-interval term of eq. (1) vanishes
    f_star = pccheck_model.checkpoint_interval_steps(write_s, n, q, step_s)
    budget = q * iters * step_s
    smallest = next(
        f for f in range(1, 100_000)
        if pccheck_model.runtime_model(f, n, write_s, step_s, iters) <= budget * (1 + 1e-12)
    )
    assert f_star == smallest


def _contention(fixed_s, ckpt_bytes, bw, c):
    # Worst-case write time with N in flight: setup cost plus N checkpoints sharing the device,
    # each extra one costing c of contention.
    return lambda n: fixed_s + n * ckpt_bytes / bw * (1 + c * (n - 1))


@pytest.mark.parametrize("fixed_s,c", [(20.0, 0.05), (5.0, 0.2), (60.0, 0.01), (1.0, 1.0)])
def test_pccheck_concurrency_matches_analytic_optimum(fixed_s, c):
    m, bw = 16e9, 2e9
    tw = _contention(fixed_s, m, bw, c)
    # T_w/N = fixed/N + (m/bw)(1 + c(N-1)) is minimal at N = sqrt(fixed*bw/(m*c)).
    n_cont = math.sqrt(fixed_s * bw / (m * c))
    n_star = pccheck_model.optimal_concurrency(tw, n_max=64)
    assert n_star in (max(1, math.floor(n_cont)), math.ceil(n_cont))
    others = [tw(n) / n for n in range(1, 65) if n != n_star]
    assert tw(n_star) / n_star <= min(others)


def test_pccheck_concurrency_from_measurements():
    measured = {1: 10.0, 2: 14.0, 3: 21.0, 4: 40.0, 8: 20.0}
    assert pccheck_model.optimal_concurrency(measured, n_max=4) == 2  # N=8 exceeds storage
    assert pccheck_model.optimal_concurrency(measured, n_max=8) == 8
    assert pccheck_model.optimal_concurrency({1: 10.0, 2: 20.0}, n_max=2) == 1  # tie -> smaller N


def test_pccheck_configure_and_limits():
    assert pccheck_model.max_concurrency(10, 55) == 4  # (N+1)*m <= S
    with pytest.raises(ValueError, match="at least two"):
        pccheck_model.max_concurrency(10, 19)
    with pytest.raises(ValueError, match="ratio"):
        pccheck_model.checkpoint_interval_steps(10, 2, 0.05, 1.0)
    cfg = pccheck_model.configure({1: 10.0, 2: 14.0, 3: 21.0}, step_s=0.5, ckpt_bytes=10,
                                  storage_bytes=40, max_slowdown=1.1)
    assert (cfg.concurrency, cfg.write_s) == (2, 14.0)
    assert cfg.interval_steps == math.ceil(14.0 / (2 * 1.1 * 0.5))  # 13
    assert pccheck_model.worst_case_recovery_s(10, 2, 30.0, 0.5, 8.0) == pytest.approx(8 + 5 + 10)
    assert pccheck_model.worst_case_recovery_s(10, 2, 5.0, 0.5, 8.0) == pytest.approx(8 + 5 + 5)


# ---------------------------------------------------------------------------------------------
# GoCkpt §4.2.3 and §3.1

GOCKPT_CASES = [
    # state bytes, grad bytes, PCIe bytes/s, step s
    (14e9, 2e9, 12e9, 0.1),  # r = 1/7, transfer ~ 11.7 steps
    (12e9, 2e9, 12e9, 0.05),  # r = 1/6, 20 steps
    (16e9, 4e9, 24e9, 0.2),  # r = 1/4, ~3.3 steps
    (100e9, 5e9, 25e9, 0.3),  # r = 1/20, ~13.3 steps: capped by the transfer length
    (100e9, 5e9, 25e9, 0.05),  # r = 1/20, 80 steps
    (8e9, 8e9, 10e9, 0.1),  # r = 1: spreading never pays
    (3e9, 0.3e9, 12e9, 0.5),  # fits in one step: no stall
    (6.12e9, 6.12e9 / 7, 12e9, 0.1),  # ~5.1 steps: the tiny last part is cheaper sent blocking
]


@pytest.mark.parametrize("case", GOCKPT_CASES, ids=range(len(GOCKPT_CASES)))
def test_gockpt_optimal_k_matches_numeric_argmin(case):
    stalls = [gockpt_model.stall_time(k, *case) for k in range(1, 201)]
    k_num = 1 + int(np.argmin(stalls))  # first minimum: ties to the smaller k
    assert gockpt_model.optimal_k(*case) == k_num


@pytest.mark.parametrize("case", GOCKPT_CASES[:2] + GOCKPT_CASES[4:5], ids=range(3))
def test_gockpt_closed_form_is_continuous_argmin(case):
    # Uncapped cases: the stall formula over real k has its minimum at 1/r + 1/2.
    state, grad, bw, step = case
    r, x = grad / state, state / bw
    ks = np.linspace(1, x / step, 400_001)
    stall = np.maximum(0, x - ks * step) + r * step * ks * (ks - 1) / 2
    assert gockpt_model.continuous_optimal_k(state, grad) == pytest.approx(ks[np.argmin(stall)], abs=1e-3)
    k_int = gockpt_model.optimal_k(*case)
    assert abs(k_int - (1 / r + 0.5)) <= 0.5 + 1e-9


def test_gockpt_paper_example_sign_and_size():
    # Paper setting: r = 1/7, a transfer of exactly N steps; Async-O is k = 1.
    step = 0.1
    for n in (2, 7, 8, 13, 14, 20):
        state = 7e9 * n * step
        args = (state, state / 7, 7e9, step)
        delta = gockpt_model.stall_time(n, *args) - gockpt_model.stall_time(1, *args)
        assert delta == pytest.approx(gockpt_model.paper_delta_t(n) * step, abs=1e-9)
        assert gockpt_model.paper_delta_t(n) == pytest.approx((n - 1) * (n - 14) / 14)
    # GoCkpt stalls less than Async-O (delta < 0) for 1 < N < 14; best saving is 3 steps, not 4.
    assert gockpt_model.paper_delta_t(7) == pytest.approx(-3) == gockpt_model.paper_delta_t(8)
    assert min(gockpt_model.paper_delta_t(n) for n in range(1, 30)) == pytest.approx(-3)
    assert gockpt_model.optimal_k(7e9 * 2.0, 1e9 * 2.0, 7e9, 0.1) == 7  # 7 and 8 tie


def test_gockpt_interval_is_young_in_steps():
    stall, step, mtbf = 0.8, 0.4, 6 * H
    n_star = gockpt_model.interval_steps(stall, step, mtbf)
    assert n_star == pytest.approx(young_interval(stall, mtbf) / step)
    ns = np.linspace(1, 10 * n_star, 1_000_001)
    p = stall / (ns * step) + ns * step / (2 * mtbf) + 30 / mtbf
    assert n_star == pytest.approx(ns[np.argmin(p)], rel=1e-4)
    assert gockpt_model.waste_fraction(n_star, stall, step, mtbf, 30) == pytest.approx(
        math.sqrt(2 * stall / mtbf) + 30 / mtbf  # the paper's P*
    )


def test_gockpt_validation():
    with pytest.raises(ValueError, match="integer >= 1"):
        gockpt_model.stall_time(0, 1e9, 1e8, 1e9, 0.1)
    with pytest.raises(ValueError, match="grad_bytes must be positive"):
        gockpt_model.optimal_k(1e9, 0, 1e9, 0.1)


# ---------------------------------------------------------------------------------------------
# Durations and failure logs


@pytest.mark.parametrize(
    "text,seconds",
    [("90s", 90), ("45m", 2700), ("2h", 7200), ("1.5d", 129600), ("120", 120), ("500ms", 0.5),
     ("0.25", 0.25), (" 2H ", 7200), ("1h30m", 5400), ("1h 56m 40s", 7000), ("5 s", 5), (".5h", 1800)],
)
def test_parse_duration_good(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text,why",
    [("", "empty"), ("   ", "empty"), ("-5s", "negative"), ("-3", "negative"), ("0", "zero"),
     ("0s", "zero"), ("0h 0m", "zero"), ("abc", ""), ("5x", ""), ("5min", ""), ("1h30", ""),
     ("1e3", ""), ("nan", ""), ("inf", ""), ("h", ""), ("2h-1m", "")],
)
def test_parse_duration_bad(text, why):
    with pytest.raises(ValueError) as err:
        parse_duration(text)
    msg = str(err.value)
    assert repr(text) in msg and "500ms" in msg and "1.5d" in msg  # names input, shows forms
    assert why in msg


@pytest.mark.parametrize(
    "seconds,text",
    [(7000, "1h 56m 40s"), (2.5, "2.5s"), (0.5, "500ms"), (3600, "1h"), (129600, "1d 12h"),
     (0, "0s"), (59.999, "1m"), (61, "1m 1s"), (0.0125, "12.5ms"), (0.99996, "1s"), (-90, "-1m 30s")],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds", [60, 7000, 86399, 129600, 3 * 86400 + 5])
def test_format_parse_round_trip(seconds):
    assert parse_duration(format_duration(seconds)) == seconds


def test_failure_log_good(tmp_path):
    log = tmp_path / "failures.log"
    log.write_text(
        "# failures of run 42\n"
        "\n"
        "2024-05-01T06:00:00Z\n"
        "2024-05-01T00:00:00Z   # node 3\n"
        "   2024-05-01T01:00:00+00:00\n"
        "2024-05-01T10:00:00+02:00\n"  # = 08:00Z, out of order on purpose
    )
    # Sorted: 00:00, 01:00, 06:00, 08:00 -> gaps 1h, 5h, 2h -> mean 8h/3.
    assert mtbf_from_failure_log(log) == pytest.approx(8 * H / 3)
    naive = tmp_path / "naive.log"
    naive.write_text("2024-01-01 00:00:00\n2024-01-02 00:00:00\n2024-01-02 12:00:00\n")
    assert mtbf_from_failure_log(str(naive)) == pytest.approx(18 * H)


@pytest.mark.parametrize("content", ["", "# nothing yet\n\n", "2024-05-01T00:00:00Z\n# one only\n"])
def test_failure_log_too_few(tmp_path, content):
    log = tmp_path / "f.log"
    log.write_text(content)
    with pytest.raises(ValueError, match="at least two"):
        mtbf_from_failure_log(log)


def test_failure_log_bad_line(tmp_path):
    log = tmp_path / "f.log"
    log.write_text("# header\n2024-05-01T00:00:00Z\nyesterday at noon\n2024-05-02T00:00:00Z\n")
    with pytest.raises(ValueError, match=r"f\.log:3: 'yesterday at noon'"):
        mtbf_from_failure_log(log)


def test_failure_log_mixed_timezones(tmp_path):
    log = tmp_path / "f.log"
    log.write_text("2024-05-01T00:00:00Z\n2024-05-02T00:00:00\n")
    with pytest.raises(ValueError, match=":2: mixes"):
        mtbf_from_failure_log(log)


@pytest.mark.parametrize("fixed", [{"f": 5}, {"f": 400}, {"b": 1}, {"b": 6}])
def test_optimum_with_one_value_fixed_matches_grid(fixed):
    """When the user fixes F or B, only the other is optimised, and it equals the grid argmin of eq. (8)."""
    from ckptrun.strategies.lowdiff.model import optimal_fb_given, waste_fraction

    costs = LowDiffCosts(step_time=0.1, full_ckpt_bytes=100e6, diff_bytes=20e6, write_bandwidth=1e7,
                         full_load_time=10.0, diff_replay_time=0.01, mtbf=1800.0)
    f, b = optimal_fb_given(costs, **fixed)
    if "f" in fixed:
        grid = min(range(1, fixed["f"] + 1), key=lambda x: waste_fraction(costs, fixed["f"], x))
        assert (f, b) == (fixed["f"], grid)
    else:
        grid = min(range(fixed["b"], 200_000), key=lambda x: waste_fraction(costs, x, fixed["b"]))
        assert b == fixed["b"] and abs(f - grid) <= 1


# Exact replay: a record of B steps costs R_D + B·r (the correction documented in model.py).
REPLAY_FRACTIONS = (0.01, 0.1, 0.5, 0.9)  # r as a fraction of the step time


@pytest.mark.parametrize("costs", REALISTIC, ids=range(len(REALISTIC)))
@pytest.mark.parametrize("frac", REPLAY_FRACTIONS)
def test_lowdiff_per_step_replay_optimum_matches_numeric(costs, frac):
    c = replace(costs, step_replay_time=frac * costs.step_time)
    f_c, b_c = continuous_optimum(c)
    f, b = optimal_fb(c)
    f_num, b_num = numeric_optimal_fb(c, 4 * f + 10, 4 * b + 10)
    assert waste_fraction(c, f, b) == pytest.approx(waste_fraction(c, f_num, b_num), rel=1e-12)
    assert abs(f - f_num) <= 1 and abs(b - b_num) <= 1
    w0 = waste_fraction(c, f_c, b_c)  # the real-valued point is a minimum, not just near one
    assert all(waste_fraction(c, f_c * df, max(1.0, b_c * db)) > w0
               for df in (0.98, 1.02) for db in (0.98, 1.0, 1.02) if b_c * db <= f_c * df)


@pytest.mark.parametrize("costs", REALISTIC, ids=range(len(REALISTIC)))
def test_lowdiff_f_shrinks_as_replay_per_step_grows(costs):
    """Dearer replay makes long chains dearer: F* falls, closed form and search alike."""
    fs_closed, fs_numeric = [], []
    for frac in (0.0, *REPLAY_FRACTIONS):
        c = replace(costs, step_replay_time=frac * costs.step_time)
        f, b = optimal_fb(c)
        fs_closed.append(f)
        fs_numeric.append(numeric_optimal_fb(c, 4 * f + 10, 4 * b + 10)[0])
    for fs in (fs_closed, fs_numeric):
        assert all(a > b for a, b in zip(fs, fs[1:], strict=False)), fs
    # The paper's model (r = 0) prices a record of B steps as one update: F is several times too large.
    assert fs_closed[0] > 2 * fs_closed[2]


def test_lowdiff_per_step_replay_hand_value_and_limits():
    c = LowDiffCosts(step_time=2, full_ckpt_bytes=100, diff_bytes=1, write_bandwidth=10,
                     full_load_time=5, diff_replay_time=1, mtbf=1000, num_gpus=2, step_replay_time=0.5)
    # per failure: B*t/2 + R_F + (R_D + B*r)/2*(F/B - 1) = 5 + 5 + (1 + 2.5)/2*9; 10 failures; 100 fulls.
    assert wasted_time(c, 50, 5, horizon_s=10_000) == pytest.approx(2 * (10 * (10 + 3.5 / 2 * 9) + 100 * 10))
    assert c.recovery_time(50, 5) == pytest.approx(5 + 3.5 / 2 * 9)
    # r -> 0 is the paper's closed form (eq. (10)), reached through the quartic's root.
    base = REALISTIC[3]
    tiny = replace(base, step_replay_time=1e-12 * base.step_time)
    assert continuous_optimum(tiny) == pytest.approx(continuous_optimum(base), rel=1e-6)
    # A step that replays slower than it trains: diffs never pay, B = F = Young's interval.
    slow = replace(base, step_replay_time=1.5 * base.step_time)
    f, b = optimal_fb(slow)
    assert f == b and abs(f - young_interval(slow.full_write_time, slow.mtbf) / slow.step_time) <= 1
    assert waste_fraction(slow, f, b) == pytest.approx(waste_fraction(slow, *numeric_optimal_fb(slow, 4 * f, 4 * f)))


@pytest.mark.parametrize("fixed", [{"f": 5}, {"f": 400}, {"b": 1}, {"b": 6}])
def test_optimum_with_one_value_fixed_and_per_step_replay_matches_grid(fixed):
    from ckptrun.strategies.lowdiff.model import optimal_fb_given

    costs = LowDiffCosts(step_time=0.1, full_ckpt_bytes=100e6, diff_bytes=20e6, write_bandwidth=1e7,
                         full_load_time=10.0, diff_replay_time=0.005, mtbf=1800.0, step_replay_time=0.03)
    f, b = optimal_fb_given(costs, **fixed)
    if "f" in fixed:
        assert (f, b) == (fixed["f"], min(range(1, fixed["f"] + 1), key=lambda x: waste_fraction(costs, fixed["f"], x)))
    else:
        grid = min(range(fixed["b"], 200_000), key=lambda x: waste_fraction(costs, x, fixed["b"]))
        assert b == fixed["b"] and abs(f - grid) <= 1
