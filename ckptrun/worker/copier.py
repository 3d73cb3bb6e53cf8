"""Copying a snapshot's tensors into host memory: one interface, a CPU and a CUDA implementation.

Runs whenever capture (ckptrun/worker/capture.py) fills a slot: `copy` on the calling thread
(what the next forward changes), `start` off the training thread (the rest; it returns at once).
Background copies run in order, whatever the device: one FIFO copier thread (`CopyThread`)
serves the CPU copies, the lazy gathering of a snapshot and the progress reports, and on GPU one
side stream serves the device-to-host copies, so the newest copy started is the last to end
(`wait_all`). The GPU path is the small `CudaCopier`, testable on its own where a GPU is lent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..storage.layout import Layout, view

Progress = Callable[[int], None]


class CopyThread:
    """The one FIFO copier thread; remembers the newest job (`wait_all` of the copiers)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptrun-snapshot")
        self.last: Future | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        self.last = self._pool.submit(fn, *args)
        return self.last


class Copier(ABC):
    """Copies tensors into their places (`layout`) in a host buffer. `progress(end)`, if given,
    is told each time everything before `end` is in the buffer, in layout order."""

    def __init__(self, thread: CopyThread) -> None:
        self.thread = thread

    @staticmethod
    def copy(buf: torch.Tensor, layout: Layout, tensors: dict[str, torch.Tensor],
             progress: Progress | None = None) -> None:
        """Copy `tensors` into their places now, on this thread; `progress(end)` after each one
        (layout order: with the tensors copied earlier, everything before `end` is then in the slot)."""
        with torch.no_grad():
            for spec in layout.specs:
                if spec.key in tensors:
                    view(buf, spec).copy_(tensors[spec.key])
                    if progress is not None:
                        progress(spec.offset + spec.nbytes)
        if progress is not None:
            progress(layout.nbytes)

    @abstractmethod
    def start(self, buf: torch.Tensor, layout: Layout, tensors: dict[str, torch.Tensor],
              progress: Progress | None = None, after: Any = None) -> Any:
        """Start the copy in the background, after the copies started before it; returns what
        waiting for it takes (a Future or a CUDA event). `after`: see `CudaCopier`."""

    @abstractmethod
    def wait_all(self) -> None:
        """Block until every copy this copier started has ended."""


class CpuCopier(Copier):
    """Host tensors: the copy runs on the copier thread."""

    def start(self, buf: torch.Tensor, layout: Layout, tensors: dict[str, torch.Tensor],
              progress: Progress | None = None, after: Any = None) -> Future:
        return self.thread.submit(type(self).copy, buf, layout, tensors, progress)

    def wait_all(self) -> None:
        if self.thread.last is not None:
            self.thread.last.result()


class CudaCopier(Copier):
    """Device tensors: asynchronous device-to-host copies on one side stream into the pinned slot."""

    def __init__(self, thread: CopyThread) -> None:
        super().__init__(thread)
        self._stream: Any = None
        self.last_event: Any = None

    def start(self, buf: torch.Tensor, layout: Layout, tensors: dict[str, torch.Tensor],
              progress: Progress | None = None, after: Any = None) -> Any:
        """Returns the copies' CUDA event. With `progress`, an event per tensor is waited on by the
        copier thread, which reports each. The copies start after the work queued so far on the
        current stream, or after the event `after` (recorded by the training thread when the state
        was final: a lazy capture)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        if after is not None:
            self._stream.wait_event(after)
        else:
            self._stream.wait_stream(torch.cuda.current_stream())
        marks = []
        with torch.no_grad(), torch.cuda.stream(self._stream):
            for spec in layout.specs:
                if spec.key in tensors:
                    src = tensors[spec.key]
                    view(buf, spec).copy_(src, non_blocking=True)
                    # The caller may drop `src` before the copy has run (a clone, a gradient
                    # zero_grad frees): its memory is not reused until the side stream is past it.
                    if src.is_cuda:
                        src.record_stream(self._stream)
                    if progress is not None:
                        marks.append((torch.cuda.Event(), spec.offset + spec.nbytes))
                        marks[-1][0].record(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        if progress is not None:
            def report() -> None:
                for mark, end in marks:
                    mark.synchronize()
                    progress(end)
                event.synchronize()
                progress(layout.nbytes)

            self.thread.submit(report)
        self.last_event = event
        return event

    def wait_all(self) -> None:
        if self.last_event is not None:
            self.last_event.synchronize()
