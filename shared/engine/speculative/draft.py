"""A draft that is the model itself run cheaper: its int8-weight twin (``--quantization int8``'s
decoder linears, half the bytes a decode step reads), all its layers or only the first ones.

The twin drafts on the model's own KV cache: it attends to the K/V the model computed for the
sequence, and writes its proposals' K/V into the slots the step reserved for them, which the
verifying forward then overwrites with the model's. So the draft needs no cache, no prefill and no
KV memory of its own, and whatever it gets wrong costs only acceptance: verification is exact. Each
proposal costs one forward of the twin (greedy, a token per sequence).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shared.engine.block_manager import BlockManager
from shared.engine.model_runner import ModelRunner, ScheduledChunk
from shared.engine.sequence import Sequence


class DraftProposer:
    """``runner``: the draft model on the engine's KV cache. ``num_layers``: run its first that
    many layers, then its final norm and head (None: all). ``argmax_rows``: the engine's argmax
    over logits rows (its kernel where it has one)."""

    def __init__(
        self,
        runner: ModelRunner,
        block_manager: BlockManager,
        num_layers: int | None,
        argmax_rows: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        total = runner.model.config.num_layers
        if num_layers is not None and not 1 <= num_layers <= total:
            raise ValueError(
                f"a draft of {num_layers} layers: the model has {total}, so choose 1 to {total}"
            )
        self.runner = runner
        self.bm = block_manager
        self.num_layers = num_layers
        self.argmax_rows = argmax_rows

    def plan(self, seq: Sequence, max_tokens: int) -> int:
        return max_tokens  # proposed once the slots are reserved (``propose``)

    def propose(self, seqs: list[Sequence]) -> None:
        """``seq.num_lookahead`` proposals for each of ``seqs``, whose slots are reserved: draft
        forward ``j`` runs each sequence's token at position ``num_computed + j`` (its last token,
        then its proposals)."""
        last = [seq.token_ids[-1] for seq in seqs]
        for seq in seqs:
            seq.draft_token_ids = []
        for j in range(max(seq.num_lookahead for seq in seqs)):
            active = [i for i, seq in enumerate(seqs) if seq.num_lookahead > j]
            chunks = [
                ScheduledChunk(
                    token_ids=[last[i]],
                    num_computed=seqs[i].num_computed_tokens + j,
                    block_table=self.bm.block_table(seqs[i].seq_id),
                    decode_from=seqs[i].num_prompt_tokens,
                )
                for i in active
            ]
            tokens = self.argmax_rows(self.runner.execute(chunks, self.num_layers)).tolist()
            for i, token in zip(active, tokens, strict=True):
                seqs[i].draft_token_ids.append(token)
                last[i] = token
