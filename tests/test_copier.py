"""The copier interface (ckptrun/worker/copier.py) on its own: each implementation this machine
can run (the CPU one always, the CUDA one where a GPU is) copies a snapshot's tensors into their
places in a host buffer in the background, tells `progress` each end in layout order and the
total last, and `wait_all` returns only once the copies it started have ended."""

from __future__ import annotations

import threading

import pytest
import torch

from ckptrun.storage.layout import Layout, view
from ckptrun.worker.copier import CopyThread, CpuCopier, CudaCopier

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _copier(device: str) -> CpuCopier | CudaCopier:
    thread = CopyThread()
    return CpuCopier(thread) if device == "cpu" else CudaCopier(thread)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(1000, generator=g), "b": torch.randint(0, 9, (7, 13), generator=g),
            "c": torch.randn(3, 5, generator=g).to(torch.bfloat16)}


@pytest.mark.parametrize("device", DEVICES)
def test_a_background_copy_puts_each_tensor_in_its_place_and_reports_in_order(device):
    tensors = _tensors()
    layout = Layout.of(tensors)
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    ends: list[int] = []
    copier = _copier(device)
    copier.start(buf, layout, {k: t.to(device) for k, t in tensors.items()}, ends.append)
    copier.wait_all()
    if copier.thread.last is not None:  # the CUDA copier reports progress from the copier thread
        copier.thread.last.result()
    for spec in layout.specs:
        assert torch.equal(view(buf, spec), tensors[spec.key])
    assert ends == [s.offset + s.nbytes for s in layout.specs] + [layout.nbytes]


@pytest.mark.parametrize("device", DEVICES)
def test_wait_all_waits_for_the_newest_copy(device):
    """Copies run in the order they were started (one thread, one stream): waiting for the newest
    waits for all, and a copy queued behind a held job has not run before the job is let go."""
    tensors = _tensors()
    layout = Layout.of(tensors)
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    copier = _copier(device)
    gate = threading.Event()
    copier.thread.submit(gate.wait)
    copier.start(buf, layout, {k: t.to(device) for k, t in tensors.items()})
    if device == "cpu":
        assert not copier.thread.last.done() and not buf.any()
    gate.set()
    copier.wait_all()
    assert all(torch.equal(view(buf, s), tensors[s.key]) for s in layout.specs)


def test_copy_on_the_calling_thread_is_done_when_it_returns():
    tensors = _tensors()
    layout = Layout.of(tensors, start=4096)
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    ends: list[int] = []
    CpuCopier.copy(buf, layout, {"b": tensors["b"]}, ends.append)
    spec = {s.key: s for s in layout.specs}["b"]
    assert torch.equal(view(buf, spec), tensors["b"])
    assert ends == [spec.offset + spec.nbytes, layout.nbytes]
    assert not buf[: spec.offset].any()  # the other places are left as they were
