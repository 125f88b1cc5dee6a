"""The executor actor (role 'both'): ExecuteRequests in, token deltas out, heartbeats.

Admission: an ExecuteRequest is a NATS request; the reply (ExecuteReply) says whether it was taken,
with the executor's load after the decision. It is refused, not queued without bound, when it would
take the weight held (sequences of accepted, unfinished requests) past max_num_seqs + max_queued
(unless nothing is held), and while draining: the scheduler routes it elsewhere. Several scheduler
replicas may route here at once; this check is what keeps their sum within the cap.

Per accepted request, on the wire, in this order (one publisher task keeps it):
    RequestProgress 'started' → StreamOutput × k (the last one finished)
        → RequestProgress 'finished'
or, when it ends early: StreamError (400 rejected / 503 shutting down / 500 engine failure) or a
final StreamOutput with finish_reason 'abort', then RequestProgress 'finished'. 'finished' is always
sent, so the scheduler's in-flight count never leaks.

KV events: every step that changed the engine's cached blocks is published as one KVEventsMessage
on ``subjects.kv_events(executor_id)``, kept by the KV events JetStream stream for the prefix
index, unless the worker was built with ``kv_events=False``; either way the engine holds at most one
step's events. ``executor_kv_snapshot(id)`` answers with the whole cached set (KVCacheSnapshot) for
an index that missed a batch.

Bounded waits: a request it holds whose stream has carried nothing for KEEPALIVE_INTERVAL_S (not
started yet: waiting or prefilling; or preempted) gets a StreamKeepalive, sent with the heartbeats;
if this process dies they stop, and the gateway fails the request within its progress timeout (the
scheduler usually first, from the missing heartbeats). When the bus connection drops, every
request it holds is aborted and ends with an error (502 once started, else 503), sent when the bus
is back: outputs or aborts may have been lost meanwhile, and its gateway has given up on it.
Every ``client_check_interval_s`` it asks whether each request it holds still has a reader
(keepalive.clients_gone): one whose gateway died is aborted then, not computed to its end for
nobody.

Drain (SIGTERM): heartbeats say ``draining`` at once so the scheduler routes nothing new here;
requests that still arrive are refused; in-flight ones may finish for ``drain_timeout_s``, the rest
are aborted with a 503 error event; then the engine thread stops and the connection drains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from services.executor.handoff import HandoffConfig, KVHandoffs, ShellHooks
from services.executor.memory_status import with_rss
from services.executor.metrics import ExecutorMetrics
from services.executor.spans import ExecutorSpans
from services.executor.worker import (
    Abort,
    Aborted,
    Add,
    EngineWorker,
    Event,
    Failed,
    KVEvents,
    Outputs,
    Prefilled,
    Rejected,
    Reserved,
    Snapshot,
    SnapshotTaken,
    StepTraced,
)
from shared.field_checks import require_positive
from shared.metrics.publisher import MetricsPublisher
from shared.wire import messages, subjects
from shared.wire.bus import Bus, BusError, Msg
from shared.wire.keepalive import SilenceTracker, clients_gone, send_keepalives
from shared.wire.kv_events import (
    KV_CACHE_SNAPSHOT,
    KV_EVENTS_MESSAGE,
    KVCacheSnapshot,
    KVEventsMessage,
    new_epoch,
)
from shared.wire.kv_stream import ensure_kv_events_stream
from shared.wire.kv_transport import KVTransport, NatsKVTransport
from shared.wire.messages import (
    CompletionDelta,
    ExecuteReply,
    ExecutorLoad,
    ExecutorMemory,
    RequestOutput,
    StreamError,
    StreamOutput,
)

log = logging.getLogger("llmserve.executor")

# 'prefill': runs prompts and hands them to decode executors (a request the scheduler sends without
# a decode executor, or whose handoff fails, it decodes itself); 'decode': takes handoffs (and
# prefills locally what the scheduler sends it whole); 'both': the same as 'decode' for routing.
ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class ExecutorServiceConfig:
    executor_id: str
    model_name: str
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_queued: int | None = None  # accepted beyond max_num_seqs (None: as many as max_num_seqs)
    heartbeat_interval_s: float = 0.5
    drain_timeout_s: float = 5.0
    role: str = "both"
    client_check_interval_s: float = 5.0
    kv_transfer_timeout_s: float = 10.0  # a KV handoff, offer to last ack (handoff.py)
    kv_offer_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        subjects.executor_decode(self.executor_id)  # ValueError if it cannot be a subject token
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        HandoffConfig(self.executor_id, self.kv_transfer_timeout_s, self.kv_offer_timeout_s)
        if self.heartbeat_interval_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("heartbeat_interval_s must be > 0 and drain_timeout_s >= 0")
        require_positive(self, "client_check_interval_s")
        if self.max_num_seqs < 1 or (self.max_queued is not None and self.max_queued < 0):
            raise ValueError("max_num_seqs must be >= 1 and max_queued >= 0")

    @property
    def max_admitted(self) -> int:
        """The weight this executor accepts at most: its batch plus the queue it advertises."""
        queued = self.max_num_seqs if self.max_queued is None else self.max_queued
        return self.max_num_seqs + queued


@dataclass
class _Live:
    n: int
    num_prompt_tokens: int
    num_prefill_tokens: int  # counted in the pending prefill until it starts
    started: bool = False
    aborting: bool = False
    bus_lost: bool = False  # aborted because the bus connection dropped: ends with an error


@dataclass
class ExecutorService:
    bus: Bus
    worker: EngineWorker
    config: ExecutorServiceConfig
    epoch: str = field(default_factory=new_epoch)  # fresh per process start
    draining: bool = False
    memory: ExecutorMemory | None = None  # its ledger (memory_status.py), sent with each heartbeat
    transport: KVTransport | None = None  # KV pages between executors (None: over this bus)

    def __post_init__(self) -> None:
        self._live: dict[str, _Live] = {}
        self._admitted_weight = 0  # sum of n over _live
        self._pending_prefill_tokens = 0  # sum of num_prefill_tokens over _live not started
        self._load_version = 0  # +1 at every accept, start and release
        self._peak_admitted_weight = 0
        self._num_refused = 0
        self._events: asyncio.Queue[list[Event]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._idle = asyncio.Event()
        self._idle.set()
        self._silence = SilenceTracker()  # when each live request's stream last carried something
        self.metrics = ExecutorMetrics(
            self.config.executor_id, self.config.model_name, lambda: self.worker.latest_stats
        )
        self.worker.observer = self.metrics  # before the engine thread starts
        self._metrics_publisher = MetricsPublisher(
            self.bus, "executor", self.config.executor_id, self.metrics.registry
        )
        self._spans = ExecutorSpans(self.config.executor_id)  # traced requests only
        if self.transport is None:
            self.transport = NatsKVTransport(self.bus)
        self.handoffs = KVHandoffs(
            HandoffConfig(
                self.config.executor_id,
                self.config.kv_transfer_timeout_s,
                self.config.kv_offer_timeout_s,
            ),
            self.worker,
            self.transport,
            ShellHooks(
                adopt=self._adopt,
                release=self._handoff_release,
                progress=self._progress,
                draining=lambda: self.draining,
            ),
            self.worker.page_layout(),
            on_transfer=self.metrics.on_kv_transfer,
        )

    async def start(self) -> None:
        self.bus.on_connection_lost(self._on_bus_lost)
        loop = asyncio.get_running_loop()
        # The engine thread hands events over without ever blocking on the loop.
        self.worker.start(lambda events: loop.call_soon_threadsafe(self._events.put_nowait, events))
        await self.bus.subscribe(
            subjects.executor_decode(self.config.executor_id), self._on_execute
        )
        await self.bus.subscribe(subjects.ABORT, self._on_abort)
        if self.config.role != "prefill":
            assert self.transport is not None
            await self.transport.serve(self.config.executor_id, self.handoffs)
        if self.worker.kv_events:
            await ensure_kv_events_stream(self.bus)
            await self.bus.subscribe(
                subjects.executor_kv_snapshot(self.config.executor_id), self._on_snapshot
            )
        await self.bus.flush()
        self._tasks = [
            asyncio.create_task(self._publish_loop()),
            asyncio.create_task(self._heartbeat_loop()),
            asyncio.create_task(self._client_check_loop()),
        ]
        await self._heartbeat()
        self._metrics_publisher.start()

    # -- inputs ----------------------------------------------------------------------------------

    async def _on_execute(self, msg: Msg) -> None:
        req = messages.EXECUTE_REQUEST.decode(msg.data)
        rid = req.request_id
        weight = max(1, req.params.n)
        if rid in self._live:
            log.warning("ignoring a duplicate ExecuteRequest for %s", rid)
            accepted = True  # it is being served: a redelivery must not be routed again
        elif self.draining or (
            self._admitted_weight > 0 and self._admitted_weight + weight > self.config.max_admitted
        ):
            accepted = False
            self._num_refused += 1
        else:
            accepted = True
            num_prompt_tokens = len(req.prompt_token_ids)
            # The last prompt token is always computed, cached prefix or not.
            num_prefill = max(1, num_prompt_tokens - req.num_expected_cached_tokens)
            self._live[rid] = _Live(weight, num_prompt_tokens, num_prefill)
            self._admitted_weight += weight
            self._pending_prefill_tokens += num_prefill
            self._load_version += 1
            self._peak_admitted_weight = max(self._peak_admitted_weight, self._admitted_weight)
            self._idle.clear()
            self._silence.touch(rid, time.monotonic())
            self._spans.accepted(req, msg.headers)
            self.worker.submit(Add(req))
        if msg.reply:
            reply = ExecuteReply(
                executor_id=self.config.executor_id,
                epoch=self.epoch,
                accepted=accepted,
                load=self.load,
            )
            await msg.respond(messages.EXECUTE_REPLY.encode(reply))
        elif not accepted:  # a bare publish has nobody to hear the refusal: end the request
            await self._end_with_error(
                rid, 503, f"executor {self.config.executor_id} cannot take the request; retry it"
            )

    @property
    def load(self) -> ExecutorLoad:
        return ExecutorLoad(
            version=self._load_version,
            num_admitted=self._admitted_weight,
            max_admitted=self.config.max_admitted,
            num_pending_prefill_tokens=self._pending_prefill_tokens,
            peak_num_admitted=self._peak_admitted_weight,
            num_refused=self._num_refused,
        )

    def _release(self, rid: str) -> _Live | None:
        """Forget a request that ended (its 'finished' progress follows)."""
        live = self._live.pop(rid, None)
        self._silence.forget(rid)
        if live is not None:
            self._admitted_weight -= live.n
            if not live.started:
                self._pending_prefill_tokens -= live.num_prefill_tokens
            self._load_version += 1
        return live

    def _handoff_release(self, rid: str) -> None:
        """A handoff let a request go (sent, or a reservation dropped): no engine event follows,
        so the publish loop would not see the executor go idle; a drain waits on that."""
        self._release(rid)
        if not self._live:
            self._idle.set()

    def _adopt(self, rid: str, num_prompt_tokens: int) -> bool:
        """A request prefilled elsewhere is offered here: held (started: its first token is out)
        unless it is already here or the executor is full."""
        if rid in self._live or (
            self._admitted_weight > 0 and self._admitted_weight + 1 > self.config.max_admitted
        ):
            return False
        self._live[rid] = _Live(1, num_prompt_tokens, 0, started=True)
        self._admitted_weight += 1
        self._load_version += 1
        self._peak_admitted_weight = max(self._peak_admitted_weight, self._admitted_weight)
        self._idle.clear()
        self._silence.touch(rid, time.monotonic())
        return True

    def _start(self, live: _Live) -> None:
        """Its first token is out: its prefill is no longer work ahead of anyone."""
        live.started = True
        self._pending_prefill_tokens -= live.num_prefill_tokens
        self._load_version += 1

    async def _on_snapshot(self, msg: Msg) -> None:
        if msg.reply:
            self.worker.submit(Snapshot(msg.reply))

    async def _on_abort(self, msg: Msg) -> None:
        self._abort(messages.ABORT_REQUEST.decode(msg.data).request_id)

    def _abort(self, rid: str) -> None:
        live = self._live.get(rid)
        if live is not None and not live.aborting:
            live.aborting = True
            self.handoffs.abort(rid)
            self.worker.submit(Abort(rid))

    def _on_bus_lost(self) -> None:
        lost = [rid for rid, live in self._live.items() if not live.aborting]
        for rid in lost:
            live = self._live[rid]
            live.aborting = live.bus_lost = True
            self.worker.submit(Abort(rid))
        if lost:
            log.warning("lost the message bus: aborting the %d request(s) held here", len(lost))

    # -- engine events → the wire (one task: per-request order is kept) -------------------------

    async def _publish_loop(self) -> None:
        while True:
            events = await self._events.get()
            for event in events:
                try:
                    await self._publish_event(event)
                except BusError:
                    log.exception("cannot publish an engine event")
            if not self._live:
                self._idle.set()

    async def _publish_event(self, event: Event) -> None:
        if isinstance(event, Outputs):
            for out in event.outputs:
                live = self._live.get(out.request_id)
                if live is None:
                    continue  # already ended (drain abort)
                if not live.started:
                    self._start(live)
                    await self._progress(out.request_id, "started")
                await self.bus.publish(
                    subjects.stream(out.request_id),
                    messages.STREAM_MESSAGE.encode(
                        StreamOutput(executor_id=self.config.executor_id, output=out)
                    ),
                )
                self._silence.touch(out.request_id, time.monotonic())
                self._spans.on_output(out)
                if out.finished:
                    self._release(out.request_id)
                    await self._progress(out.request_id, "finished")
        elif isinstance(event, Rejected):
            if self._release(event.request_id) is not None:
                await self._end_with_error(
                    event.request_id, 400, event.message, "invalid_request_error"
                )
        elif isinstance(event, Aborted):
            live = self._release(event.request_id)
            if live is not None and live.bus_lost:
                await self._end_with_error(
                    event.request_id,
                    502 if live.started else 503,
                    f"executor {self.config.executor_id} lost its connection to the message bus; "
                    + ("the output is incomplete" if live.started else "retry the request"),
                )
            elif live is not None:
                self._spans.end(event.request_id, finish_reason="abort")
                final = RequestOutput(
                    request_id=event.request_id,
                    num_prompt_tokens=live.num_prompt_tokens,
                    num_cached_tokens=0,
                    finished=True,
                    deltas=[
                        CompletionDelta(index=i, token_ids=[], text="", finish_reason="abort")
                        for i in range(live.n)
                    ],
                )
                await self.bus.publish(
                    subjects.stream(event.request_id),
                    messages.STREAM_MESSAGE.encode(
                        StreamOutput(executor_id=self.config.executor_id, output=final)
                    ),
                )
                await self._progress(event.request_id, "finished")
        elif isinstance(event, Failed):
            for rid in event.request_ids:
                if self._release(rid) is not None:
                    await self._end_with_error(rid, 500, event.message)
        elif isinstance(event, KVEvents):
            message = KVEventsMessage(
                executor_id=self.config.executor_id,
                epoch=self.epoch,
                model=self.config.model_name,
                batch=event.batch,
            )
            await self.bus.publish(
                subjects.kv_events(self.config.executor_id), KV_EVENTS_MESSAGE.encode(message)
            )
        elif isinstance(event, StepTraced):
            self._spans.on_step(event.record)
        elif isinstance(event, Prefilled):
            if event.request_id in self._live:
                self.handoffs.send(event)
            else:  # ended meanwhile (drain)
                self.worker.submit(Abort(event.request_id))
        elif isinstance(event, Reserved):
            self.handoffs.on_reserved(event)
        elif isinstance(event, SnapshotTaken):
            snapshot = KVCacheSnapshot(
                executor_id=self.config.executor_id,
                epoch=self.epoch,
                model=self.config.model_name,
                seq=event.seq,
                block_hashes=event.block_hashes,
            )
            await self.bus.publish(event.reply_to, KV_CACHE_SNAPSHOT.encode(snapshot))

    async def _end_with_error(
        self, rid: str, status: int, message: str, type_: str = "server_error"
    ) -> None:
        self._spans.end(rid, f"{status}: {message}")
        await self.bus.publish(
            subjects.stream(rid),
            messages.STREAM_MESSAGE.encode(
                StreamError(request_id=rid, status=status, message=message, type=type_)
            ),
        )
        await self._progress(rid, "finished")

    async def _progress(self, rid: str, state: str, handed_to: str | None = None) -> None:
        await self.bus.publish(
            subjects.SCHEDULER_PROGRESS,
            messages.REQUEST_PROGRESS.encode(
                messages.RequestProgress(
                    request_id=rid,
                    executor_id=self.config.executor_id,
                    state=state,
                    load=self.load,
                    handed_to=handed_to,
                )
            ),
        )

    # -- heartbeats --------------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        c = self.config
        hb = messages.ExecutorHeartbeat(
            executor_id=c.executor_id,
            epoch=self.epoch,
            role=c.role,
            model=c.model_name,
            max_model_len=c.max_model_len,
            block_size=c.block_size,
            stats=self.worker.latest_stats,
            sent_at=time.time(),
            max_num_seqs=c.max_num_seqs,
            draining=self.draining,
            load=self.load,
            memory=with_rss(self.memory) if self.memory is not None else None,
        )
        await self.bus.publish(
            subjects.executor_stats(c.executor_id), messages.EXECUTOR_HEARTBEAT.encode(hb)
        )

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            if not self.worker.alive:
                # A dead engine thread must not look alive: stop heartbeating, the scheduler fails
                # over. (During a drain the thread was stopped on purpose.)
                if not self.draining:
                    log.error("the engine thread died; no more heartbeats")
                return
            try:
                await self._heartbeat()
                await self._keepalives()
            except BusError as e:
                log.warning("heartbeat failed: %s", e)

    async def _keepalives(self) -> None:
        """A keepalive on the stream of each live request silent for an interval."""
        due = self._silence.due(time.monotonic())
        await send_keepalives(
            self.bus,
            self.config.executor_id,
            (
                (rid, "running" if self._live[rid].started else "waiting")
                for rid in due
                if rid in self._live
            ),
        )

    async def _client_check_loop(self) -> None:
        interval_s = self.config.client_check_interval_s
        while True:
            await asyncio.sleep(interval_s)
            held = [
                (rid, "running" if live.started else "waiting")
                for rid, live in self._live.items()
                if not live.aborting
            ]
            if not held:
                continue
            try:
                # Each probe waits at most a fifth of the interval, so checks never pile up.
                gone = await clients_gone(self.bus, self.config.executor_id, held, interval_s / 5)
            except BusError as e:
                log.warning("client check failed: %s", e)
                continue
            for rid in gone:
                self._abort(rid)
            if gone:
                log.info("aborted %d request(s) nobody reads any more: %s", len(gone), gone)

    # -- drain -------------------------------------------------------------------------------------

    async def drain(self) -> None:
        self.draining = True
        await self._heartbeat()
        try:
            await asyncio.wait_for(self._idle.wait(), self.config.drain_timeout_s)
        except TimeoutError:
            for rid in list(self._live):
                self._release(rid)
                self.handoffs.abort(rid)  # a transfer in flight: cancelled, the peer told
                self.worker.submit(Abort(rid))
                await self._end_with_error(
                    rid,
                    503,
                    f"executor {self.config.executor_id} shut down before the request finished",
                )
        await asyncio.to_thread(self.worker.stop, 10.0)
        # Events still queued (outputs of aborted requests) are dropped: their requests have ended.
        await self._metrics_publisher.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
