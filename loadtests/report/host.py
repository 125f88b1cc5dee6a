"""The host a report ran on: CPU model, the kernels' ISA level, cores, memory, torch, load."""

from __future__ import annotations

import os
import platform
import time
from typing import Any


def mem_total_bytes(meminfo: str) -> int | None:
    """``MemTotal`` from the text of /proc/meminfo, in bytes (None if absent)."""
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            value, unit = line.split(":", 1)[1].split()
            return int(value) * (1024 if unit.lower() == "kb" else 1)
    return None


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def describe() -> dict[str, Any]:
    """What the report's host section shows; imports torch (it reports its version)."""
    import torch

    from kernels.cpu import isa

    try:
        with open("/proc/meminfo") as f:
            memory = mem_total_bytes(f.read())
    except OSError:
        memory = None
    best = isa.best_level()
    return {
        "cpu": isa.cpu_name(),
        "kernel ISA level (best this CPU runs)": best.name if best else None,
        "ISA levels supported": [lv.name for lv in isa.supported_levels()],
        "logical cores": os.cpu_count(),
        "memory (GiB)": round(memory / 2**30, 1) if memory else None,
        "torch": torch.__version__,
        "torch threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
