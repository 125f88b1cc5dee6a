"""Transparent huge pages for the large, long-lived CPU tensors: the packed weights and the KV pool.

Why: a decode step streams every weight once and reads KV blocks scattered over the pool. On 4 KiB
pages that is a TLB miss every 4 KiB, and the hardware prefetchers stop at each page boundary; on
2 MiB pages neither happens. The memory-bound kernels gain (decode-sized bf16 linears and decode
attention run about a fifth faster at SmolLM2's shapes); a whole decode step, by less than this
host's noise. Measurements: ``loadtests/RESULTS.md``.

``madvise(MADV_HUGEPAGE)`` is asked for before the memory is first touched, so the kernel backs it
with huge pages as it faults in. Only the 2 MiB-aligned interior of an allocation can be: the few
MiB at its edges stay on small pages, which is why this is for tensors of many MiB. Elsewhere (not
Linux, THP set to "never", a GPU tensor) the memory is ordinary and nothing else changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math

import torch

HUGE_PAGE_BYTES = 2 << 20
_PAGE_BYTES = 4096
_MADV_HUGEPAGE = 14  # Linux <sys/mman.h>
_ALIGN_BYTES = 64  # every tensor in an arena starts on a cache line (the kernels' aligned loads)


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's madvise, or None where there is none to call (not Linux)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise(t: torch.Tensor) -> int:
    """Ask for huge pages under ``t``'s whole pages; returns the bytes advised (0: nothing done)."""
    fn = _madvise()
    if fn is None or t.device.type != "cpu":
        return 0
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first, last = -(-start // _PAGE_BYTES) * _PAGE_BYTES, end // _PAGE_BYTES * _PAGE_BYTES
    if last - first < HUGE_PAGE_BYTES:
        return 0
    return last - first if fn(first, last - first, _MADV_HUGEPAGE) == 0 else 0


def zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``torch.zeros``, on huge pages where the CPU allows."""
    t = torch.empty(shape, dtype=dtype, device=device)
    advise(t)
    return t.zero_()


def relocate(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (CPU, contiguous), laid one after another in one buffer on huge pages.
    They share that storage: memory accounting by storage counts it once."""
    if not tensors:
        return []
    offsets, total = [], 0
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("relocate takes contiguous CPU tensors")
        total = math.ceil(total / _ALIGN_BYTES) * _ALIGN_BYTES
        offsets.append(total)
        total += t.numel() * t.element_size()
    arena = torch.empty(total, dtype=torch.uint8)
    advise(arena)
    out = []
    for t, offset in zip(tensors, offsets, strict=True):
        nbytes = t.numel() * t.element_size()
        view = arena[offset : offset + nbytes].view(t.dtype).view(t.shape)
        out.append(view.copy_(t))
    return out
