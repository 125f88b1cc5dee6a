"""One paged prefill of a whole text through a scratch KV cache, outside the engine: what
calibration (``int8_linear``), quality benchmarks and tests need to score every position of a text
at once."""

from __future__ import annotations

import math

import torch

from shared.engine.attention.metadata import build_attention_metadata
from shared.engine.kv_cache import KVCache


@torch.inference_mode()
def prefill_hidden(
    model,
    token_ids: list[int],
    block_table: list[int] | None = None,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """Final-normed hidden states [len(token_ids), hidden] of one prefill. ``block_table``: the KV
    blocks to write (default 1, 2, ...; block 0 is padding), in a cache of ``num_blocks`` (default:
    just enough) holding ``kv_cache_dtype`` (an int8 or fp8 cache is read back quantized, as the
    engine reads it)."""
    if not token_ids:
        raise ValueError("token_ids must not be empty")
    needed = -(-len(token_ids) // block_size)
    table = list(range(1, needed + 1)) if block_table is None else block_table
    kv = KVCache(
        model.config,
        num_blocks or max(table) + 1,
        block_size,
        model.dtype,
        model.device,
        kv_cache_dtype,
    )
    meta = build_attention_metadata(
        query_lens=[len(token_ids)],
        num_computed=[0],
        block_tables=[table],
        block_size=block_size,
        num_decodes=0,
    )
    return model(torch.tensor(token_ids, dtype=torch.int64), kv.layers, meta)


def all_position_logits(
    model,
    token_ids: list[int],
    block_table: list[int] | None = None,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """fp32 logits [len(token_ids), vocab] at every position (teacher forcing): row i is the
    distribution of the token after ``token_ids[:i + 1]``."""
    hidden = prefill_hidden(
        model,
        token_ids,
        block_table,
        block_size=block_size,
        num_blocks=num_blocks,
        kv_cache_dtype=kv_cache_dtype,
    )
    return model.compute_logits(hidden)


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ``token_ids[1:]`` under ``logits[:-1]``."""
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    nll = -logp[torch.arange(len(token_ids) - 1), torch.tensor(token_ids[1:])].mean().item()
    return math.exp(nll)
