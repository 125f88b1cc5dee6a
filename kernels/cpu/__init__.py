"""Fused CPU kernels (``csrc/ops.cpp``), compiled once per machine and loaded as ``torch.ops.llmserve_cpu``.

``cpu_ops()`` returns the op namespace, or None when the kernels are switched off
(``LLMSERVE_CPU_KERNELS=0``) or cannot be built (no C++ compiler, no AVX-512): callers take the unfused
torch path, which computes the same thing and is what the kernels are tested against.

The build uses ``-march=native``, so the library is keyed by this CPU's feature flags as well as by
the source (torch's extension cache rebuilds when the source changes). The first build takes under a
minute; later processes load the cached library in milliseconds. Concurrent first builds (several
executors starting together) wait on torch's build lock.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time

import torch

log = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "ops.cpp")
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-std=c++17"]


def _cpu_key() -> str:
    """A short digest of what ``-march=native`` will target on this host."""
    flags = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "model name")):
                    flags += line
    except OSError:
        pass
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def enabled() -> bool:
    return os.environ.get("LLMSERVE_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def _load():
    from torch.utils import cpp_extension

    name = f"llmserve_cpu_{_cpu_key()}"
    t0 = time.perf_counter()
    log.info("loading CPU kernels %s (compiled on first use: under a minute)", name)
    cpp_extension.load(name=name, sources=[_SOURCE], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)
    log.info("CPU kernels ready in %.1f s", time.perf_counter() - t0)
    return torch.ops.llmserve_cpu


@functools.lru_cache(maxsize=None)
def cpu_ops():
    """``torch.ops.llmserve_cpu`` or None (switched off, or the build failed). Decided once per
    process; ``cpu_ops.cache_clear()`` re-reads ``LLMSERVE_CPU_KERNELS``."""
    if not enabled():
        return None
    try:
        return _load()
    except Exception as exc:  # no compiler, headers or ninja: the torch path still works
        log.warning("CPU kernels unavailable, using the unfused torch path: %s", exc)
        return None
