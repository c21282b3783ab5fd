"""The environment stamped on every row: GPU, date, versions, commit, and the label of the run."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from ._triton import triton
from .cases import find_repo_root

SMOKE_LABEL = "CPU smoke — not a performance figure"
PERF_LABEL = "performance"
CPU_PERF_LABEL = "CPU performance"  # the CPU mode's rows (--preset cpu): host timings, a figure of that CPU


def _git_commit(root: Path | None) -> str:
    if root is None:
        return "unknown"
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_name() -> str:
    """The CPU's model name: /proc/cpuinfo's "model name" (Linux), else ``platform.processor()``, else the
    machine type."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model") and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_card() -> str:
    """The ``gpu`` field of the CPU mode's rows: the CPU and the threads torch uses, which its times depend on."""
    return f"CPU: {cpu_name()}, {torch.get_num_threads()} threads"


def environment(device: torch.device, commit: str | None, cpu_measurement: bool = False) -> dict[str, Any]:
    """GPU, date, versions and commit stamped on every row. ``cpu_measurement``: a run of the CPU mode, whose rows
    name the CPU (:func:`cpu_card`) and are a figure of it, not a smoke run."""
    from ropekit._version import __version__

    if cpu_measurement:
        gpu = cpu_card()
    elif device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    else:
        gpu = f"none (CPU {platform.machine()})"
    return {
        "gpu": gpu,
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "torch": torch.__version__,
        "triton": getattr(triton, "__version__", "absent"),
        "ropekit": __version__,
        "commit": commit or _git_commit(find_repo_root()),
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
        "label": CPU_PERF_LABEL if cpu_measurement else PERF_LABEL if device.type == "cuda" else SMOKE_LABEL,
    }


def _interpreting() -> bool:
    """Whether Triton kernels run under its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
