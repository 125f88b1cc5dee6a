"""The request path shared by HTTP (SSE / JSON) and WebSocket: parse → GenerateRequest → stream.

    prepare()       body bytes → Prepared (validated request + how to shape its output); APIError
    start()         subscribe + dispatch; waits for the FIRST output, so an error that comes before
                    any token (429, prompt too long, ...) is still a plain HTTP error status
    chunk_events()  the rest of the stream as chunk dicts; an error after the first chunk becomes a
                    final {"error": ...} item (never a hang: every wait is bounded by the deadline)
    collect()       non-streaming: every output folded into one response object

Whoever calls start() owns the returned stream and must close() it (that aborts it if unfinished).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import msgspec

from shared.wire import subjects
from shared.wire.bus import Bus, BusError, BusNoResponders, BusTimeout, Msg
from shared.wire.messages import (
    EXECUTOR_HEARTBEAT,
    GENERATE_REQUEST,
    METRICS_REPORT,
    METRICS_STALE_AFTER_S,
    PREFIX_INDEX_STATUS,
    PREFIX_INDEX_STATUS_REQUEST,
    SCHEDULER_STATUS,
    SCHEDULER_STATUS_REQUEST,
    TOKENIZER_STATUS,
    TOKENIZER_STATUS_REQUEST,
    GenerateRequest,
    PrefixIndexStatus,
    PrefixIndexStatusRequest,
    SchedulerStatus,
    SchedulerStatusRequest,
    TokenizerStatus,
    TokenizerStatusRequest,
)
from shared.wire.outputs import RequestOutput

from . import protocol
from .api_keys import ApiKey, KeyRing, estimated_prompt_tokens, reserved_tokens
from .config import GatewayConfig
from .errors import (
    UNAVAILABLE_RETRY_AFTER_S,
    APIError,
    bad_request,
    bus_unavailable,
    model_not_found,
    payload_too_large,
    service_unavailable,
    shutting_down,
    unauthorized,
)
from .executor_board import ExecutorBoard
from .limiter import Lease, Limiter
from .metrics import CLIENT_CLOSED, GatewayMetrics, RequestTracker
from .openai_schema import ChatCompletionRequest, parse_chat_request, parse_completion_request
from .request_log import RequestLog, RequestRecord
from .streams import GenerationStream

log = logging.getLogger("llmserve.gateway")

T = TypeVar("T")
# How long a list of served models learnt from the scheduler stays fresh (no --model-name given).
MODELS_TTL_S = 2.0


class ClientDisconnected(Exception):
    """The client went away while we were waiting for the backend."""


@dataclass(frozen=True)
class Prepared:
    api: protocol.Api
    stream: bool
    generate: GenerateRequest
    spec: protocol.ResponseSpec
    payload: bytes  # ``generate`` encoded for the bus, its size checked against max_payload
    trace_headers: dict[str, str] | None = None  # the request span's W3C context, for the bus


class Gateway:
    """Per-app state: config, the bus connection, metrics."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.bus: Bus | None = None
        self._models: list[str] = []
        self._models_at = -1e9
        # Every stream between start() and its close(): what a drain waits for, and interrupts.
        self.streams: set[GenerationStream] = set()
        self.draining = asyncio.Event()  # set once: SIGTERM was received (server.py)
        keys = list(config.api_keys)
        if config.api_key is not None:
            keys.append(ApiKey(name="default", key=config.api_key))
        self.keys = KeyRing(keys)
        # Set by the app's lifespan when a key has limits (it needs a running loop).
        self.limiter: Limiter | None = None
        self._releases: set[asyncio.Task[None]] = set()
        # What the console shows (console_routes.py): recent requests, each executor's heartbeat.
        self.request_log = RequestLog()
        self.executors = ExecutorBoard(METRICS_STALE_AFTER_S)

    # -- auth and per-key limits ---------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The request's key (None when no key is configured: auth off); 401 without a known
        one."""
        if not len(self.keys):
            return None
        scheme, _, token = (authorization or "").partition(" ")
        key = self.keys.find(token.strip()) if scheme.lower() == "bearer" else None
        if key is None:
            raise unauthorized()
        return key

    async def admit(self, key: ApiKey | None, p: Prepared) -> Lease | None:
        """Take the request's due from its key's limits: a Lease to release when it ends, or
        APIError 429 (the limit's name, Retry-After)."""
        if key is None:
            return None
        cost = reserved_tokens(p.generate)
        lease = None
        if self.limiter is not None:
            lease = await self.limiter.admit(key, cost)
        self.metrics.api_key_requests.labels(key.name).inc()
        self.metrics.api_key_tokens_reserved.labels(key.name).inc(cost)
        return lease

    def releaser(self, lease: Lease | None, p: Prepared) -> Callable[[int, int], None]:
        """The tracker's on_done for a request admitted with ``lease``: it is charged its prompt
        (the admission estimate while the tokenized length is unknown) and what it generated."""

        def release(num_prompt_tokens: int, num_generated_tokens: int) -> None:
            prompt = num_prompt_tokens or estimated_prompt_tokens(p.generate)
            self.release(lease, prompt + num_generated_tokens)

        return release

    def release(self, lease: Lease | None, num_used_tokens: int) -> None:
        """Give back what a lease holds beyond ``num_used_tokens``, in the background (callable
        from sync code, any path)."""
        if lease is None or not lease.holds_anything or self.limiter is None:
            return
        task = asyncio.get_running_loop().create_task(self.limiter.release(lease, num_used_tokens))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    # -- drain ---------------------------------------------------------------------------------

    def check_admission(self) -> None:
        """A draining gateway takes no new request: 503, to be retried elsewhere or later."""
        if self.draining.is_set():
            raise shutting_down()

    def interrupt_streams(self, error: APIError | None = None, reason: str | None = None) -> int:
        """End every running stream with ``error`` (default: a 503, the gateway shutting down;
        an error event once streaming began); each is aborted on the bus when closed. Returns how
        many were running."""
        if error is None:
            error = APIError(
                503,
                "The server is shutting down; the request was cut short.",
                retry_after_s=1.0,
            )
        streams = list(self.streams)
        for stream in streams:
            stream.interrupt(error, reason or "gateway shutting down")
        return len(streams)

    def on_bus_lost(self) -> None:
        """The connection to NATS dropped: whatever was published to us meanwhile is lost, so no
        running stream can be trusted to be complete. Each ends now with a 503 (an error event
        once streaming began) and is aborted once the bus is back; new requests get 503 until
        it is (``_bus``)."""
        num = self.interrupt_streams(
            APIError(
                503,
                "The gateway lost its connection to the message bus (NATS); the request was "
                "cut short. Retry it.",
                retry_after_s=UNAVAILABLE_RETRY_AFTER_S,
            ),
            "gateway lost the message bus",
        )
        if num:
            log.warning("lost the message bus: ended %d running request(s) with an error", num)

    # -- backend status ------------------------------------------------------------------------

    def _bus(self) -> Bus:
        if self.bus is None or not self.bus.is_connected:
            raise bus_unavailable(self.bus_down_detail())
        return self.bus

    def bus_down_detail(self) -> str:
        since = self.bus.disconnected_since if self.bus is not None else None
        if since is None:
            return "not connected"
        return f"disconnected {time.monotonic() - since:.1f} s ago, reconnecting"

    async def scheduler_status(self) -> SchedulerStatus:
        data = await self._status_request(
            subjects.SCHEDULER_STATUS,
            SCHEDULER_STATUS_REQUEST.encode(SchedulerStatusRequest()),
            "scheduler",
        )
        return SCHEDULER_STATUS.decode(data)

    async def tokenizer_status(self) -> TokenizerStatus:
        data = await self._status_request(
            subjects.TOKENIZER_STATUS,
            TOKENIZER_STATUS_REQUEST.encode(TokenizerStatusRequest()),
            "tokenizer",
        )
        return TOKENIZER_STATUS.decode(data)

    async def _status_request(self, subject: str, payload: bytes, service: str) -> bytes:
        try:
            return await self._bus().request(subject, payload, timeout=self.config.health_timeout_s)
        except BusTimeout:
            if self.bus is not None and not self.bus.is_connected:
                raise bus_unavailable(self.bus_down_detail()) from None
            raise service_unavailable(f"The {service} did not answer.") from None
        except BusError as e:
            raise bus_unavailable(str(e)) from None

    async def refresh_stack_metrics(self) -> None:
        """Fetch the scheduler's and the prefix index's status for this scrape; one that does not
        answer is left out."""
        scheduler, index = await asyncio.gather(
            self.scheduler_status(), self.prefix_index_status(), return_exceptions=True
        )
        self.metrics.stack.update(
            scheduler if isinstance(scheduler, SchedulerStatus) else None,
            index if isinstance(index, PrefixIndexStatus) else None,
        )

    async def on_metrics_report(self, msg: Msg) -> None:
        try:
            self.metrics.receive(METRICS_REPORT.decode(msg.data))
        except msgspec.DecodeError:
            log.warning("ignoring a malformed metrics report on %s", msg.subject)

    async def on_heartbeat(self, msg: Msg) -> None:
        try:
            self.executors.put(EXECUTOR_HEARTBEAT.decode(msg.data), time.monotonic())
        except msgspec.DecodeError:
            log.warning("ignoring a malformed heartbeat on %s", msg.subject)

    def record(self, p: Prepared, endpoint: str, tracker: RequestTracker) -> None:
        """Enter a request in the console's table; its tracker and stream keep it up to date."""
        tracker.record = self.request_log.add(
            RequestRecord(
                request_id=p.generate.request_id,
                endpoint=endpoint,
                model=p.generate.model,
                stream=p.stream,
                max_tokens=p.generate.params.max_tokens,
                created_at=time.time(),
                started=tracker.started,
            )
        )

    async def prefix_index_status(self) -> PrefixIndexStatus:
        data = await self._status_request(
            subjects.PREFIX_INDEX_STATUS,
            PREFIX_INDEX_STATUS_REQUEST.encode(PrefixIndexStatusRequest()),
            "prefix index",
        )
        return PREFIX_INDEX_STATUS.decode(data)

    async def prefix_index_probe(self) -> PrefixIndexStatus | APIError | None:
        """For /health: the index's status, the error asking it met, or None when no replica
        runs (a stack may run without one)."""
        try:
            data = await self._bus().request(
                subjects.PREFIX_INDEX_STATUS,
                PREFIX_INDEX_STATUS_REQUEST.encode(PrefixIndexStatusRequest()),
                timeout=self.config.health_timeout_s,
            )
        except BusNoResponders:
            return None
        except BusTimeout:
            return service_unavailable("The prefix index did not answer.")
        except BusError as e:
            return bus_unavailable(str(e))
        return PREFIX_INDEX_STATUS.decode(data)

    async def served_models(self, refresh: bool = False) -> list[str]:
        """The configured model names, or (none configured) the models live executors report."""
        if self.config.model_names:
            return list(self.config.model_names)
        if refresh or time.monotonic() - self._models_at > MODELS_TTL_S:
            status = await self.scheduler_status()
            self._models = sorted({e.model for e in status.executors})
            self._models_at = time.monotonic()
        return self._models

    async def check_model(self, model: str) -> None:
        models = await self.served_models()
        if model not in models:
            models = await self.served_models(refresh=True)
        if model not in models:
            if not models:
                raise service_unavailable("No executor is serving any model yet.")
            raise model_not_found(model, ", ".join(models))

    # -- requests ------------------------------------------------------------------------------

    async def prepare(
        self, api: protocol.Api, body: bytes, *, force_stream: bool = False
    ) -> Prepared:
        self.check_admission()
        req = parse_chat_request(body) if api == "chat" else parse_completion_request(body)
        # The model is checked here, against the served set; the scheduler routes by it.
        await self.check_model(req.model)
        now = time.time()
        limits = protocol.Limits(max_tokens_default=self.config.max_tokens_default)
        prefix = "chatcmpl" if api == "chat" else "cmpl"
        request_id, deadline = f"{prefix}-{uuid.uuid4().hex}", now + self.config.request_timeout_s
        if isinstance(req, ChatCompletionRequest):
            generate = protocol.chat_to_generate(
                req, request_id=request_id, limits=limits, arrival_time=now, deadline=deadline
            )
        else:
            generate = protocol.completion_to_generate(
                req, request_id=request_id, limits=limits, arrival_time=now, deadline=deadline
            )
        stream = bool(req.stream) or force_stream
        spec = protocol.ResponseSpec(
            api=api,
            request_id=generate.request_id,
            model=req.model,
            created=int(now),
            n=generate.params.n,
            logprobs=generate.params.logprobs,
            include_usage=stream and bool(req.stream_options and req.stream_options.include_usage),
        )
        return Prepared(api, stream, generate, spec, self._encode(generate))

    def _encode(self, generate: GenerateRequest) -> bytes:
        """The request as the tokenizer receives it. Its integers were range-checked (protocol,
        SamplingParams); an encoding failure is still the client's number, never a 500. A
        message over the bus's max_payload is refused as too large (413), not retried."""
        try:
            payload = GENERATE_REQUEST.encode(generate)
        except (OverflowError, msgspec.EncodeError) as e:
            raise bad_request(f"A number in the request is out of range: {e}") from None
        max_payload = self._bus().max_payload
        if len(payload) > max_payload:
            raise payload_too_large(
                "request, encoded for the message bus,", len(payload), max_payload
            )
        return payload

    async def start(
        self, p: Prepared, disconnected: Callable[[], Awaitable[None]] | None
    ) -> tuple[GenerationStream, RequestOutput]:
        """Dispatch and wait for the first output. On any exception the stream is closed
        (aborted)."""
        self.check_admission()
        stream = GenerationStream(
            self._bus(),
            p.generate,
            self.config.request_timeout_s,
            payload=p.payload,
            progress_timeout_s=self.config.progress_timeout_s,
            ack_timeout_s=self.config.ack_timeout_s,
            trace_headers=p.trace_headers,
            watcher=self.request_log.get(p.generate.request_id),
        )
        self.streams.add(stream)
        try:
            await stream.open()
            if stream.ack_round_trip_s is not None:
                self.metrics.round_trip.labels("tokenizer.generate").observe(
                    stream.ack_round_trip_s
                )
            first = await race_disconnect(stream.next(), disconnected)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.close_stream(stream)
            raise
        return stream, first

    async def close_stream(self, stream: GenerationStream) -> None:
        """Close (abort if unfinished) and forget a stream start() returned."""
        try:
            await stream.close()
        finally:
            self.streams.discard(stream)

    async def collect(
        self,
        p: Prepared,
        tracker: RequestTracker,
        disconnected: Callable[[], Awaitable[None]] | None,
    ) -> dict[str, Any]:
        """The whole non-streaming response; raises APIError / ClientDisconnected."""
        builder = protocol.ResponseBuilder(p.spec)
        stream, out = await self.start(p, disconnected)
        try:

            async def fold(out: RequestOutput) -> None:
                while True:
                    builder.apply(out, render=False)
                    tracker.on_tokens(_num_tokens(out))
                    if builder.finished:
                        return
                    out = await stream.next()

            await race_disconnect(fold(out), disconnected)
        finally:
            with anyio.CancelScope(shield=True):
                await self.close_stream(stream)
        response = builder.response()
        tracker.done(
            200,
            num_prompt_tokens=response["usage"]["prompt_tokens"],
            finish_reasons=[c["finish_reason"] for c in response["choices"]],
        )
        return response

    async def chunk_events(
        self, p: Prepared, stream: GenerationStream, first: RequestOutput, tracker: RequestTracker
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Every chunk of a started stream, then the usage chunk if asked; an error ends it with
        its error body. Closing this iterator early (client gone) closes and aborts the stream."""
        builder = protocol.ResponseBuilder(p.spec)
        status = CLIENT_CLOSED  # unless we get to the end
        try:
            out = first
            while True:
                tracker.on_tokens(_num_tokens(out))
                for chunk in builder.apply(out):
                    yield chunk
                if builder.finished:
                    break
                try:
                    out = await stream.next()
                except APIError as e:
                    status = e.status
                    log.info("%s failed after streaming began: %s", p.generate.request_id, e)
                    yield e.body()
                    return
            if p.spec.include_usage:
                yield builder.usage_chunk()
            status = 200
        finally:
            # Shielded: this runs while the response is being cancelled (client gone), and the
            # abort must still reach the bus.
            with anyio.CancelScope(shield=True):
                await self.close_stream(stream)
            response = builder.response()
            tracker.done(
                status,
                num_prompt_tokens=response["usage"]["prompt_tokens"],
                finish_reasons=[c["finish_reason"] for c in response["choices"]],
            )


def _num_tokens(out: RequestOutput) -> int:
    return sum(len(d.token_ids) for d in out.deltas)


async def race_disconnect(
    aw: Awaitable[T], disconnected: Callable[[], Awaitable[None]] | None
) -> T:
    """``await aw``, unless ``disconnected()`` returns first: then cancel it, raise
    ClientDisconnected."""
    if disconnected is None:
        return await aw
    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.done() and not work.cancelled():
        return work.result()
    raise ClientDisconnected()
