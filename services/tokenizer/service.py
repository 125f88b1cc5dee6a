"""The tokenizer actor: GenerateRequest (queue group) → TokenizedRequest to the scheduler, or a 4xx
StreamError straight to the request's stream. It serves every model of its stack, each with its own
tokenizer, chat template and limits, chosen by the request's ``model`` (one it does not serve: 404
on the stream). A traced request (its message carries a W3C ``traceparent``) gets a
``tokenizer.tokenize`` span (from its receipt: queue wait included), child of the gateway's span
and parent of the scheduler's: its context goes on in the submit's headers. It also answers
TOKENIZER_STATUS, which the gateway's /health asks: every model it serves, with its limits.

Both hand-offs are acknowledged: the tokenizer acks the gateway's request on receipt, and the
scheduler acks each submit. So a request meets a missing service at once (NATS's "no responders"),
as a 503 on its stream, instead of waiting out its timeout. Each submit waits for its ack in a task
of its own, so the next request is taken and tokenized meanwhile instead of waiting for every
earlier one's ack round trip; ``stop`` waits for those tasks before the connection may close.

Held requests: the subscription's handler only decodes, acks and queues a request (so the ack is
immediate however long the queue), and one worker task tokenizes the queue in order. From the ack
until the scheduler acks its submit (or it ends with an error) a request is *held*: its stream gets
a StreamKeepalive every interval (shared/wire/keepalive.py), so if this process dies the gateway
fails it within its progress timeout. When the bus connection drops, requests still queued here are
ended with a 503 instead of being submitted after the reconnect: their gateway may have given up.

Tokenizing runs in one worker thread, off the event loop (the encoder releases the GIL), so the
loop keeps acking, answering status, sending keepalives and failing requests while a long prompt is
encoded; requests are tokenized one at a time per process, each bounded in time by the prompt's
character cap (prompts.check_prompt_size)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import msgspec
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry

from services.tokenizer.config import TokenizerConfig
from services.tokenizer.prompts import ModelTokenizer, PromptError, select_model, tokenize_request
from shared.engine.tokenizer import Tokenizer
from shared.metrics.common import round_trip_histogram
from shared.metrics.publisher import MetricsPublisher, new_instance_id
from shared.tracing import extract, headers_for
from shared.wire import messages, subjects
from shared.wire.bus import Bus, BusError, BusNoResponders, BusTimeout, Msg
from shared.wire.keepalive import SilenceTracker, send_keepalives

log = logging.getLogger("llmserve.tokenizer")
SPAN_TOKENIZE = "tokenizer.tokenize"
_tracer = trace.get_tracer("llmserve.tokenizer")

# A scheduler acks a submit as soon as it has routed it; a live one takes well under a millisecond.
SUBMIT_ACK_TIMEOUT_S = 5.0


class TokenizerService:
    def __init__(
        self, bus: Bus, models: Mapping[str, ModelTokenizer], name: str = "tokenizer"
    ) -> None:
        if not models:
            raise ValueError("a tokenizer serves at least one model")
        self.bus = bus
        self.name = name
        self.models = dict(models)  # served name → its tokenizer and limits
        self._subscriptions: list = []
        self._submits: set[asyncio.Task] = set()  # submits waiting for the scheduler's ack
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        # Acked, not yet tokenized: (request, trace headers, the connection generation it came in,
        # when it came in: time.time_ns())
        self._inbox: asyncio.Queue[
            tuple[messages.GenerateRequest, dict[str, str] | None, int, int]
        ] = asyncio.Queue()
        self._held = SilenceTracker()  # every request from its ack to its submit's end
        self._states: dict[str, str] = {}  # held request → "queued" | "tokenizing" | "submitting"
        self._generation = 0  # +1 each time the bus connection drops
        self._tasks: list[asyncio.Task[None]] = []
        # Its MetricsReport: the submit round trip (the scheduler acks once it has routed).
        self.registry = CollectorRegistry()
        self._round_trip = round_trip_histogram(self.registry)
        self._metrics = MetricsPublisher(bus, "tokenizer", new_instance_id(name), self.registry)

    async def start(self) -> None:
        self.bus.on_connection_lost(self._on_bus_lost)
        self._subscriptions = [
            await self.bus.subscribe(
                subjects.TOKENIZER_GENERATE, self._on_generate, queue=subjects.QUEUE_TOKENIZER
            ),
            await self.bus.subscribe(
                subjects.TOKENIZER_STATUS, self._on_status, queue=subjects.QUEUE_TOKENIZER
            ),
        ]
        await self.bus.flush()
        self._tasks = [
            asyncio.create_task(self._work_loop()),
            asyncio.create_task(self._keepalive_loop()),
        ]
        self._metrics.start()

    async def stop(self) -> None:
        """Stop taking requests, tokenize those already taken, and wait until every submit in
        flight is acknowledged or has ended its request with an error. The connection stays open."""
        subscriptions, self._subscriptions = self._subscriptions, []
        for sub in subscriptions:
            await sub.drain()
        await self._inbox.join()
        while self._submits:
            await asyncio.wait(set(self._submits))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._metrics.stop()
        self._encoder.shutdown(wait=False)

    @property
    def num_held(self) -> int:
        return len(self._held)

    async def _on_status(self, msg: Msg) -> None:
        status = messages.TokenizerStatus(
            models=[
                messages.TokenizerModelStatus(
                    name=name, max_model_len=m.limits.max_model_len, block_size=m.limits.block_size
                )
                for name, m in self.models.items()
            ]
        )
        await msg.respond(messages.TOKENIZER_STATUS.encode(status))

    async def _on_generate(self, msg: Msg) -> None:
        try:
            req = messages.GENERATE_REQUEST.decode(msg.data)
        except msgspec.DecodeError as e:  # no request id to answer to: only a log line is possible
            log.error("dropping a malformed GenerateRequest: %s", e)
            return
        if msg.reply:  # the gateway waits for this ack: "a tokenizer has the request"
            await msg.respond(b"")
        self._hold(req.request_id, "queued")
        self._inbox.put_nowait((req, msg.headers, self._generation, time.time_ns()))

    # -- held requests ---------------------------------------------------------------------------

    def _hold(self, request_id: str, state: str) -> None:
        if request_id not in self._held:
            self._held.touch(request_id, time.monotonic())
        self._states[request_id] = state

    def _release(self, request_id: str) -> None:
        self._held.forget(request_id)
        self._states.pop(request_id, None)

    def _on_bus_lost(self) -> None:
        # What is queued here came in before the drop; whoever waits for it may have given up.
        self._generation += 1

    async def _keepalive_loop(self) -> None:
        while True:
            await asyncio.sleep(self._held.interval_s / 4)
            due = self._held.due(time.monotonic())
            try:
                await send_keepalives(
                    self.bus, self.name, ((rid, self._states.get(rid, "")) for rid in due)
                )
            except BusError as e:
                log.debug("keepalives not sent: %s", e)

    # -- the work ----------------------------------------------------------------------------------

    async def _work_loop(self) -> None:
        while True:
            req, headers, generation, received_ns = await self._inbox.get()
            try:
                await self._tokenize_and_submit(req, headers, generation, received_ns)
            except Exception:  # never the end of the loop: the request ends, the next is taken
                log.exception("handling %s failed", req.request_id)
                self._release(req.request_id)
            finally:
                self._inbox.task_done()

    async def _tokenize_and_submit(
        self,
        req: messages.GenerateRequest,
        headers: dict[str, str] | None,
        generation: int,
        received_ns: int,
    ) -> None:
        rid = req.request_id
        if generation != self._generation:
            return await self._drop_lost(rid)
        self._hold(rid, "tokenizing")
        span = _start_span(req, headers, received_ns)
        try:
            model = select_model(self.models, req.model)
            tokenized = await asyncio.get_running_loop().run_in_executor(
                self._encoder, tokenize_request, req, model.tokenizer, model.limits
            )
        except PromptError as e:
            _end_span(span, f"{e.status}: {e}")
            self._release(rid)
            await self._fail(e.to_stream_error(rid))
            return
        except Exception as e:  # a tokenizer bug must still end the request, not leave it hanging
            log.exception("tokenizing %s failed", rid)
            _end_span(span, f"tokenizer failed: {e}")
            self._release(rid)
            await self._fail(
                messages.StreamError(request_id=rid, status=500, message=f"tokenizer failed: {e}")
            )
            return
        if span is not None:
            span.set_attribute("gen_ai.usage.input_tokens", len(tokenized.prompt_token_ids))
            span.set_attribute("llmserve.prompt.num_blocks", len(tokenized.block_hashes))
            _end_span(span)
            headers = headers_for(span, headers)
        if generation != self._generation:
            return await self._drop_lost(rid)
        self._hold(rid, "submitting")
        task = asyncio.create_task(self._submit(tokenized, headers))
        self._submits.add(task)
        task.add_done_callback(self._submits.discard)

    async def _drop_lost(self, request_id: str) -> None:
        self._release(request_id)
        with contextlib.suppress(BusError):
            await self._fail(
                messages.StreamError(
                    request_id=request_id,
                    status=503,
                    message="The tokenizer lost its connection to the message bus while it held "
                    "the request; retry it.",
                    retry_after_s=2.0,
                )
            )

    async def _submit(
        self, tokenized: messages.TokenizedRequest, headers: dict[str, str] | None
    ) -> None:
        try:
            await self._submit_once(tokenized, headers)
        except BusError as e:  # an error could not be published either: the connection is gone
            log.error("ending %s failed: %s", tokenized.request_id, e)
        finally:
            self._release(tokenized.request_id)

    async def _submit_once(
        self, tokenized: messages.TokenizedRequest, headers: dict[str, str] | None
    ) -> None:
        sent = time.perf_counter()
        try:
            await self.bus.request(
                subjects.SCHEDULER_SUBMIT,
                messages.TOKENIZED_REQUEST.encode(tokenized),
                timeout=SUBMIT_ACK_TIMEOUT_S,
                headers=headers,
            )
            self._round_trip.labels("scheduler.submit").observe(time.perf_counter() - sent)
        except BusNoResponders:
            await self._fail(
                messages.StreamError(
                    request_id=tokenized.request_id, status=503, message="No scheduler is running."
                )
            )
        except BusTimeout:
            # A stuck scheduler may still route it later: the abort frees it wherever it lands.
            log.error(
                "the scheduler did not acknowledge %s within %.0f s",
                tokenized.request_id,
                SUBMIT_ACK_TIMEOUT_S,
            )
            await self.bus.publish(
                subjects.ABORT,
                messages.ABORT_REQUEST.encode(
                    messages.AbortRequest(
                        request_id=tokenized.request_id,
                        reason="the scheduler did not acknowledge it",
                    )
                ),
            )
            await self._fail(
                messages.StreamError(
                    request_id=tokenized.request_id,
                    status=503,
                    message="The scheduler did not acknowledge the request within "
                    f"{SUBMIT_ACK_TIMEOUT_S:.0f} s.",
                )
            )
        except BusError as e:
            # The connection is going away: nothing can reach the request's stream.
            log.error("submitting %s failed: %s", tokenized.request_id, e)

    async def _fail(self, error: messages.StreamError) -> None:
        await self.bus.publish(
            subjects.stream(error.request_id), messages.STREAM_MESSAGE.encode(error)
        )


def _start_span(
    req: messages.GenerateRequest, headers: dict[str, str] | None, received_ns: int
) -> Span | None:
    """The request's tokenize span, or None when it is not traced here."""
    ctx = extract(headers)
    if ctx is None:
        return None
    span = _tracer.start_span(
        SPAN_TOKENIZE,
        context=ctx,
        kind=SpanKind.CONSUMER,
        start_time=received_ns,
        attributes={
            "gen_ai.request.model": req.model,
            "llmserve.request_id": req.request_id,
        },
    )
    span.add_event("encode")  # queued until now
    return span


def _end_span(span: Span | None, error: str | None = None) -> None:
    if span is None:
        return
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


async def serve(
    config: TokenizerConfig, tokenizers: Mapping[str, Tokenizer], stop: asyncio.Event
) -> None:
    """``tokenizers``: each of ``config.models``' tokenizer, by served name."""
    bus = await Bus.connect(config.nats_url, config.name, auth=config.bus_auth)
    service = TokenizerService(
        bus,
        {m.name: ModelTokenizer(tokenizers[m.name], m.limits) for m in config.models},
        name=config.name,
    )
    await service.start()
    for m in config.models:
        log.info(
            "tokenizer ready for %s (max_model_len=%d, block_size=%d)",
            m.name,
            m.limits.max_model_len,
            m.limits.block_size,
        )
    await stop.wait()
    await service.stop()
    await bus.drain()
