"""The prefix index actor: a thin async shell over the store (Lua in Redis) and the pure logic.

Inputs:
- KV_EVENTS_STREAM, through the durable pull consumer ``config.consumer`` (one consumer group over
  every replica): the BatchApplier applies and acks each batch (applier.py);
- EXECUTOR_STATS_ALL (fan-out: every replica tracks liveness): a new epoch purges the executor's
  old entries; an executor in the index silent for ``executor_timeout_s`` is purged; one that
  beats although its epoch was purged as dead, or that the index has no record of (new, or Redis
  lost its data), is resynced from its snapshot;
- PREFIX_INDEX_MATCH and PREFIX_INDEX_STATUS, request/reply in queue group QUEUE_PREFIX_INDEX. A
  match whose request carries a trace context gets a ``prefix_index.match`` span.

While Redis is down (watch.py) matches answer at once with ``error`` set (the scheduler then
routes by load), and no batch is acknowledged, so none is lost; the service recovers by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import msgspec
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.prefix_index.applier import BatchApplier
from services.prefix_index.config import PrefixIndexConfig
from services.prefix_index.logic import Counters, ExecutorTracker
from services.prefix_index.metrics import IndexMetrics
from services.prefix_index.store import (
    IndexAccessDenied,
    IndexStoreError,
    IndexUnavailable,
    PrefixStore,
    connect_redis,
)
from services.prefix_index.watch import RedisWatch
from shared.metrics.publisher import MetricsPublisher, new_instance_id
from shared.tracing import extract
from shared.wire import messages, subjects
from shared.wire.bus import Bus, Msg, PullConsumer
from shared.wire.bus_auth import redact_url
from shared.wire.kv_stream import ensure_kv_events_stream
from shared.wire.messages import PrefixMatchReply

log = logging.getLogger("llmserve.prefix_index")
SPAN_MATCH = "prefix_index.match"
_tracer = trace.get_tracer("llmserve.prefix_index")

# How often the executors with a live record are read from Redis, to start the silence clock of
# those this replica has not heard (a fraction of the timeout, so a purge is at most this late).
_LISTING_FRACTION = 0.25


class PrefixIndexService:
    def __init__(
        self, bus: Bus, store: PrefixStore, match_store: PrefixStore, config: PrefixIndexConfig
    ) -> None:
        self.bus = bus
        self.store = store  # applies, purges, snapshots: the longer timeout
        self.match_store = match_store  # matches and status: the short timeout
        self.config = config
        self.counters = Counters()
        self.watch = RedisWatch(store)
        self.tracker = ExecutorTracker(config.executor_timeout_s, config.executor_timeout_s)
        self.metrics = IndexMetrics(self.counters)
        self.applier = BatchApplier(
            bus, store, config, self.watch, self.counters, self.metrics.apply_lag
        )
        self._metrics_publisher = MetricsPublisher(
            bus, "prefix_index", new_instance_id(config.name), self.metrics.registry
        )
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._resyncs: dict[str, asyncio.Task[None]] = {}
        self._last_listing_s = -float("inf")
        self._consumer: PullConsumer | None = None

    async def start(self) -> None:
        await ensure_kv_events_stream(self.bus)
        consumer = await self.bus.pull_consumer(
            subjects.KV_EVENTS_STREAM,
            subjects.KV_EVENTS_ALL,
            self.config.consumer,
            ack_wait_s=self.config.ack_wait_s,
        )
        await self.bus.subscribe(
            subjects.PREFIX_INDEX_MATCH, self._on_match, queue=subjects.QUEUE_PREFIX_INDEX
        )
        await self.bus.subscribe(
            subjects.PREFIX_INDEX_STATUS, self._on_status, queue=subjects.QUEUE_PREFIX_INDEX
        )
        await self.bus.subscribe(subjects.EXECUTOR_STATS_ALL, self._on_heartbeat)
        await self.bus.flush()
        self._consumer = consumer
        self._tasks = [
            asyncio.create_task(self.applier.run(consumer, self._stopping)),
            asyncio.create_task(self._tick_loop()),
        ]
        self._metrics_publisher.start()

    async def stop(self) -> None:
        """Finish the batch in hand (or hand it back), then stop every task."""
        self._stopping.set()
        await self._metrics_publisher.stop()
        if self._tasks:
            await asyncio.gather(self._tasks[0], return_exceptions=True)  # the applier
        others = [*self._tasks[1:], *self._resyncs.values()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await self.watch.close()
        if self._consumer is not None:
            await self._consumer.unsubscribe()

    # -- request/reply -------------------------------------------------------------------------

    async def _on_match(self, msg: Msg) -> None:
        if not msg.reply:
            return
        ctx = extract(msg.headers)
        if ctx is None:
            await self._answer_match(msg)
            return
        # A traced lookup: a SERVER span, child of the scheduler's scheduler.index_lookup.
        span = _tracer.start_span(SPAN_MATCH, context=ctx, kind=SpanKind.SERVER)
        try:
            reply = await self._answer_match(msg)
            span.set_attribute("llmserve.prefix.num_executors_matched", len(reply.num_blocks))
            span.set_attribute(
                "llmserve.prefix.max_matched_blocks", max(reply.num_blocks.values(), default=0)
            )
            if reply.error is not None:
                span.set_status(Status(StatusCode.ERROR, reply.error))
        finally:
            span.end()

    async def _answer_match(self, msg: Msg) -> PrefixMatchReply:
        try:
            req = messages.PREFIX_MATCH_REQUEST.decode(msg.data)
        except msgspec.DecodeError as e:
            return await self._reply_match(msg, error=f"bad match request: {e}")
        if len(req.block_hashes) > self.config.max_match_blocks:
            return await self._reply_match(
                msg,
                error=f"{len(req.block_hashes)} block hashes exceed the limit of "
                f"{self.config.max_match_blocks}",
            )
        if not self.watch.ok:
            return await self._reply_match(msg, error="prefix index unavailable: redis is down")
        try:
            num_blocks = await self.match_store.match(req.model, req.block_hashes)
        except IndexStoreError as e:
            if isinstance(e, IndexUnavailable):
                self.watch.failed(e)
            return await self._reply_match(msg, error=f"prefix index unavailable: {e}")
        return await self._reply_match(msg, num_blocks=num_blocks)

    @staticmethod
    async def _reply_match(
        msg: Msg, num_blocks: dict[str, int] | None = None, error: str | None = None
    ) -> PrefixMatchReply:
        reply = PrefixMatchReply(num_blocks=num_blocks or {}, error=error)
        await msg.respond(messages.PREFIX_MATCH_REPLY.encode(reply))
        return reply

    async def _on_status(self, msg: Msg) -> None:
        if not msg.reply:
            return
        num_executors = num_entries = 0
        if self.watch.ok:
            try:
                num_executors, num_entries = await self.match_store.stats()
            except IndexStoreError as e:
                if isinstance(e, IndexUnavailable):
                    self.watch.failed(e)
        status = self.counters.status(self.watch.ok, num_executors, num_entries)
        await msg.respond(messages.PREFIX_INDEX_STATUS.encode(status))

    # -- liveness ------------------------------------------------------------------------------

    async def _on_heartbeat(self, msg: Msg) -> None:
        hb = messages.EXECUTOR_HEARTBEAT.decode(msg.data)
        if not self.tracker.on_heartbeat(hb.executor_id, hb.epoch, time.monotonic()):
            return
        if not self.watch.ok:
            self.tracker.check_failed(hb.executor_id)
            return
        try:
            result = await self.store.observe(hb.executor_id, hb.epoch, hb.model)
        except IndexStoreError as e:
            self.tracker.check_failed(hb.executor_id)
            if isinstance(e, IndexUnavailable):
                self.watch.failed(e)
            else:
                log.error("cannot check executor %s's record: %s", hb.executor_id, e)
            return
        if result == "restarted":
            self.counters.num_purges += 1
            log.info(
                "executor %s restarted (epoch %s): its old entries purged", hb.executor_id, hb.epoch
            )
        elif result == "dead":
            log.info("executor %s was purged as silent but beats: resyncing it", hb.executor_id)
            self._start_resync(hb.executor_id, hb.epoch)
        elif result == "unknown":
            # It beats but the index has no record: it is new, or Redis lost its data.
            self._start_resync(hb.executor_id, hb.epoch)

    def _start_resync(self, executor_id: str, epoch: str) -> None:
        """Take the executor's snapshot (one at a time per executor; without an answer the next
        check tries again)."""
        running = self._resyncs.get(executor_id)
        if running is not None and not running.done():
            return

        async def resync() -> None:
            try:
                await self.applier.resync(executor_id, epoch, purge_on_failure=False)
            except IndexStoreError as e:
                if isinstance(e, IndexUnavailable):
                    self.watch.failed(e)
                self.tracker.check_failed(executor_id)

        self._resyncs[executor_id] = asyncio.create_task(resync())

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_interval_s)
            if not self.watch.ok:
                continue
            try:
                await self._purge_silent(time.monotonic())
            except IndexUnavailable as e:
                self.watch.failed(e)
            except Exception:
                log.exception("prefix index liveness check failed")

    async def _purge_silent(self, now: float) -> None:
        if now - self._last_listing_s >= _LISTING_FRACTION * self.config.executor_timeout_s:
            self.tracker.on_indexed(await self.store.executors(), now)
            self._last_listing_s = now
        for executor_id, epoch in self.tracker.expired(now):
            result = await self.store.purge(executor_id, epoch)
            self.tracker.forget(executor_id)
            if result == "purged":
                self.counters.num_purges += 1
                log.info(
                    "executor %s silent for %.1fs: its entries are purged",
                    executor_id,
                    self.config.executor_timeout_s,
                )


async def _check_redis_access(store: PrefixStore, config: PrefixIndexConfig) -> None:
    """Fail at start, naming the server and the user, if Redis refuses our credentials; Redis being
    down is not an error here (the index serves without it and catches up)."""
    try:
        await store.ping()
    except IndexAccessDenied as e:
        raise IndexAccessDenied(
            f"Redis at {redact_url(config.redis_url)} refused {config.redis_auth.describe()}: "
            f"{e.__cause__ or e} (REDIS_USERNAME, REDIS_PASSWORD)"
        ) from None
    except IndexUnavailable as e:
        log.warning("redis at %s is not answering yet: %s", redact_url(config.redis_url), e)


@contextlib.asynccontextmanager
async def running(config: PrefixIndexConfig) -> AsyncIterator[PrefixIndexService]:
    """A started service with its own connections; on exit it stops, drains and closes them."""
    bus = await Bus.connect(config.nats_url, config.name, auth=config.bus_auth)
    store, match_store = (
        PrefixStore(
            connect_redis(config.redis_url, timeout_s, config.redis_auth),
            config.key_prefix,
            tombstone_ttl_s=config.tombstone_ttl_s,
        )
        for timeout_s in (config.redis_timeout_s, config.match_timeout_s)
    )
    service = PrefixIndexService(bus, store, match_store, config)
    try:
        await _check_redis_access(store, config)
        await service.start()
        yield service
    finally:
        await service.stop()
        await bus.drain()
        await bus.close()
        await store.close()
        await match_store.close()


async def serve(config: PrefixIndexConfig, stop: asyncio.Event) -> None:
    async with running(config):
        log.info(
            "prefix index ready (consumer %s, keys {%s}:*, executor timeout %.1fs)",
            config.consumer,
            config.key_prefix,
            config.executor_timeout_s,
        )
        await stop.wait()
