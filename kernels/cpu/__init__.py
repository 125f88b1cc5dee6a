"""Fused CPU kernels (``csrc/``), built per ISA level and chosen at run time by what the CPU has.

``cpu_ops()`` returns the ops of the highest level this CPU runs (an extension module named
``llmserve_cpu_<level>``, capped by ``LLMSERVE_CPU_ISA``), or None when the kernels are switched off
(``LLMSERVE_CPU_KERNELS=0``), the CPU has no level (not x86-64, or no AVX2+FMA) or the build failed:
callers then take the unfused torch path, which computes the same thing and is what the kernels are
tested against. ``python -m kernels.cpu`` prints which path each op takes here, and why.
"""

from __future__ import annotations

import functools
import logging
import os

from kernels.cpu import isa
from kernels.cpu.build import KernelBuildError, load

log = logging.getLogger(__name__)

KERNELS_ENV = "LLMSERVE_CPU_KERNELS"


def enabled() -> bool:
    return os.environ.get(KERNELS_ENV, "1").lower() not in ("0", "false", "no", "off")


def _find():
    """(the best level's ops, "") or (None, why there are none)."""
    if not enabled():
        return None, f"switched off ({KERNELS_ENV}=0)"
    best = isa.best_level()
    if best is None:
        return None, f"no kernel level runs on this CPU: {isa.why_not(isa.LEVELS[0])}"
    try:
        return ops_at(best.name), ""
    except KernelBuildError as exc:
        return None, str(exc)


def unavailable_reason() -> str:
    """Why ``cpu_ops()`` is None (empty when it is not)."""
    return _find()[1]


@functools.cache
def ops_at(level_name: str):
    """The ops of one level (raises KernelBuildError, or ValueError if the CPU cannot run it)."""
    lv = isa.level(level_name)
    missing = isa.missing_flags(lv)
    if missing:
        raise ValueError(
            f"this CPU cannot run the {level_name} kernels: it lacks {', '.join(missing)}"
        )
    return load(lv)


@functools.cache
def cpu_ops():
    """The best level's ops, or None (see ``unavailable_reason``). Decided once per process;
    ``cpu_ops.cache_clear()`` re-reads the environment."""
    ops, reason = _find()
    if ops is None and enabled():
        log.warning("CPU kernels unavailable, using the unfused torch path: %s", reason)
    return ops
