"""Runs one forward pass over a batch of scheduled chunks against the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.attention.metadata import build_attention_metadata
from shared.engine.kv_cache import KVCache
from shared.engine.models.llama import LlamaModel


@dataclass(frozen=True)
class ScheduledChunk:
    """New tokens of one sequence for this step. ``num_computed`` tokens are already cached, so the
    chunk's first token sits at that position. ``need_logits``: the chunk ends at the sequence's
    last known token, so its next token is sampled. ``decode``: attend with the decode kernel (one
    token); None = whenever the chunk is one token.

    The engine marks only a sampled token's first pass as a decode, and so runs every prompt token,
    however the prompt was chunked or served from the prefix cache, through the prefill kernel: the
    two kernels round differently, and a prompt whose last chunk happened to be one token (a budget
    split, a prefix hit) would otherwise give slightly different logits than the same prompt alone."""

    token_ids: list[int]
    num_computed: int
    block_table: list[int]
    need_logits: bool = True
    decode: bool | None = None

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 if self.decode is None else self.decode


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.embed_tokens.weight.device

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits [num chunks with need_logits, vocab] (fp32), in the order of ``chunks``."""
        if not chunks:
            raise ValueError("execute() needs at least one chunk")
        max_len = self.model.config.max_position_embeddings
        for c in chunks:
            if c.num_computed + len(c.token_ids) > max_len:
                raise ValueError(f"prompt of {c.num_computed + len(c.token_ids)} tokens exceeds the "
                                 f"model's context of {max_len}")
            if c.decode and len(c.token_ids) != 1:
                raise ValueError(f"a decode chunk has one token, got {len(c.token_ids)}")
        # Decodes go first so attention can batch them (see AttentionMetadata).
        order = sorted(range(len(chunks)), key=lambda i: not chunks[i].is_decode)
        ordered = [chunks[i] for i in order]
        meta = build_attention_metadata(
            query_lens=[len(c.token_ids) for c in ordered],
            num_decodes=sum(c.is_decode for c in ordered),
            num_computed=[c.num_computed for c in ordered],
            block_tables=[c.block_table for c in ordered],
            block_size=self.kv_cache.block_size,
            device=self.device,
            dtype=self.model.dtype,
        )
        input_ids = torch.tensor([t for c in ordered for t in c.token_ids], dtype=torch.int64,
                                 device=self.device)
        hidden = self.model(input_ids, self.kv_cache.layers, meta)
        # Row of each chunk's last token, in the caller's order.
        last_row = {i: meta.query_start_loc[pos + 1] - 1 for pos, i in enumerate(order)}
        rows = [last_row[i] for i, c in enumerate(chunks) if c.need_logits]
        if not rows:
            return torch.empty(0, self.model.config.vocab_size)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
