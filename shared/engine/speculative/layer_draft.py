"""A draft that is the model itself, cut short: its first layers, then its final norm and head.

The draft's layers are the model's own, so the K/V it computes for them at a position are exactly
the model's there: it needs no cache, no prefill and no memory of its own. It reads the sequence's
cached K/V of those layers and writes its proposals' K/V into the slots the step reserved for them,
which the verifying forward then overwrites (with the same values wherever a proposal is accepted).
Each proposal costs a forward of the first layers plus the head, one per token, greedy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shared.engine.block_manager import BlockManager
from shared.engine.model_runner import ModelRunner, ScheduledChunk
from shared.engine.sequence import Sequence


class LayerDraftProposer:
    """``argmax_rows``: the engine's argmax over logits rows (its kernel where it has one)."""

    def __init__(
        self,
        runner: ModelRunner,
        block_manager: BlockManager,
        num_layers: int,
        argmax_rows: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        total = runner.model.config.num_layers
        if not 1 <= num_layers < total:
            raise ValueError(
                f"a draft of {num_layers} layers: the model has {total}, so choose 1 to {total - 1}"
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
        then its proposals) through the first layers."""
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
