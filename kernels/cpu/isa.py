"""Which instruction-set levels the CPU kernels can run at on this CPU, read at run time.

The kernels are built once per level, each with that level's compiler flags (never
``-march=native``), and the engine takes the highest level this CPU has, capped by
``LLMSERVE_CPU_ISA``: with ``LLMSERVE_CPU_ISA=avx2`` an AVX-512 host runs the AVX2 kernels, which
is how their path is tested on any x86-64 machine. Levels, lowest first:

- ``avx2``: AVX2 + FMA + F16C, the x86-64 baseline (every CPU since ~2015). bf16 values widen to
  fp32 by a shift; int8 dot products by ``vpmaddubsw`` / ``vpmaddwd``.
- ``avx512``: + AVX-512 F/BW/VL/DQ: 16 fp32 lanes a register.
- ``avx512_bf16``: + AVX512-BF16 (``vdpbf16ps``: bf16 pairs multiplied as they are) and AVX512-VNNI
  (``vpdpbusd`` / ``vpdpwssd``).

ARM (NEON, SVE) and AMX are not levels yet: there the engine runs its torch path.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

ISA_ENV = "LLMSERVE_CPU_ISA"


@dataclass(frozen=True)
class Level:
    name: str
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags the level needs, its lower levels' included
    cflags: tuple[str, ...]  # what the compiler may use at this level


_AVX2 = Level("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"))
_AVX512 = Level(
    "avx512",
    _AVX2.cpu_flags + ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    _AVX2.cflags + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
)
_AVX512_BF16 = Level(
    "avx512_bf16",
    _AVX512.cpu_flags + ("avx512_bf16", "avx512_vnni"),
    _AVX512.cflags + ("-mavx512bf16", "-mavx512vnni"),
)
LEVELS: tuple[Level, ...] = (_AVX2, _AVX512, _AVX512_BF16)
LEVEL_NAMES = tuple(level.name for level in LEVELS)


def level(name: str) -> Level:
    for lv in LEVELS:
        if lv.name == name:
            return lv
    raise ValueError(f"unknown CPU ISA level {name!r}: expected one of {', '.join(LEVEL_NAMES)}")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo is not readable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cap() -> str | None:
    """The level named by ``LLMSERVE_CPU_ISA`` (None: no cap); a name that is not a level is an
    error."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return None
    return level(value).name


def missing_flags(lv: Level, flags: frozenset[str] | None = None) -> list[str]:
    flags = cpu_flags() if flags is None else flags
    return [f for f in lv.cpu_flags if f not in flags]


def supported_levels(flags: frozenset[str] | None = None) -> list[Level]:
    """The levels this CPU has, lowest first, up to the cap."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    limit = cap()
    out: list[Level] = []
    for lv in LEVELS:
        if missing_flags(lv, flags):
            break
        out.append(lv)
        if lv.name == limit:
            break
    return out


def best_level() -> Level | None:
    levels = supported_levels()
    return levels[-1] if levels else None


def why_not(lv: Level) -> str:
    """Why ``lv`` does not run here (empty if it does)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"this CPU is {platform.machine()}, not x86-64"
    missing = missing_flags(lv)
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    limit = cap()
    if limit is not None and LEVEL_NAMES.index(lv.name) > LEVEL_NAMES.index(limit):
        return f"{ISA_ENV}={limit} caps the level"
    return ""


def onednn_usable(dtype) -> bool:
    """Whether oneDNN's packed matmul runs in `dtype` (torch.bfloat16 or torch.float16) here: it
    needs AVX-512 (BW/VL/DQ; fp16 also AVX512-FP16) or AVX-NE-CONVERT, and a cap below ``avx512``
    stands for a CPU without them."""
    import torch

    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    limit = cap()
    if limit is not None and LEVEL_NAMES.index(limit) < LEVEL_NAMES.index("avx512"):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False
