"""The scheduler actor: feeds NATS messages into the pure ``Router`` and carries out its actions.

Subscriptions: SCHEDULER_SUBMIT (queue group: each request is routed by one scheduler),
EXECUTOR_STATS_ALL, SCHEDULER_PROGRESS and ABORT (fan-out: every scheduler instance keeps its own
executor table and tracks the requests it routed), SCHEDULER_STATUS (queue group, request/reply).
A ticker declares silent executors dead and expires queued requests.

Before routing a request with a choice to make (two or more executors of its model, cache-aware
routing, full blocks in the prompt), the prefix index is asked which executor holds how much of it
(PREFIX_INDEX_MATCH, one round trip with a short timeout). If it does not answer, the request is
routed by load alone, the outage is logged once and counted, and the index is asked again after
``index_retry_s``: routing recovers by itself. A dispatch is a request/reply to the executor, whose
answer (accepted or full) goes back to the router.

Tracing (spans.py): a submit that carries a trace context gets a queue span, an index-lookup span
whose context the match request carries, and a route span per dispatch whose context the
ExecuteRequest carries on to the executor.

Bounded waits: every request waiting in the queue gets a StreamKeepalive on its stream every
KEEPALIVE_INTERVAL_S (from the ticker), so if this process dies the gateway fails those requests
within its progress timeout. When the bus connection drops, the router forgets every request
(``Router.forget_requests``): queued ones end with a 503 (sent once the bus is back), routed ones
are left to their executors.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time

import msgspec
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CollectorRegistry, Counter

from services.scheduler.config import SchedulerConfig
from services.scheduler.router import Action, Dispatch, Fail, Router
from services.scheduler.spans import SchedulerSpans
from shared.metrics.common import round_trip_histogram
from shared.metrics.publisher import MetricsPublisher, new_instance_id
from shared.tracing import headers_for
from shared.wire import messages, subjects
from shared.wire.bus import Bus, BusError, BusNoResponders, BusTimeout, Msg
from shared.wire.keepalive import KEEPALIVE_INTERVAL_S, send_keepalives
from shared.wire.messages import PrefixMatchRequest, TokenizedRequest

log = logging.getLogger("llmserve.scheduler")


class SchedulerService:
    def __init__(self, bus: Bus, config: SchedulerConfig) -> None:
        self.bus = bus
        self.config = config
        self.router = Router(config.router, time.monotonic())
        self._ticker: asyncio.Task[None] | None = None
        self._index_down_since: float | None = None  # monotonic time of the failed lookup
        self.num_index_fallbacks = 0
        self._lookup_ms: collections.deque[float] = collections.deque(maxlen=1000)
        self._last_keepalive = time.monotonic()
        self._background: set[asyncio.Task[None]] = set()
        # Its MetricsReport: the round trips of the index lookups and dispatches it makes.
        self.registry = CollectorRegistry()
        self._round_trip = round_trip_histogram(self.registry)
        self._disagg_decisions = Counter(
            "llmserve:disaggregation_decisions",
            "Where a request's prompt was prefilled when prefill executors exist "
            "(services/scheduler/disagg.py): disaggregated, or locally and why.",
            ["decision"],
            registry=self.registry,
        )
        self._metrics = MetricsPublisher(
            bus, "scheduler", new_instance_id(config.name), self.registry
        )
        self._spans = SchedulerSpans(config.router.routing)  # traced requests until dispatched

    async def start(self) -> None:
        self.bus.on_connection_lost(self._on_bus_lost)
        await self.bus.subscribe(
            subjects.SCHEDULER_SUBMIT, self._on_submit, queue=subjects.QUEUE_SCHEDULER
        )
        await self.bus.subscribe(subjects.EXECUTOR_STATS_ALL, self._on_heartbeat)
        await self.bus.subscribe(subjects.SCHEDULER_PROGRESS, self._on_progress)
        await self.bus.subscribe(subjects.ABORT, self._on_abort)
        await self.bus.subscribe(
            subjects.SCHEDULER_STATUS, self._on_status, queue=subjects.QUEUE_SCHEDULER
        )
        await self.bus.flush()
        self._ticker = asyncio.create_task(self._tick_loop())
        self._metrics.start()

    async def stop(self) -> None:
        await self._metrics.stop()
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)

    def _on_bus_lost(self) -> None:
        actions = self.router.forget_requests(time.monotonic())
        log.warning(
            "lost the message bus: %d queued request(s) end with 503, routed ones are forgotten",
            len(actions),
        )
        # Published once the bus is back (nats-py buffers them meanwhile).
        task = asyncio.create_task(self._apply(actions))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- handlers (each small; the router holds the logic) --------------------------------------

    async def _on_submit(self, msg: Msg) -> None:
        req = messages.TOKENIZED_REQUEST.decode(msg.data)
        ctx = self._spans.submitted(req.request_id, msg.headers)
        cached_blocks = await self._match(req, ctx)
        self._spans.matched(req.request_id, cached_blocks)
        actions = self.router.submit(req, time.monotonic(), time.time(), cached_blocks)
        await self._apply(actions)
        if msg.reply:  # the tokenizer waits for this ack: "a scheduler has routed it"
            await msg.respond(b"")

    async def _on_heartbeat(self, msg: Msg) -> None:
        hb = messages.EXECUTOR_HEARTBEAT.decode(msg.data)
        await self._apply(self.router.on_heartbeat(hb, time.monotonic()))

    async def _on_progress(self, msg: Msg) -> None:
        progress = messages.REQUEST_PROGRESS.decode(msg.data)
        await self._apply(self.router.on_progress(progress, time.monotonic()))

    async def _on_abort(self, msg: Msg) -> None:
        abort = messages.ABORT_REQUEST.decode(msg.data)
        self._spans.forget(abort.request_id)
        await self._apply(self.router.abort(abort.request_id, time.monotonic()))

    async def _on_status(self, msg: Msg) -> None:
        if msg.reply:
            status = msgspec.structs.replace(
                self.router.status(time.monotonic()),
                index_available=self._index_down_since is None,
                num_index_fallbacks=self.num_index_fallbacks,
                index_lookup_ms_p50=statistics.median(self._lookup_ms) if self._lookup_ms else 0.0,
            )
            await msg.respond(messages.SCHEDULER_STATUS.encode(status))

    # -- the prefix index ------------------------------------------------------------------------

    async def _match(self, req: TokenizedRequest, ctx: Context | None) -> dict[str, int] | None:
        """The index's answer for the prompt, or None: nothing to choose, or no answer. ``ctx``:
        the request's trace context (None: untraced)."""
        now = time.monotonic()
        if (
            self.config.router.routing != "cache"
            or not req.block_hashes
            or self.router.num_candidates(req.model, now) < 2
        ):
            return None
        down_since = self._index_down_since
        if down_since is not None and now - down_since < self.config.index_retry_s:
            self.num_index_fallbacks += 1
            return None
        query = PrefixMatchRequest(model=req.model, block_hashes=req.block_hashes)
        span = self._spans.index_lookup(ctx, req.model, len(req.block_hashes))
        started = time.perf_counter()
        try:
            data = await self.bus.request(
                subjects.PREFIX_INDEX_MATCH,
                messages.PREFIX_MATCH_REQUEST.encode(query),
                timeout=self.config.index_timeout_s,
                headers=headers_for(span),
            )
            reply = messages.PREFIX_MATCH_REPLY.decode(data)
            error = reply.error
        except BusError as e:
            error = str(e)
        if span is not None:
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, error))
            else:
                span.set_attribute("llmserve.prefix.num_executors_matched", len(reply.num_blocks))
            span.end()
        if error is not None:
            if down_since is None:
                log.warning("prefix index unavailable (%s); routing by load alone", error)
            self._index_down_since = time.monotonic()
            self.num_index_fallbacks += 1
            return None
        elapsed = time.perf_counter() - started
        self._lookup_ms.append(elapsed * 1e3)
        self._round_trip.labels("prefix_index.match").observe(elapsed)
        if down_since is not None:
            log.info("prefix index available again; routing by cache and load")
            self._index_down_since = None
        return reply.num_blocks

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_interval_s)
            try:
                await self._apply(self.router.tick(time.monotonic(), time.time()))
                await self._keepalives()
            except Exception:
                log.exception("scheduler tick failed")

    async def _keepalives(self) -> None:
        """Every interval, a keepalive on the stream of every queued request (a request queued
        since the last round waits at most one interval for its first)."""
        now = time.monotonic()
        if now - self._last_keepalive < KEEPALIVE_INTERVAL_S:
            return
        self._last_keepalive = now
        queued = self.router.queued_request_ids()
        try:
            await send_keepalives(self.bus, self.config.name, ((rid, "queued") for rid in queued))
        except BusError as e:
            log.debug("keepalives not sent: %s", e)

    async def _apply(self, actions: list[Action]) -> None:
        dispatches = [a for a in actions if isinstance(a, Dispatch)]
        if dispatches:
            # Concurrently: each waits for its executor's reply, and what the replies lead to
            # (a refusal re-routes) is applied in turn.
            await asyncio.gather(*(self._dispatch(d) for d in dispatches))
        for action in actions:
            try:
                if isinstance(action, Fail):
                    error = action.error
                    self._spans.failed(error.request_id, error.status, error.message)
                    log.info(
                        "request %s failed: %d %s",
                        action.error.request_id,
                        action.error.status,
                        action.error.message,
                    )
                    await self.bus.publish(
                        subjects.stream(action.error.request_id),
                        messages.STREAM_MESSAGE.encode(action.error),
                    )
            except BusError:
                log.exception("cannot publish a scheduler action")

    async def _dispatch(self, action: Dispatch) -> None:
        rid, executor_id = action.request.request_id, action.executor_id
        if action.decision:
            self._disagg_decisions.labels(action.decision).inc()
        sent = time.perf_counter()
        try:
            data = await self.bus.request(
                subjects.executor_decode(executor_id),
                messages.EXECUTE_REQUEST.encode(action.request),
                timeout=self.config.dispatch_timeout_s,
                headers=self._spans.route(action),
            )
        except BusNoResponders:
            log.warning("executor %s is unreachable; routing %s again", executor_id, rid)
            self._spans.answered(rid, executor_id, "unreachable")
            await self._apply(
                self.router.on_dispatch_unreachable(rid, executor_id, time.monotonic())
            )
            return
        except BusTimeout:
            # It may have taken it: it stays in flight there; if the executor is gone, its
            # heartbeats stop and the request is routed again.
            log.warning("executor %s did not answer the dispatch of %s in time", executor_id, rid)
            self._spans.answered(rid, executor_id, "no answer")
            return
        except BusError:
            log.exception("cannot dispatch %s to %s", rid, executor_id)
            self._spans.answered(rid, executor_id, "no answer")
            return
        self._round_trip.labels("executor.decode").observe(time.perf_counter() - sent)
        reply = messages.EXECUTE_REPLY.decode(data)
        self._spans.answered(rid, executor_id, "accepted" if reply.accepted else "refused")
        await self._apply(self.router.on_dispatch_reply(rid, reply, time.monotonic()))


async def serve(config: SchedulerConfig, stop: asyncio.Event) -> None:
    bus = await Bus.connect(config.nats_url, config.name, auth=config.bus_auth)
    service = SchedulerService(bus, config)
    await service.start()
    log.info(
        "scheduler ready (max_queue_len=%d, heartbeat_timeout=%.1fs)",
        config.router.max_queue_len,
        config.router.heartbeat_timeout_s,
    )
    await stop.wait()
    await service.stop()
    await bus.drain()
