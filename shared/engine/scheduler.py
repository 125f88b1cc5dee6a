"""Iteration-level scheduler of one executor: which tokens of which sequences run this step.

Invariants:
- Every step fits ``max_num_batched_tokens`` tokens and ``max_num_seqs`` running sequences.
- Running sequences are served before waiting ones, and among them those needing one token
  (decodes) before prefill chunks, so a long prompt never starves running decodes.
- When the KV pool cannot hold a running sequence's next tokens, the lowest-priority, latest
  running sequence is preempted (blocks freed, recomputed later from its tokens, which keep its
  output unchanged); no waiting request is admitted in a step that preempted.
- Long prefills (``LongPrefill``) never join a step's batch: one at a time is under way, granted
  chunk by chunk with a forward of its own (``layered``); while a chunk is in flight its sequence is
  not scheduled again. A later long prompt waits for it; shorter ones pass it. Its sequence stays
  running and may be preempted or removed mid-forward (``layered`` is then cleared: the engine
  drops the forward, and the chunk is recomputed, since nothing of it was counted computed).
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
    # A long prefill's chunk to start as a layered forward (``LongPrefill``): its blocks are
    # allocated; it is not in ``scheduled`` and not in ``num_tokens``.
    layered: tuple[Sequence, int] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass(frozen=True)
class LongPrefill:
    """Which prefills are *long*. A sequence with more than ``threshold`` tokens still to prefill
    is long (None: none is). A long prefill does not join the step's batch: the scheduler grants it
    chunk by chunk (``chunk_tokens`` each, never more than ``threshold``, which is the default) as
    ``SchedulerOutput.layered``, which the engine runs in a forward of its own, a slice of layers
    at a time between the batches of everything else. So what a short request waits for is a slice
    of that forward, never a whole chunk deep in a long context. Once a prefill has started long,
    every chunk of it runs so, its last (shorter) one included: a tail deep in the context would
    cost a shared step as much as a full chunk."""

    threshold: int | None = None
    chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.threshold is not None and self.threshold < 1:
            raise ValueError(f"threshold must be positive (or None), got {self.threshold}")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be positive (or None), got {self.chunk_tokens}")

    def is_long(self, num_uncomputed: int) -> bool:
        return self.threshold is not None and num_uncomputed > self.threshold

    def chunk(self, num_uncomputed: int) -> int:
        """Tokens of a long prefill's next chunk."""
        assert self.threshold is not None
        return min(num_uncomputed, self.threshold, self.chunk_tokens or self.threshold)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        long_prefill: LongPrefill | None = None,
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.long_prefill = long_prefill or LongPrefill()
        # The sequence whose long prefill is under way (each of its chunks is granted layered until
        # its last token is computed), and whether one of its chunks is in flight (granted, not
        # yet ended by ``end_layered``).
        self.layered: Sequence | None = None
        self.in_flight = False
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

    def end_layered(self, seq: Sequence, num_new: int) -> None:
        """The forward of ``seq``'s chunk has run its last layer: its tokens are computed."""
        assert self.layered is seq and self.in_flight, "no chunk of this sequence is in flight"
        self.in_flight = False
        seq.num_computed_tokens += num_new
        if seq.num_uncomputed == 0:  # the prefill is done; the sequence decodes in the batch
            self.layered = None

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if self.layered is seq:
            self.layered, self.in_flight = None, False
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
        long = self.long_prefill
        decodes = [s for s in self.running if s.num_uncomputed == 1]
        chunks = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decodes + chunks:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq is self.layered:
                if self.in_flight:
                    continue  # not scheduled again until its chunk's forward ends
                is_long = True
            else:
                is_long = long.is_long(seq.num_uncomputed)
                if is_long and self.layered is not None:
                    continue  # keeps its blocks; waits for the long prefill under way
            if not is_long and budget == 0:
                continue
            num_new = long.chunk(seq.num_uncomputed) if is_long else min(seq.num_uncomputed, budget)
            if seq.num_lookahead:
                num_new += self._grant_lookahead(seq, budget - num_new)
            while self.bm.allocate(seq.seq_id, seq.token_ids, num_new) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if is_long:
                out.layered, self.layered, self.in_flight = (seq, num_new), seq, True
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
        if out.preempted:
            return out
        index = 0  # waiting[:index] are long prompts passed over this step
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[index]
            hashes = self.block_hashes(seq)
            num_cached = (
                self.bm.match_prefix(seq.token_ids, hashes) if seq.seq_id not in self.bm else 0
            )
            num_uncomputed = len(seq.token_ids) - num_cached
            is_long = long.is_long(num_uncomputed)
            if is_long and self.layered is not None:
                index += 1  # a long prefill is under way: shorter prompts behind this one pass it
                continue
            num_new = long.chunk(num_uncomputed) if is_long else min(num_uncomputed, budget)
            got = self.bm.allocate(seq.seq_id, seq.token_ids, num_new, hashes)
            if got is None:
                break  # FCFS: a later request does not jump a head that does not fit
            assert got == num_cached, "prefix match changed between match_prefix and allocate"
            seq.num_computed_tokens = num_cached
            if seq.index == 0 and seq.request.num_cached_tokens == 0:
                seq.request.num_cached_tokens = num_cached
            self.waiting.pop(index)
            self.add_running(seq)
            if is_long:
                out.layered, self.layered, self.in_flight = (seq, num_new), seq, True
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
        return out

    def _grant_lookahead(self, seq: Sequence, budget: int) -> int:
        """How many of the speculative slots a decoding sequence asked for it gets: as many as the
        step's budget leaves, and only if free blocks hold them beside its next token's slot, so
        speculation never preempts. ``seq.num_lookahead`` is cut to the grant."""
        granted = min(seq.num_lookahead, budget)
        if granted and not self.bm.can_grow(seq.seq_id, 1 + granted):
            granted = 0
        seq.num_lookahead = granted
        return granted

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
        seq.num_lookahead = 0
        if self.layered is seq:  # its forward is dropped; the chunk is recomputed with the rest
            self.layered, self.in_flight = None, False
            if out.layered is not None and out.layered[0] is seq:
                out.layered = None
        self.add(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        out.scheduled = [(s, n) for s, n in out.scheduled if s is not seq]
        # A preempted sequence that was scheduled earlier in this step gives its blocks back, so the
        # tokens it was granted must not run: they were dropped above.
