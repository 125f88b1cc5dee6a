"""The JetStream stream that keeps the executors' KV event batches: created by whichever process
needs it first (an executor that publishes, a prefix index that consumes), configured here once."""

from __future__ import annotations

from shared.wire import subjects
from shared.wire.bus import Bus

# An index that was down longer than this, or behind by more than this many bytes, finds a gap and
# resynchronises from the executors' snapshots instead of replaying.
KV_EVENTS_MAX_AGE_S = 3600.0
KV_EVENTS_MAX_BYTES = 256 * 1024 * 1024


async def ensure_kv_events_stream(bus: Bus) -> None:
    await bus.ensure_stream(
        subjects.KV_EVENTS_STREAM,
        [subjects.KV_EVENTS_ALL],
        max_age_s=KV_EVENTS_MAX_AGE_S,
        max_bytes=KV_EVENTS_MAX_BYTES,
    )
