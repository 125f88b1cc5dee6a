"""Iteration-level scheduler of one executor: which tokens of which sequences run this step.

Invariants:
- Every step fits ``max_num_batched_tokens`` tokens and ``max_num_seqs`` running sequences.
- Running sequences are served before waiting ones, and among them those needing one token
  (decodes) before prefill chunks, so a long prompt never starves running decodes.
- When the KV pool cannot hold a running sequence's next tokens, the lowest-priority, latest
  running sequence is preempted (blocks freed, recomputed later from its tokens, which keep its
  output unchanged); no waiting request is admitted in a step that preempted.
- Prefills share a step under ``PrefillLimits`` (see there): no prompt takes more than
  ``long_prefill_token_threshold`` tokens of a step, and at most ``max_long_partial_prefills`` long
  prompts prefill in one, so a short prompt that arrives during a long prefill runs in the next
  step, not after the whole long prompt.
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


@dataclass(frozen=True)
class PrefillLimits:
    """How the prompts being prefilled share one step. None: no limit (every prompt takes what the
    budget leaves, first come first served: a long prompt then holds every step until it is done).

    - ``long_prefill_token_threshold``: a prompt with more tokens than this still to compute is
      *long*; no prompt gets more than this many tokens in one step. Long prompts are chunked at
      it, so a step that carries one stays short, and the rest of the budget is left to others.
    - ``max_num_partial_prefills``: prompts prefilled in one step (long and short).
    - ``max_long_partial_prefills``: long prompts prefilled in one step. A long prompt that would
      exceed it waits, and shorter prompts queued behind it may pass it.
    """

    long_prefill_token_threshold: int | None = None
    max_num_partial_prefills: int | None = None
    max_long_partial_prefills: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "long_prefill_token_threshold",
            "max_num_partial_prefills",
            "max_long_partial_prefills",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive (or None), got {value}")

    def is_long(self, num_uncomputed: int) -> bool:
        t = self.long_prefill_token_threshold
        return t is not None and num_uncomputed > t

    def chunk(self, num_uncomputed: int) -> int:
        """Tokens a prompt with ``num_uncomputed`` left may take in one step."""
        t = self.long_prefill_token_threshold
        return num_uncomputed if t is None else min(num_uncomputed, t)


class _PrefillSlots:
    """The prefills granted so far in one step, against ``PrefillLimits``."""

    def __init__(self, limits: PrefillLimits) -> None:
        self.limits = limits
        self.num_prefills = 0
        self.num_long = 0

    @property
    def full(self) -> bool:
        cap = self.limits.max_num_partial_prefills
        return cap is not None and self.num_prefills >= cap

    def admits(self, num_uncomputed: int) -> bool:
        if self.full:
            return False
        cap = self.limits.max_long_partial_prefills
        long_slots_taken = cap is not None and self.num_long >= cap
        return not (long_slots_taken and self.limits.is_long(num_uncomputed))

    def take(self, num_uncomputed: int) -> None:
        self.num_prefills += 1
        self.num_long += self.limits.is_long(num_uncomputed)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        prefill_limits: PrefillLimits | None = None,
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.prefill_limits = prefill_limits or PrefillLimits()
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
        slots = _PrefillSlots(self.prefill_limits)
        decodes = [s for s in self.running if s.num_uncomputed == 1]
        chunks = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decodes + chunks:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_uncomputed = seq.num_uncomputed
            is_prefill = num_uncomputed > 1
            if is_prefill and not slots.admits(num_uncomputed):
                continue  # keeps its blocks; runs in a later step
            num_new = min(self.prefill_limits.chunk(num_uncomputed), budget)
            while self.bm.allocate(seq.seq_id, seq.token_ids, num_new) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                if is_prefill:
                    slots.take(num_uncomputed)
        if out.preempted:
            return out
        index = 0  # waiting[:index] are long prompts passed over this step
        while (
            index < len(self.waiting)
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not slots.full
        ):
            seq = self.waiting[index]
            hashes = self.block_hashes(seq)
            num_cached = (
                self.bm.match_prefix(seq.token_ids, hashes) if seq.seq_id not in self.bm else 0
            )
            num_uncomputed = len(seq.token_ids) - num_cached
            if not slots.admits(num_uncomputed):
                index += 1  # a long prompt while the long slots are taken: shorter ones may pass
                continue
            num_new = min(self.prefill_limits.chunk(num_uncomputed), budget)
            got = self.bm.allocate(seq.seq_id, seq.token_ids, num_new, hashes)
            if got is None:
                break  # FCFS: a later request does not jump a head that does not fit
            assert got == num_cached, "prefix match changed between match_prefix and allocate"
            seq.num_computed_tokens = num_cached
            if seq.index == 0 and seq.request.num_cached_tokens == 0:
                seq.request.num_cached_tokens = num_cached
            self.waiting.pop(index)
            self.add_running(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
            slots.take(num_uncomputed)
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
