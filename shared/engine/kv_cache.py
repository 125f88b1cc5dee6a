"""The paged KV cache: per layer, one K and one V tensor of fixed-size blocks.

    k_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]      (model dtype)
                    [num_blocks, block_size, num_kv_heads, head_dim + 4]  (int8 or fp8: values,
                                                                           then the row's fp32
                                                                           scale as 4 bytes)
                     block 0 = padding (never allocated; padded block-table entries point at it)

    one (token, KV head) row of a scaled cache, head_dim + 4 bytes:
        [ v0 | v1 | ... | v(head_dim-1) | scale (fp32, native byte order, unaligned) ]

Allocated once, up front, from the memory ledger's block count: nothing is allocated per request.

int8 (``kv_cache_dtype="int8"``): each (token, KV head) row x is stored as q = round(x / s) with
s = max|x| / 127, symmetric, rounded half to even (an all-zero row gets s = 0). The scale travels in
the row's last 4 bytes, so a block is self-contained: copy-on-write, and later KV pages over the
wire, move bytes without knowing the format. A row reads back as (q * s) rounded to the model dtype.
"""

from __future__ import annotations

import torch

from shared.engine import huge_pages
from shared.engine.models.config import ModelConfig
from shared.engine.quantization import KV_CACHE_DTYPES, KV_SCALE_BYTES
from shared.engine.quantize_rows import quantize_rows

FP8_MAX = 448.0  # e4m3's largest finite value: a row's largest element maps to it
# The cache tensor's dtype per kv_cache_dtype that is not the model's.
_STORAGE_DTYPES = {"int8": torch.int8, "fp8": torch.uint8}


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] (any float dtype) -> int8 rows [..., head_dim + 4]: the int8 linear's per-row
    quantization, its scale appended as bytes; the kernels' rounding exactly."""
    q, scale = quantize_rows(x.float())
    return torch.cat([q, scale.unsqueeze(-1).view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., head_dim + 4] -> [..., head_dim] in ``dtype``: (q * scale) rounded once."""
    scale = rows[..., -KV_SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-KV_SCALE_BYTES].float() * scale).to(dtype)


def quantize_kv_fp8(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] (any float dtype) -> fp8 rows [..., head_dim + 4] (uint8): e4m3 bytes, then
    the fp32 scale's; the kernels' conversion exactly (torch's own cast to float8_e4m3fn)."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    inv = torch.where(amax > 0, FP8_MAX / amax, torch.zeros_like(amax))
    q = (x * inv.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale = (amax / FP8_MAX).unsqueeze(-1)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize_kv_fp8(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 rows [..., head_dim + 4] -> [..., head_dim] in ``dtype``: (e4m3 * scale) rounded once."""
    scale = rows[..., -KV_SCALE_BYTES:].contiguous().view(torch.float32)
    values = rows[..., :-KV_SCALE_BYTES].view(torch.float8_e4m3fn).float()
    return (values * scale).to(dtype)


def to_cache_rows(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows [..., head_dim] as a cache of ``cache_dtype`` stores them: quantized with their
    scales for int8 (torch.int8) and fp8 (torch.uint8) caches, as they are otherwise."""
    if cache_dtype == torch.int8:
        return quantize_kv(x)
    if cache_dtype == torch.uint8:
        return quantize_kv_fp8(x)
    return x


def from_cache_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as attention reads them: an int8 or fp8 cache's dequantized to ``dtype``, others
    as they are."""
    if rows.dtype == torch.int8:
        return dequantize_kv(rows, dtype)
    if rows.dtype == torch.uint8:
        return dequantize_kv_fp8(rows, dtype)
    return rows


def is_scaled_cache(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds int8 or fp8 rows with their scales (read back quantized)."""
    return cache.dtype in (torch.int8, torch.uint8)


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"KV cache needs at least 2 blocks (block 0 is padding), got {num_blocks}"
            )
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        scaled = kv_cache_dtype in _STORAGE_DTYPES
        row = config.head_dim + KV_SCALE_BYTES if scaled else config.head_dim
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, row)
        # Blocks are read scattered: see huge_pages.
        self.storage = huge_pages.zeros(shape, _STORAGE_DTYPES.get(kv_cache_dtype, dtype), device)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.storage[i, 0], self.storage[i, 1]) for i in range(config.num_layers)
        ]

    @property
    def num_bytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (every layer, K and V) from src to dst."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.storage.device)
        dst = torch.tensor([d for _, d in pairs], device=self.storage.device)
        self.storage[:, :, dst] = self.storage[:, :, src]
