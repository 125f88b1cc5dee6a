"""Runs one forward pass over a batch of scheduled chunks against the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.attention.metadata import build_attention_metadata
from shared.engine.kv_cache import KVCache
from shared.engine.models.llama import LlamaModel
from shared.engine.models.runtime import ModelRuntime


@dataclass(frozen=True)
class ScheduledChunk:
    """New tokens of one sequence for this step. ``num_computed`` tokens are already cached, so the
    chunk's first token sits at that position. ``need_logits``: the chunk ends at the sequence's
    last known token, so its next token is sampled.

    ``decode_from``: the tokens at this position and after are sampled tokens, and each attends
    through the decode kernel on its own, as it did on its first pass; the tokens before it go
    through the prefill kernel together. None: a one-token chunk is a decode, a longer one prefill.

    The two kernels round differently, so the engine passes the prompt's length here. Then every
    prompt token goes through the prefill kernel however the prompt was chunked or served from the
    prefix cache (a prompt whose last chunk happened to be one token would otherwise give slightly
    different logits), and a preempted sequence that recomputes its sampled tokens in one chunk
    gets exactly the values its decode steps had."""

    token_ids: list[int]
    num_computed: int
    block_table: list[int]
    need_logits: bool = True
    decode_from: int | None = None

    def split(self) -> tuple[int, int]:
        """(prefill tokens, decode tokens): the chunk's first tokens go to the prefill kernel, the
        rest are one decode each."""
        n = len(self.token_ids)
        if self.decode_from is None:
            return (0, 1) if n == 1 else (n, 0)
        num_prefill = min(n, max(0, self.decode_from - self.num_computed))
        return num_prefill, n - num_prefill


class ModelRunner:
    """``model``: a model on its backend (``ModelRuntime``), or a bare ``LlamaModel`` (the torch
    path)."""

    def __init__(self, model: ModelRuntime | LlamaModel, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits [num chunks with need_logits, vocab] (fp32), in the order of ``chunks``."""
        if not chunks:
            raise ValueError("execute() needs at least one chunk")
        max_len = self.model.config.max_position_embeddings
        for c in chunks:
            if not c.token_ids:
                raise ValueError("a chunk has at least one new token")
            if c.num_computed + len(c.token_ids) > max_len:
                raise ValueError(
                    f"prompt of {c.num_computed + len(c.token_ids)} tokens exceeds the "
                    f"model's context of {max_len}"
                )
        # One attention item per decode token, then one per prefill part: decodes go first so
        # attention can batch them (see AttentionMetadata). Every token's K/V is written before any
        # item attends, so a decode item at position p reads its sequence's first p + 1 tokens
        # whichever item wrote them.
        decodes: list[tuple[list[int], int, list[int]]] = []  # (token ids, position, block table)
        prefills: list[tuple[list[int], int, list[int]]] = []
        last_item: list[
            tuple[bool, int]
        ] = []  # per chunk: (is a decode, index) of its last token's item
        for c in chunks:
            num_prefill, num_decode = c.split()
            if num_prefill:
                prefills.append((c.token_ids[:num_prefill], c.num_computed, c.block_table))
            for i in range(num_prefill, num_prefill + num_decode):
                decodes.append(([c.token_ids[i]], c.num_computed + i, c.block_table))
            last_item.append((True, len(decodes) - 1) if num_decode else (False, len(prefills) - 1))
        items = decodes + prefills
        meta = build_attention_metadata(
            query_lens=[len(ids) for ids, _, _ in items],
            num_decodes=len(decodes),
            num_computed=[start for _, start, _ in items],
            block_tables=[table for _, _, table in items],
            block_size=self.kv_cache.block_size,
            device=self.device,
            dtype=self.model.dtype,
        )
        input_ids = torch.tensor(
            [t for ids, _, _ in items for t in ids], dtype=torch.int64, device=self.device
        )
        hidden = self.model(input_ids, self.kv_cache.layers, meta)
        rows = [
            meta.query_start_loc[index + (0 if is_decode else len(decodes)) + 1] - 1
            for (is_decode, index), c in zip(last_item, chunks, strict=True)
            if c.need_logits
        ]
        if not rows:
            return torch.empty(0, self.model.config.vocab_size)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
