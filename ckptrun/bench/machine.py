"""What the figures were measured on: CPU, cores, memory, torch, GPU, and the filesystem of the
checkpoint directory. Read without importing torch (the bench process stays light)."""

from __future__ import annotations

import os
import platform
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from .. import __version__

MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def filesystem(path: Path) -> dict[str, str]:
    """The mount holding `path`: its type, device and mount point."""
    path = path.resolve()
    best = None
    for part in psutil.disk_partitions(all=True):
        mount = Path(part.mountpoint)
        if (path == mount or mount in path.parents) and (best is None or len(part.mountpoint) > len(best.mountpoint)):
            best = part
    if best is None:
        return {"type": "unknown", "device": "unknown", "mountpoint": "unknown"}
    return {"type": best.fstype, "device": best.device, "mountpoint": best.mountpoint}


def default_dir() -> Path:
    """A fresh folder on real disk: the temp dir unless it is in memory, else /var/tmp, else here."""
    for candidate in (tempfile.gettempdir(), "/var/tmp", os.getcwd()):
        if Path(candidate).is_dir() and filesystem(Path(candidate))["type"] not in MEMORY_FILESYSTEMS:
            return Path(tempfile.mkdtemp(prefix="ckptrun-bench-", dir=candidate))
    return Path(tempfile.mkdtemp(prefix="ckptrun-bench-", dir=os.getcwd()))


def gpu_names() -> list[str]:
    """Names of the visible NVIDIA GPUs through NVML; [] without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                     for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver, no GPU: all mean "none here"
        return []
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def describe(ckpt_dir: Path) -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(),
        "logical_cores": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_GB": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "ckptrun": __version__,
        "gpus": gpu_names(),
        "dir": str(ckpt_dir),
        "dir_filesystem": filesystem(ckpt_dir),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
