"""Iteration-level scheduler of one executor: which tokens of which sequences run this step.

Invariants:
- Every step fits ``max_num_batched_tokens`` tokens and ``max_num_seqs`` running sequences.
- Running sequences are served before waiting ones, and among them those needing one token
  (decodes) before prefill chunks, so a long prompt never starves running decodes.
- When the KV pool cannot hold a running sequence's next tokens, the lowest-priority, latest
  running sequence is preempted (blocks freed, recomputed later from its tokens, which keep its
  output unchanged); no waiting request is admitted in a step that preempted.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from shared.engine.block_manager import BlockManager
from shared.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(
        default_factory=list
    )  # (sequence, num new tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, *, max_num_batched_tokens: int, max_num_seqs: int
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: list[Sequence] = []  # kept sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # kept sorted by Sequence.sort_key
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def add_running(self, seq: Sequence) -> None:
        """A forked child: its blocks are already allocated (shared with its parent)."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        if seq.seq_id in self.bm:
            self.bm.free(seq.seq_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_uncomputed == 1]
        chunks = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decodes + chunks:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed, budget)
            while self.bm.allocate(seq.seq_id, seq.token_ids, num_new) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                out.scheduled.append((seq, num_new))
                budget -= num_new
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hashes = self.block_hashes(seq)
            num_cached = (
                self.bm.match_prefix(seq.token_ids, hashes) if seq.seq_id not in self.bm else 0
            )
            num_new = min(len(seq.token_ids) - num_cached, budget)
            got = self.bm.allocate(seq.seq_id, seq.token_ids, num_new, hashes)
            if got is None:
                break  # FCFS: a later request does not jump a head that does not fit
            assert got == num_cached, "prefix match changed between match_prefix and allocate"
            seq.num_computed_tokens = num_cached
            if seq.index == 0 and seq.request.num_cached_tokens == 0:
                seq.request.num_cached_tokens = num_cached
            self.waiting.pop(0)
            self.add_running(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        return out

    def block_hashes(self, seq: Sequence) -> list[int] | None:
        """The sequence's full-block hashes for the block manager; None while prefix caching is off
        (nothing reads them then, so nothing is hashed)."""
        return seq.full_block_hashes(self.bm.block_size) if self.bm.enable_prefix_caching else None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute preemption: forget the sequence's KV; its tokens (prompt + output so far) are
        prefilled again when it is resumed, so it continues exactly where it stopped."""
        self.running.remove(seq)
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        self.add(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        out.scheduled = [(s, n) for s, n in out.scheduled if s is not seq]
        # A preempted sequence that was scheduled earlier in this step gives its blocks back, so the
        # tokens it was granted must not run: they were dropped above.
