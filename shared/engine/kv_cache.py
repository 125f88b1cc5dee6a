"""The paged KV cache: per layer, one K and one V tensor of fixed-size blocks.

    k_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]
                     block 0 = padding (never allocated; padded block-table entries point at it)

Allocated once, up front, from the memory ledger's block count: nothing is allocated per request.
"""

from __future__ import annotations

import torch

from shared.engine import huge_pages
from shared.engine.models.config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        if num_blocks < 2:
            raise ValueError(f"KV cache needs at least 2 blocks (block 0 is padding), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.storage = huge_pages.zeros(shape, dtype, device)  # blocks are read scattered: see huge_pages
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
