"""Shapes and block tables for the attention kernel tests."""

from __future__ import annotations

import torch

# (heads, kv_heads, head_dim): SmolLM2's GQA, Llama-3-8B's (head_dim 128), and plain multi-head.
SHAPES = [(9, 3, 64), (8, 2, 128), (4, 4, 64)]
# The attention kernels take keys 16 at a time: blocks of 16, of half that and of two such runs.
BLOCK_SIZES = [16, 8, 32]


def scattered_tables(
    seq_lens: list[int],
    num_blocks: int,
    block_size: int,
    g: torch.Generator,
    spare_columns: int = 0,
) -> tuple[list[list[int]], torch.Tensor]:
    """Distinct, shuffled, non-zero block ids per sequence; the padded [num_seqs, width] tensor
    too."""
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables, used = [], 0
    for n in seq_lens:
        nb = -(-n // block_size)
        tables.append(perm[used : used + nb])
        used += nb
    width = max(len(t) for t in tables) + spare_columns
    return tables, torch.tensor([t + [0] * (width - len(t)) for t in tables])
