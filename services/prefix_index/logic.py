"""The prefix index's decisions outside Lua: pure, no NATS, no asyncio, no Redis; every method
takes ``now`` so it is unit-tested synchronously.

- ``hash_tag_prefix``: the key prefix inside a hash tag (one cluster slot for the whole index).
- ``encode_events``: a batch's events as the flat Lua arguments of ``apply`` (lua.py).
- ``GapTracker``: nak and wait for a missing batch, or resync from a snapshot.
- ``ExecutorTracker``: who heartbeats, who went silent (purge), whose record to check in Redis.
- ``RedisHealth``: up/down transitions, so an outage and its end are each logged once.
- ``Counters``: this replica's figures for PrefixIndexStatus.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from shared.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from shared.wire.messages import PrefixIndexStatus

__all__ = [
    "Counters",
    "ExecutorTracker",
    "GapAction",
    "GapTracker",
    "RedisHealth",
    "encode_events",
    "hash_tag_prefix",
]


def hash_tag_prefix(key_prefix: str) -> str:
    """``llmserve:pi`` → ``{llmserve:pi}``: the hash tag that keeps every key in one slot."""
    if not key_prefix or any(c in key_prefix for c in "{} \t\r\n"):
        raise ValueError(f"key prefix must be non-empty, without braces or spaces: {key_prefix!r}")
    return "{" + key_prefix + "}"


def encode_events(events: Iterable[KVEvent]) -> list[str]:
    """'S' n h1..hn per BlockStored, 'R' n h1..hn per BlockRemoved, 'C' per AllBlocksCleared, in
    order. Hashes as decimal strings: the Lua side never turns them into (double) numbers."""
    out: list[str] = []
    for event in events:
        if isinstance(event, AllBlocksCleared):
            out.append("C")
        elif isinstance(event, BlockStored | BlockRemoved):
            if event.block_hashes:
                out.append("S" if isinstance(event, BlockStored) else "R")
                out.append(str(len(event.block_hashes)))
                out.extend(map(str, event.block_hashes))
        else:  # a new event type must be taught to the index, not skipped
            raise TypeError(f"unknown KV event {type(event).__name__}")
    return out


class GapAction(StrEnum):
    WAIT = "wait"  # nak with a delay: another replica may hold the missing batch
    RESYNC = "resync"  # ask the executor for its snapshot


class GapTracker:
    """Whether a batch that arrived after a gap should wait for the missing one or resync.

    With several replicas pulling from one consumer, an executor's batches are spread over them,
    so a gap is usually the missing batch being applied by another replica right now: the batch
    is nak'ed with a delay and comes back. A burst spread that way can need many such rounds, each
    of which moves the executor's applied seq on, so the rule is progress, not a count: resync
    only once this replica has seen the executor's applied (epoch, seq) stand still for
    ``stall_timeout_s`` across at least ``min_deliveries`` deliveries of the waiting batch (the
    missing batch is then really lost: dropped by the stream's limits, or held by a dead replica
    until its ack wait runs out)."""

    def __init__(self, stall_timeout_s: float, min_deliveries: int) -> None:
        if stall_timeout_s <= 0 or min_deliveries < 1:
            raise ValueError("stall_timeout_s must be > 0 and min_deliveries >= 1")
        self.stall_timeout_s = stall_timeout_s
        self.min_deliveries = min_deliveries
        self._stalled: dict[str, tuple[str, int, float]] = {}  # executor → epoch, seq, since

    def on_gap(
        self, executor_id: str, epoch: str, applied_seq: int, num_delivered: int, now: float
    ) -> GapAction:
        seen = self._stalled.get(executor_id)
        if seen is None or seen[:2] != (epoch, applied_seq):
            self._stalled[executor_id] = (epoch, applied_seq, now)  # it moved (or first sight)
            return GapAction.WAIT
        if num_delivered >= self.min_deliveries and now - seen[2] >= self.stall_timeout_s:
            return GapAction.RESYNC
        return GapAction.WAIT

    def on_progress(self, executor_id: str) -> None:
        """A batch of the executor was applied (or its entries replaced): no gap stands."""
        self._stalled.pop(executor_id, None)


@dataclass
class _Seen:
    epoch: str | None
    last_seen_s: float
    last_checked_s: float = -math.inf


class ExecutorTracker:
    """Liveness of executors by heartbeat, per replica (every replica hears every heartbeat).

    An executor is tracked from its first heartbeat, or from the first time this replica sees it in
    the index (so executors already in Redis when the index starts count as seen then). One silent
    for ``timeout_s`` is ``expired`` until the service has purged it (``forget``). A heartbeat asks
    for a check of the executor's record in Redis when its epoch is new to this replica (a restart:
    purge the old entries) or its last check is ``check_interval_s`` old (a record some replica
    tombstoned while the executor was alive: resync)."""

    def __init__(self, timeout_s: float, check_interval_s: float) -> None:
        if timeout_s <= 0 or check_interval_s <= 0:
            raise ValueError("timeout_s and check_interval_s must be > 0")
        self.timeout_s = timeout_s
        self.check_interval_s = check_interval_s
        self._seen: dict[str, _Seen] = {}

    def __contains__(self, executor_id: str) -> bool:
        return executor_id in self._seen

    def on_heartbeat(self, executor_id: str, epoch: str, now: float) -> bool:
        """Record a heartbeat; True: check this executor's record in Redis now."""
        seen = self._seen.get(executor_id)
        if seen is None or seen.epoch != epoch:
            seen = self._seen[executor_id] = _Seen(epoch, now)
        seen.last_seen_s = now
        if now - seen.last_checked_s >= self.check_interval_s:
            seen.last_checked_s = now
            return True
        return False

    def check_failed(self, executor_id: str) -> None:
        """The check could not be made (Redis down): ask again at the next heartbeat."""
        if (seen := self._seen.get(executor_id)) is not None:
            seen.last_checked_s = -math.inf

    def on_indexed(self, executors: dict[str, str], now: float) -> None:
        """Executors with a live record in Redis (id → epoch): those not tracked yet start their
        clock now, so one that never heartbeats here is purged ``timeout_s`` later."""
        for executor_id, epoch in executors.items():
            if executor_id not in self._seen:
                self._seen[executor_id] = _Seen(epoch, now)

    def expired(self, now: float) -> list[tuple[str, str | None]]:
        """(executor, last epoch seen) of every executor silent for ``timeout_s``."""
        return [
            (executor_id, seen.epoch)
            for executor_id, seen in self._seen.items()
            if now - seen.last_seen_s >= self.timeout_s
        ]

    def forget(self, executor_id: str) -> None:
        self._seen.pop(executor_id, None)


class RedisHealth:
    """Whether Redis answers, as the last call found it. ``failed`` and ``recovered`` return True
    only on a transition: the caller logs then, once per outage."""

    def __init__(self) -> None:
        self.ok = True
        self.down_since_s: float | None = None

    def failed(self, now: float) -> bool:
        if not self.ok:
            return False
        self.ok = False
        self.down_since_s = now
        return True

    def recovered(self, now: float) -> float | None:
        """The outage's length in seconds if this ends one, else None."""
        if self.ok:
            return None
        self.ok = True
        since, self.down_since_s = self.down_since_s, None
        return now - since if since is not None else 0.0


@dataclass
class Counters:
    num_batches_applied: int = 0
    num_replays: int = 0
    num_gaps: int = 0
    num_stale: int = 0
    num_resyncs: int = 0
    num_purges: int = 0
    last_apply_lag_s: float = 0.0

    def status(self, redis_ok: bool, num_executors: int, num_entries: int) -> PrefixIndexStatus:
        return PrefixIndexStatus(
            redis_ok=redis_ok,
            num_executors=num_executors,
            num_block_entries=num_entries,
            num_batches_applied=self.num_batches_applied,
            num_replays=self.num_replays,
            num_resyncs=self.num_resyncs,
            num_purges=self.num_purges,
            last_apply_lag_s=self.last_apply_lag_s,
        )
