"""Applies the executors' KV event batches from the JetStream stream to Redis.

Every replica pulls from one durable consumer, so each stored batch goes to one replica; a replica
applies its fetched batches one at a time, in stream order, and acknowledges a batch only once
Redis has it (applied, or found to be a replay or stale). So:

- a crash between apply and ack redelivers a batch that is then a replay (a no-op);
- while Redis is down nothing is acknowledged: the batch in hand is retried when Redis is back
  (kept ours meanwhile with in-progress acks), the rest of the stream waits in JetStream;
- a gap (a batch before this one not applied yet) is usually that batch being in flight at another
  replica: nak with a delay, so it lands first; once the executor's applied seq has stood still
  for ``gap_stall_timeout_s`` (logic.GapTracker) it is really lost, and the executor's snapshot
  replaces its entries (no answer: it is purged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable

import msgspec
from prometheus_client import Histogram

from services.prefix_index.config import PrefixIndexConfig
from services.prefix_index.logic import Counters, GapAction, GapTracker
from services.prefix_index.store import ApplyResult, IndexUnavailable, PrefixStore
from services.prefix_index.watch import RedisWatch
from shared.wire import subjects
from shared.wire.bus import Bus, BusError, Msg, PullConsumer
from shared.wire.kv_events import (
    KV_CACHE_SNAPSHOT,
    KV_EVENTS_MESSAGE,
    KV_SNAPSHOT_REQUEST,
    AllBlocksCleared,
    KVEventsMessage,
    KVSnapshotRequest,
)

log = logging.getLogger("llmserve.prefix_index")

_FETCH_WAIT_S = 1.0  # a fetch returns this soon with nothing, so a stop is noticed
# One batch per fetch: a fetch of n waits (nats-py) until n have come or the wait is over, and
# batches held that way are late in the index and stall the other replicas' gaps behind them.
_FETCH_BATCH = 1
_NATS_RETRY_S = 0.5
_GAP_RECHECK_PAUSES_S = (0.002, 0.005, 0.01)
_STORE_ERROR_RETRY_S = 1.0  # a batch Redis refused for a non-transient reason comes back then


class BatchApplier:
    def __init__(
        self,
        bus: Bus,
        store: PrefixStore,
        config: PrefixIndexConfig,
        watch: RedisWatch,
        counters: Counters,
        lag_histogram: Histogram | None = None,
    ) -> None:
        self.bus = bus
        self.lag_histogram = lag_histogram  # observes every applied batch's lag
        self.store = store
        self.config = config
        self.watch = watch
        self.counters = counters
        self.gaps = GapTracker(config.gap_stall_timeout_s, config.resync_after_deliveries)

    async def run(self, consumer: PullConsumer, stopping: asyncio.Event) -> None:
        """Fetch and apply until ``stopping`` is set; the batch in hand is finished first."""
        while not stopping.is_set():
            if not self.watch.ok:  # fetch nothing we could not apply
                await self.watch.wait_back(_FETCH_WAIT_S)
                continue
            try:
                msgs = await consumer.fetch(_FETCH_BATCH, timeout=_FETCH_WAIT_S)
            except BusError as e:
                log.warning("cannot fetch KV event batches (%s); retrying", e)
                await asyncio.sleep(_NATS_RETRY_S)
                continue
            for i, msg in enumerate(msgs):
                if stopping.is_set() or not await self._handle(msg, msgs[i:], stopping):
                    # Not ours to finish: another replica (or our next start) takes them now.
                    for rest in msgs[i:]:
                        await _settle(rest.nak())
                    break

    async def _handle(self, msg: Msg, held: list[Msg], stopping: asyncio.Event) -> bool:
        """Apply one batch and settle it; False if stopping interrupted a wait for Redis (the
        batch is then neither applied nor settled)."""
        try:
            message = KV_EVENTS_MESSAGE.decode(msg.data)
            if message.batch.seq < 1:
                raise ValueError(f"batch seq {message.batch.seq} < 1")
        except (msgspec.DecodeError, ValueError) as e:
            log.error("dropping a malformed KV event batch on %s: %s", msg.subject, e)
            await _settle(msg.term())
            return True
        while True:
            try:
                await self._apply(msg, message)
                return True
            except IndexUnavailable as e:
                self.watch.failed(e)
                if not await self._hold_until_back(held, stopping):
                    return False
            except Exception:  # a refusal by Redis, or a bug: never the end of the loop
                log.exception(
                    "cannot apply batch %d of executor %s; it comes back in %.0fs",
                    message.batch.seq,
                    message.executor_id,
                    _STORE_ERROR_RETRY_S,
                )
                await _settle(msg.nak(delay=_STORE_ERROR_RETRY_S))
                return True

    async def _hold_until_back(self, held: list[Msg], stopping: asyncio.Event) -> bool:
        """Wait for Redis, telling JetStream we still work on ``held`` so it does not redeliver
        them meanwhile; False if stopping first."""
        keepalive_s = self.config.ack_wait_s / 3
        while not stopping.is_set():
            if await self.watch.wait_back(min(keepalive_s, _FETCH_WAIT_S)):
                return True
            for msg in held:
                await _settle(msg.in_progress())
        return False

    async def _apply(self, msg: Msg, message: KVEventsMessage) -> None:
        executor_id = message.executor_id
        result, applied_seq = await self.store.apply(message)
        # The missing batch is most often being applied by another replica this very moment: look
        # again a few times, a few ms apart, before a nak sends this one around the stream (and the
        # executor's next batches after it, which would find the same gap).
        for pause_s in _GAP_RECHECK_PAUSES_S:
            if result is not ApplyResult.GAP:
                break
            await asyncio.sleep(pause_s)
            result, applied_seq = await self.store.apply(message)
        if result is ApplyResult.GAP:
            self.counters.num_gaps += 1
            action = self.gaps.on_gap(
                executor_id,
                message.epoch,
                applied_seq,
                msg.metadata.num_delivered,
                time.monotonic(),
            )
            if action is GapAction.WAIT:
                await _settle(msg.nak(delay=self.config.gap_retry_delay_s))
                return
            await self.resync(executor_id, message.epoch, purge_on_failure=True)
            result, _ = await self.store.apply(message)  # usually a replay now
            if result is ApplyResult.GAP:
                log.warning(
                    "batch %d of executor %s is still after a gap once resynced; the next one "
                    "resyncs again",
                    message.batch.seq,
                    executor_id,
                )
        if result is not ApplyResult.GAP:
            self.gaps.on_progress(executor_id)
        if result is ApplyResult.APPLIED:
            self.counters.num_batches_applied += 1
            if any(isinstance(event, AllBlocksCleared) for event in message.batch.events):
                self.counters.num_purges += 1
            self.counters.last_apply_lag_s = max(
                0.0, time.time() - msg.metadata.timestamp.timestamp()
            )
            if self.lag_histogram is not None:
                self.lag_histogram.observe(self.counters.last_apply_lag_s)
        elif result is ApplyResult.REPLAY:
            self.counters.num_replays += 1
        elif result is ApplyResult.STALE:
            self.counters.num_stale += 1
        await _settle(msg.ack())

    async def resync(self, executor_id: str, epoch: str, *, purge_on_failure: bool) -> str:
        """Replace the executor's entries with its snapshot. If it does not answer: purge it
        (``purge_on_failure``: a gap nobody can fill) or leave the index as it is. Returns the
        store's answer, or 'no answer'."""
        try:
            data = await self.bus.request(
                subjects.executor_kv_snapshot(executor_id),
                KV_SNAPSHOT_REQUEST.encode(KVSnapshotRequest()),
                timeout=self.config.snapshot_timeout_s,
            )
            snapshot = KV_CACHE_SNAPSHOT.decode(data)
            if snapshot.executor_id != executor_id:
                raise ValueError(f"the snapshot is executor {snapshot.executor_id}'s")
        except (BusError, msgspec.DecodeError, ValueError) as e:
            if not purge_on_failure:
                log.debug("executor %s did not answer a snapshot request: %s", executor_id, e)
                return "no answer"
            result = await self.store.purge(executor_id, epoch)
            if result == "purged":
                self.counters.num_purges += 1
            log.warning(
                "executor %s missed batches and did not answer a snapshot request (%s): "
                "its entries are purged (%s)",
                executor_id,
                e,
                result,
            )
            return result
        result = await self.store.install_snapshot(snapshot)
        if result == "installed":
            self.counters.num_resyncs += 1
        log.info(
            "executor %s resynced from its snapshot (epoch %s, seq %d, %d blocks): %s",
            executor_id,
            snapshot.epoch,
            snapshot.seq,
            len(snapshot.block_hashes),
            result,
        )
        return result


async def _settle(ack: Awaitable[None]) -> None:
    """Send an ack, nak or in-progress; if NATS is down it is lost, and JetStream redelivers the
    batch after its ack wait, which applying again turns into a replay."""
    with contextlib.suppress(Exception):
        await ack
