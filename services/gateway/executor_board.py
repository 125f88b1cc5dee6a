"""The latest heartbeat of every executor, as the gateway hears them (``executor.*.stats``), for the
console's ledgers. Two heartbeats per executor are kept, the latest and the one before, so rates
(tokens per second, tokens per step) come from the counters' growth between them. An executor
silent for ``stale_after_s`` is left out; a new epoch (a restart) forgets the one before.
Pure: times are passed in (monotonic)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.wire.messages import ExecutorHeartbeat


@dataclass(frozen=True)
class Sighting:
    heartbeat: ExecutorHeartbeat
    received: float  # monotonic
    previous: ExecutorHeartbeat | None = None  # the one before, same epoch
    previous_received: float | None = None


class ExecutorBoard:
    def __init__(self, stale_after_s: float = 5.0) -> None:
        if stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s}")
        self.stale_after_s = stale_after_s
        self._seen: dict[str, Sighting] = {}

    def put(self, heartbeat: ExecutorHeartbeat, now: float) -> None:
        last = self._seen.get(heartbeat.executor_id)
        same_epoch = last is not None and last.heartbeat.epoch == heartbeat.epoch
        self._seen[heartbeat.executor_id] = Sighting(
            heartbeat,
            now,
            last.heartbeat if same_epoch and last is not None else None,
            last.received if same_epoch and last is not None else None,
        )

    def live(self, now: float) -> list[Sighting]:
        """Those heard within ``stale_after_s``, by executor id; the others are forgotten."""
        for executor_id in [
            e for e, s in self._seen.items() if now - s.received > self.stale_after_s
        ]:
            del self._seen[executor_id]
        return [self._seen[e] for e in sorted(self._seen)]
