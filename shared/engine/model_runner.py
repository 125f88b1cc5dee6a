"""Runs one forward pass over a batch of scheduled chunks against the paged KV cache, whole
(``execute``) or a few layers at a time (``start``, then ``Forward.advance``)."""

from __future__ import annotations

import time
from collections.abc import Generator
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
    # With need_logits: the chunk's last num_logits tokens each get a logits row, in order (a
    # speculative step verifies the proposals that end the chunk).
    num_logits: int = 1

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a chunk has at least one new token")
        if not 1 <= self.num_logits <= len(self.token_ids):
            raise ValueError(
                f"num_logits={self.num_logits} outside [1, {len(self.token_ids)}] (the chunk's "
                "tokens)"
            )

    def split(self) -> tuple[int, int]:
        """(prefill tokens, decode tokens): the chunk's first tokens go to the prefill kernel, the
        rest are one decode each."""
        n = len(self.token_ids)
        if self.decode_from is None:
            return (0, 1) if n == 1 else (n, 0)
        num_prefill = min(n, max(0, self.decode_from - self.num_computed))
        return num_prefill, n - num_prefill


class Forward:
    """A forward pass in flight: ``advance`` runs its layers, ``logits`` gives its result. It holds
    its own inputs, metadata and hidden states, and writes the KV cache only in its chunks' slots,
    so other forwards may run between two of its layers; dropping it unfinished leaves nothing
    behind but K/V in slots that are written again before anything reads them."""

    def __init__(
        self,
        model: ModelRuntime | LlamaModel,
        layers: Generator[None, None, torch.Tensor],
        rows: list[int],
    ) -> None:
        self._model = model
        self._layers = layers
        self._rows = rows
        self._hidden: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self._hidden is not None

    def advance(self, until: float | None = None) -> bool:
        """Run layers until the last is done, or until the next would end past ``until`` (a
        ``time.perf_counter()`` reading), judged by the last one's time: layers of one forward cost
        alike. At least one layer runs; None: to the end. True once the forward is done."""
        start = time.perf_counter()
        while self._hidden is None:
            try:
                next(self._layers)
            except StopIteration as finished:
                self._hidden = finished.value
                break
            now = time.perf_counter()
            if until is not None and now + (now - start) > until:
                break
            start = now
        return self._hidden is not None

    def logits(self) -> torch.Tensor:
        """Logits [chunks with need_logits, vocab] (fp32), in the order of the chunks."""
        if self._hidden is None:
            raise RuntimeError("the forward has layers left to run")
        if not self._rows:
            return torch.empty(0, self._model.config.vocab_size)
        rows = torch.tensor(self._rows, device=self._hidden.device)
        return self._model.compute_logits(self._hidden[rows])


class ModelRunner:
    """``model``: a model on its backend (``ModelRuntime``), or a bare ``LlamaModel`` (the torch
    path)."""

    def __init__(self, model: ModelRuntime | LlamaModel, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device

    def execute(self, chunks: list[ScheduledChunk], num_layers: int | None = None) -> torch.Tensor:
        """Logits [rows of the chunks with need_logits, vocab] (fp32), in the order of
        ``chunks``."""
        forward = self.start(chunks, num_layers)
        forward.advance()
        return forward.logits()

    def start(self, chunks: list[ScheduledChunk], num_layers: int | None = None) -> Forward:
        """The forward over ``chunks``, no layer run yet (``execute`` is this run to the end).
        ``num_layers``: run only the model's first that many decoder layers, then its final norm
        and head (a draft of the model that shares its KV cache); None: all of them."""
        if not chunks:
            raise ValueError("execute() needs at least one chunk")
        max_len = self.model.config.max_position_embeddings
        for c in chunks:
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
        # Per chunk: (index of its prefill item or -1, its prefill tokens, its first decode item).
        placed: list[tuple[int, int, int]] = []
        for c in chunks:
            num_prefill, num_decode = c.split()
            placed.append((len(prefills) if num_prefill else -1, num_prefill, len(decodes)))
            if num_prefill:
                prefills.append((c.token_ids[:num_prefill], c.num_computed, c.block_table))
            for i in range(num_prefill, num_prefill + num_decode):
                decodes.append(([c.token_ids[i]], c.num_computed + i, c.block_table))
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
        starts = meta.query_start_loc
        rows: list[int] = []  # the flat token index of each logits row
        for c, (prefill_item, num_prefill, first_decode) in zip(chunks, placed, strict=True):
            if not c.need_logits:
                continue
            for t in range(len(c.token_ids) - c.num_logits, len(c.token_ids)):
                if t < num_prefill:
                    rows.append(starts[len(decodes) + prefill_item] + t)
                else:
                    rows.append(starts[first_decode + t - num_prefill])
        layers = self.model.forward_layers(
            input_ids, self.kv_cache.layers[:num_layers], meta, num_layers
        )
        return Forward(self.model, layers, rows)
