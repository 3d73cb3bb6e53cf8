"""Host-side resource samples for the dashboard: CPU, trainer/engine memory, GPU.

Sampling must never take the launcher down, so every source degrades to "n/a": a missing
``pynvml`` module, a machine without a GPU or driver, an NVML call that raises, a process
that exited. NVML access goes through an injectable loader so tests can simulate each case.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil

NA = "n/a"


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment."""

    index: int
    util_percent: float
    mem_used: int
    mem_total: int


@dataclass(frozen=True)
class HostSample:
    """One host sample; ``None`` fields mean "n/a"."""

    cpu_percent: float | None
    rss: dict[str, int | None] = field(default_factory=dict)  # label -> resident bytes
    gpus: tuple[GpuSample, ...] | None = None  # None: GPU info not available
    gpu_note: str = ""  # why ``gpus`` is None


def _import_pynvml() -> Any:
    import pynvml  # nvidia-ml-py

    return pynvml


class HostSampler:
    """Sample host CPU, RSS of given pids, and GPU utilisation/memory.

    ``nvml_loader`` returns a module-like object with the ``pynvml`` API (``nvmlInit``,
    ``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``, ``nvmlDeviceGetUtilizationRates``,
    ``nvmlDeviceGetMemoryInfo``, ``nvmlShutdown``); by default it imports ``pynvml``.
    NVML is initialised once, on the first sample; if that fails it is not retried.
    """

    def __init__(
        self,
        nvml_loader: Callable[[], Any] | None = _import_pynvml,
        cpu_percent: Callable[[], float] | None = None,
    ) -> None:
        self._nvml_loader = nvml_loader
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._nvml_note: str | None = None  # set once NVML is known unusable
        self._cpu_percent = cpu_percent or (lambda: psutil.cpu_percent(interval=None))
        self._procs: dict[int, psutil.Process] = {}
        try:
            self._cpu_percent()  # psutil's first reading is meaningless; prime it
        except Exception:
            pass

    def sample(self, pids: Mapping[str, int] | None = None) -> HostSample:
        """Take one sample; never raises."""
        try:
            cpu: float | None = float(self._cpu_percent())
        except Exception:
            cpu = None
        rss = {label: self._rss(pid) for label, pid in (pids or {}).items()}
        gpus, note = self._gpus()
        return HostSample(cpu_percent=cpu, rss=rss, gpus=gpus, gpu_note=note)

    def close(self) -> None:
        """Release NVML (idempotent, never raises)."""
        nvml, self._nvml, self._handles = self._nvml, None, []
        if nvml is not None:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass
        self._nvml_note = self._nvml_note or "closed"

    def _rss(self, pid: int) -> int | None:
        try:
            proc = self._procs.get(pid)
            if proc is None:
                proc = self._procs[pid] = psutil.Process(pid)
            return int(proc.memory_info().rss)
        except Exception:  # NoSuchProcess, AccessDenied, ZombieProcess, bad pid
            self._procs.pop(pid, None)
            return None

    def _init_nvml(self) -> None:
        if self._nvml is not None or self._nvml_note is not None:
            return
        if self._nvml_loader is None:
            self._nvml_note = "GPU monitoring disabled"
            return
        try:
            nvml = self._nvml_loader()
        except ImportError:
            self._nvml_note = "pynvml not installed"
            return
        except Exception as exc:
            self._nvml_note = f"pynvml failed to load: {_describe(exc)}"
            return
        try:
            nvml.nvmlInit()
        except Exception as exc:
            self._nvml_note = f"NVML unavailable: {_describe(exc)}"
            return
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(int(nvml.nvmlDeviceGetCount()))]
        except Exception as exc:
            self._nvml_note = f"NVML error: {_describe(exc)}"
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass
            return
        if not handles:
            self._nvml_note = "no GPU"
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass
            return
        self._nvml, self._handles = nvml, handles

    def _gpus(self) -> tuple[tuple[GpuSample, ...] | None, str]:
        try:
            self._init_nvml()
        except Exception as exc:  # a loader that misbehaves in an unexpected way
            self._nvml_note = f"NVML error: {_describe(exc)}"
        if self._nvml is None:
            return None, self._nvml_note or NA
        try:
            out = []
            for i, handle in enumerate(self._handles):
                util = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                out.append(GpuSample(i, float(util.gpu), int(mem.used), int(mem.total)))
            return tuple(out), ""
        except Exception as exc:  # transient NVML failures: report n/a, try again next time
            return None, f"NVML error: {_describe(exc)}"


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
