"""Exact replay (ckptrun/restore/replay.py, DESIGN invariant 1), in-process: the gradients and
per-step hyper-parameters a live run consumed, recorded as lowdiff records them and laid out as
the store writes them, replayed through a fresh optimizer from a mid-run base, reach the live
run's parameters and optimizer state bit for bit; a diff that does not fit is refused untouched."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from conftest import assert_same, pack, unpack

from ckptrun.restore import replay as replay_module
from ckptrun.restore.replay import apply_diff, decode_grad, densify, optimizer_params, replay, replay_device

SHAPES = [(3, 4), (4,), (5,)]
BASE, STEPS = 2, 7
NO_GRAD = 2  # this parameter has no gradient in odd steps

OPTIMIZERS: dict[str, Callable[[list], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
}


def sparse(grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """A gradient as lowdiff records a mostly-zero one: int32 indices of every entry that is not +0.0."""
    flat = grad.flatten()
    idx = torch.nonzero(flat.ne(0) | torch.signbit(flat)).flatten()
    return {"idx": idx.to(torch.int32), "val": flat[idx].clone()}


def gradient(shape: tuple, step: int, i: int, sparse_grads: bool) -> torch.Tensor:
    g = torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + i))
    if sparse_grads:
        g = torch.where(g.abs() > 1, g, torch.zeros(()))
        g.view(-1)[0] = -0.0
    return g


def optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return OPTIMIZERS[name]([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}])


def live_run(name: str, sparse_grads: bool) -> tuple[dict, list[dict], dict]:
    """(state after step BASE, the diffs of steps BASE+1..STEPS through storage's layout, final state)."""
    params = [torch.randn(s, generator=torch.Generator().manual_seed(i)).requires_grad_() for i, s in
              enumerate(SHAPES)]
    opt = optimizer(name, params)
    base, diffs = None, []
    for step in range(1, STEPS + 1):
        opt.param_groups[0]["lr"] = 0.02 / step  # an lr that changes every step
        for i, p in enumerate(params):
            p.grad = None if i == NO_GRAD and step % 2 else gradient(p.shape, step, i, sparse_grads)
        grads = [None if p.grad is None else sparse(p.grad) if sparse_grads else p.grad for p in params]
        diff = {"grads": grads, "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}
        diffs.append(unpack(*pack(diff)))
        opt.step()
        if step == BASE:
            base = state(params, opt)
    return base, diffs[BASE:], state(params, opt)


def state(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> dict:
    return {"params": [p.detach().clone() for p in params], "optimizer": copy.deepcopy(opt.state_dict())}


def fresh(name: str, base: dict) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    params = [p.clone().requires_grad_() for p in base["params"]]
    opt = optimizer(name, params)
    opt.load_state_dict(copy.deepcopy(base["optimizer"]))
    return params, opt


@pytest.mark.parametrize("sparse_grads", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_replay_equals_the_live_run(name, sparse_grads):
    base, diffs, final = live_run(name, sparse_grads)
    params, opt = fresh(name, base)
    assert replay(opt, iter(diffs)) is diffs[-1]
    assert_same(state(params, opt), final)
    assert all(p.grad is None for p in params)


def test_replay_depends_on_each_steps_hyper_parameters():
    """The per-step lr matters: replaying with the last step's groups throughout ends elsewhere."""
    base, diffs, final = live_run("adamw", False)
    params, opt = fresh("adamw", base)
    replay(opt, [{**d, "groups": diffs[-1]["groups"]} for d in diffs])
    assert not torch.equal(params[0].detach(), final["params"][0])


def test_densify_rebuilds_the_gradient_bit_for_bit():
    grad = torch.tensor([[0.0, -0.0, 1.5], [0.0, -2.0, -0.0]])
    rebuilt = densify(**sparse(grad), like=torch.empty(2, 3))
    assert_same(rebuilt, grad)
    assert torch.signbit(rebuilt).tolist() == [[False, True, False], [False, True, True]]
    assert_same(decode_grad(sparse(grad), torch.empty(2, 3)), grad)
    assert decode_grad(None, torch.empty(2, 3)) is None


MISFITS = {  # what replaces the first gradient of the first diff
    "dense_shape": torch.zeros(4, 3),
    "index_past_the_end": {"idx": torch.tensor([12], dtype=torch.int32), "val": torch.ones(1)},
    "negative_index": {"idx": torch.tensor([-1], dtype=torch.int32), "val": torch.ones(1)},
    "float_index": {"idx": torch.tensor([1.0]), "val": torch.ones(1)},
    "values_not_indices": {"idx": torch.tensor([0, 1, 2]), "val": torch.ones(1)},
}


@pytest.mark.parametrize("misfit", [*MISFITS, "one_gradient_short", "one_group_more"])
def test_a_diff_that_does_not_fit_is_refused_before_anything_changes(misfit):
    base, diffs, _ = live_run("adamw", False)
    params, opt = fresh("adamw", base)
    before = state(params, opt)
    diff = copy.deepcopy(diffs[0])
    if misfit == "one_gradient_short":
        diff["grads"].pop()
    elif misfit == "one_group_more":
        diff["groups"].append(diff["groups"][0])
    else:
        diff["grads"][0] = MISFITS[misfit]
    with pytest.raises(ValueError):
        apply_diff(opt, diff)
    assert_same(state(params, opt), before)
    assert all(p.grad is None for p in optimizer_params(opt))


# ---- where offline replay runs ------------------------------------------------------------
@pytest.mark.parametrize("trained_on", [None, "cpu"])
def test_a_cpu_run_is_replayed_on_the_cpu_without_a_word(trained_on, capsys):
    assert replay_device(trained_on) == torch.device("cpu")
    assert capsys.readouterr().err == ""


def test_a_gpu_run_is_replayed_on_the_gpu_where_there_is_one(monkeypatch, capsys):
    """Its arithmetic is the run's own (the machine's accelerator stood in for)."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(replay_module, "_said_cpu", set())
    assert replay_device("cuda") == torch.device("cuda")
    assert replay_device("xpu") == torch.device("cpu")  # (another type than the machine's)
    assert "trained on xpu" in capsys.readouterr().err


def test_a_gpu_run_is_replayed_on_the_cpu_where_there_is_no_gpu_and_that_is_said_once(monkeypatch, capsys):
    """The GPU's kernels round differently: the user learns the restored steps may differ."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(replay_module, "_said_cpu", set())
    for _ in range(2):
        assert replay_device("cuda") == torch.device("cpu")
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "trained on cuda" in said[0] and "replayed on the CPU" in said[0], said
