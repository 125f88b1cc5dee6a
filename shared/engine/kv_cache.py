"""The paged KV cache: per layer, one K and one V tensor of fixed-size blocks.

    k_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]      (model dtype)
                    [num_blocks, block_size, num_kv_heads, head_dim + 4]  (int8: values, then
                                                                           the row's fp32 scale
                                                                           as 4 bytes)
                     block 0 = padding (never allocated; padded block-table entries point at it)

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


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] (any float dtype) -> int8 rows [..., head_dim + 4]: the int8 linear's per-row
    quantization, its scale appended as bytes; the kernels' rounding exactly."""
    q, scale = quantize_rows(x.float())
    return torch.cat([q, scale.unsqueeze(-1).view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., head_dim + 4] -> [..., head_dim] in ``dtype``: (q * scale) rounded once."""
    scale = rows[..., -KV_SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-KV_SCALE_BYTES].float() * scale).to(dtype)


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
        int8 = kv_cache_dtype == "int8"
        row = config.head_dim + KV_SCALE_BYTES if int8 else config.head_dim
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, row)
        # Blocks are read scattered: see huge_pages.
        self.storage = huge_pages.zeros(shape, torch.int8 if int8 else dtype, device)
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
