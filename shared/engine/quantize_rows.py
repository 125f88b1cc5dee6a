"""Symmetric int8 quantization of rows: the primitive both int8 weights (``models/int8_linear.py``)
and the int8 KV cache (``kv_cache.py``) are built on. A leaf: it imports nothing of the engine."""

from __future__ import annotations

import torch


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (q, scale) with ``q = round(x / scale)`` (half to even) in
    [-127, 127] and ``scale = max|row| / 127``; a zero row gets scale 0 and q 0. ``x`` is fp32."""
    amax = x.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(x * inv.unsqueeze(-1)).to(torch.int8), amax / 127.0
