"""Speculative decoding: a decoding sequence's step runs its next token and K proposed tokens in one
forward, and keeps every proposal its own sampling confirms.

A step of a sequence with proposals ``d1..dK`` runs ``[t, d1..dK]`` (``t``: its last sampled
token, not yet computed), each through the decode kernel as its own attention item, exactly as K+1
decode steps would run them, and gives K+1 logits rows. Verification samples row 0 as the plain
step would; while the token sampled at row i equals ``d(i+1)``, that proposal is accepted (its K/V,
computed in this forward, are now the sequence's) and row i+1 is sampled. The first mismatch ends
the step; its sampled token is kept, so every step yields at least one token.

Each token is drawn from exactly the distribution, and with exactly the random draws, that plain
decoding would use at its position: the same logits (rows are computed as decode steps compute
them), the same penalties over the tokens before it, the sequence's own generator consumed once per
token. So greedy and seeded output is identical with and without speculation, and unseeded output
has the same distribution. This is the rejection sampling of Leviathan et al. for proposals that
are certain (one token, probability 1): accepting ``d`` with probability ``p(d)`` and otherwise
sampling from ``p`` with ``d`` removed gives the token ``x`` with probability ``p(x)``, as drawing
``x ~ p`` and comparing does. Both proposers here are certain (n-gram lookup, a greedy draft).

Between steps a sequence holds no proposals and reserves KV slots for its computed tokens only:
the slots of rejected proposals go back to the pool, and only blocks full of verified tokens enter
the prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from shared.engine.scheduler import Scheduler
from shared.engine.sequence import Sequence


class Proposer(Protocol):
    def plan(self, seq: Sequence, max_tokens: int) -> int:
        """Before scheduling: how many proposals (at most ``max_tokens``) to reserve slots for."""
        ...

    def propose(self, seqs: list[Sequence]) -> None:
        """After scheduling: set each sequence's ``draft_token_ids``, at most its
        ``num_lookahead`` (the slots it was granted, all of them reserved)."""
        ...


# (sequences, logits rows) -> each sequence's next token appended, as the engine samples.
SampleRows = Callable[[list[Sequence], list[int]], None]


class Speculator:
    """``num_tokens``: proposals per sequence and step (K). ``max_num_seqs``: no proposals in a
    step where more sequences than this decode."""

    def __init__(
        self,
        proposer: Proposer,
        scheduler: Scheduler,
        *,
        num_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        if num_tokens < 1 or max_num_seqs < 1:
            raise ValueError("num_tokens and max_num_seqs must be positive")
        self.proposer = proposer
        self.scheduler = scheduler
        self.num_tokens = num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self._planned: list[Sequence] = []
        # Cumulative: steps of a sequence that carried proposals, proposals run, proposals accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def plan(self) -> None:
        """Before the scheduler runs: ask slots for each decoding sequence that may speculate."""
        running = self.scheduler.running
        decoding = [s for s in running if s.num_uncomputed == 1 and s.num_output_tokens > 0]
        if len(decoding) > self.max_num_seqs:
            return
        for seq in decoding:
            if not seq.request.params.speculative:
                continue
            # Proposals beyond max_tokens or the context could never be kept: their verified
            # positions must stay inside the model's context.
            k = min(
                self.num_tokens,
                seq.request.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - len(seq.token_ids) - 1,
            )
            if k > 0:
                seq.num_lookahead = self.proposer.plan(seq, k)
                self._planned.append(seq)

    def propose(self, scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """After scheduling: proposals for the sequences granted slots; ``scheduled`` with each
        one's token count as it will run (its next token plus its proposals)."""
        granted = [seq for seq, _ in scheduled if seq.num_lookahead]
        if not granted:
            return scheduled
        self.proposer.propose(granted)
        return [(seq, n - seq.num_lookahead + len(seq.draft_token_ids)) for seq, n in scheduled]

    def verify(
        self, logits: torch.Tensor, drafted: list[tuple[Sequence, int]], sample: SampleRows
    ) -> None:
        """``drafted``: (sequence, its first logits row), each sequence's row 0 already sampled.
        Accept proposals while they equal what is sampled (see the module docstring)."""
        self.num_drafts += len(drafted)
        self.num_draft_tokens += sum(len(seq.draft_token_ids) for seq, _ in drafted)
        pending = drafted
        i = 0
        while pending:
            accepted = [
                (seq, row)
                for seq, row in pending
                if seq.finish_reason is None and seq.token_ids[-1] == seq.draft_token_ids[i]
            ]
            for seq, _ in accepted:
                seq.num_computed_tokens += 1  # the proposal's K/V were computed in this forward
            self.num_accepted_tokens += len(accepted)
            if not accepted:
                break
            sample([seq for seq, _ in accepted], [row + i + 1 for _, row in accepted])
            i += 1
            pending = [(seq, row) for seq, row in accepted if i < len(seq.draft_token_ids)]

    def end_step(self) -> None:
        """Restore the between-steps state of every sequence planned this step: no proposals, slots
        for its computed tokens only, its newly verified full blocks in the prefix cache."""
        bm, scheduler = self.scheduler.bm, self.scheduler
        for seq in self._planned:
            if seq.num_lookahead and seq.seq_id in bm:
                bm.release_tail(seq.seq_id, seq.num_computed_tokens)
                bm.commit(
                    seq.seq_id,
                    seq.token_ids,
                    seq.num_computed_tokens,
                    scheduler.block_hashes(seq),
                )
            seq.num_lookahead = 0
            seq.draft_token_ids = []
        self._planned = []
