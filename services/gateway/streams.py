"""One request's life on the bus, as the gateway sees it.

    open():  SUB llm.v1.stream.<rid>  →  REQ llm.v1.tokenizer.generate (GenerateRequest) → ack
             (no tokenizer listening: 503 at once; no ack within ack_timeout_s: 503)
    next():  StreamOutput → its RequestOutput   |  StreamError → APIError  |  deadline → 504
             StreamKeepalive → nothing to return, the wait goes on (its holder is alive)
             silence for progress_timeout_s → 503 (no output yet) or 502 (incomplete output)
    close(): if the request did not end (finished output or error): PUB llm.v1.abort, so the
             executor frees its KV blocks; then UNSUB.

Bounded waits: from its ack on, every process that holds the request (tokenizer, scheduler queue,
executor) puts a message on its stream at least every KEEPALIVE_INTERVAL_S, so a stream silent for
``progress_timeout_s`` means its holder died: the client gets an error then, not at the deadline.

Subscribe-before-publish on the same connection: the server registers the SUB before it sees the
PUB, and every stream message is caused by that PUB, so none can be missed (see shared/wire/bus.py).
Messages of one subject arrive in publish order, so deltas are applied in the executor's order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Protocol

import msgspec

from shared.wire import subjects
from shared.wire.bus import (
    Bus,
    BusError,
    BusInterrupted,
    BusNoResponders,
    BusTimeout,
    Subscription,
)
from shared.wire.messages import (
    ABORT_REQUEST,
    GENERATE_REQUEST,
    STREAM_MESSAGE,
    AbortRequest,
    GenerateRequest,
    StreamError,
    StreamKeepalive,
    StreamOutput,
)
from shared.wire.outputs import RequestOutput

from .errors import (
    APIError,
    bus_unavailable,
    from_stream_error,
    no_progress,
    request_timeout,
    service_unavailable,
)

log = logging.getLogger("llmserve.gateway.streams")


class StreamWatcher(Protocol):
    """Told what the stream learns of where its request is (the console's request_log.py)."""

    def on_accepted(self) -> None: ...
    def on_keepalive(self, holder: str, state: str) -> None: ...
    def on_output(self, executor_id: str) -> None: ...


class GenerationStream:
    """Use as ``async with GenerationStream(...) as stream:`` — exiting always closes (and aborts
    an unfinished request), whether the block returned, raised or was cancelled."""

    def __init__(
        self,
        bus: Bus,
        request: GenerateRequest,
        timeout_s: float,
        payload: bytes | None = None,
        *,
        progress_timeout_s: float | None = None,
        ack_timeout_s: float | None = None,
        trace_headers: dict[str, str] | None = None,
        watcher: StreamWatcher | None = None,
    ) -> None:
        """``payload``: the request already encoded (by the caller, which checked its size).
        ``progress_timeout_s`` / ``ack_timeout_s``: None waits up to the deadline alone.
        ``trace_headers``: the request's trace context, sent with it to the tokenizer.
        ``watcher``: told of the ack, each keepalive and each output's executor."""
        self.bus = bus
        self.request = request
        self.timeout_s = timeout_s
        self.progress_timeout_s = progress_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self._trace_headers = trace_headers
        self._watcher = watcher
        self._payload = payload if payload is not None else GENERATE_REQUEST.encode(request)
        self._deadline = time.monotonic() + timeout_s
        self._sub: Subscription | None = None
        self.ended = False  # a finished output or an error arrived: nothing to abort
        self.abort_reason: str | None = None
        self._interrupt: APIError | None = None
        # The progress clock: when the stream last carried anything, and from whom.
        self._last_heard = time.monotonic()
        self.last_holder = "the tokenizer"
        self.num_outputs = 0
        self.ack_round_trip_s: float | None = None  # tokenizer.generate request → its ack

    def interrupt(self, error: APIError, abort_reason: str) -> None:
        """End the stream from our side: the pending ``next()`` (or the next one) raises
        ``error``; ``close()`` then aborts the request on the bus with ``abort_reason``."""
        if self.ended or self._interrupt is not None:
            return
        self._interrupt = error
        self.abort_reason = abort_reason
        if self._sub is not None:
            self._sub.interrupt()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def open(self) -> None:
        try:
            self._sub = await self.bus.subscribe_iter(subjects.stream(self.request_id))
            remaining = self._deadline - time.monotonic()
            ack_wait = (
                remaining if self.ack_timeout_s is None else min(remaining, self.ack_timeout_s)
            )
            sent = time.perf_counter()
            await self.bus.request(
                subjects.TOKENIZER_GENERATE,
                self._payload,
                timeout=max(ack_wait, 0.001),
                headers=self._trace_headers,
            )
            self.ack_round_trip_s = time.perf_counter() - sent
        except BusNoResponders:
            self.ended = True  # nobody took it, nothing to abort
            raise service_unavailable("No tokenizer is running.") from None
        except BusTimeout:  # a tokenizer may still take it late: close() aborts it
            if time.monotonic() < self._deadline:
                self.abort_reason = "no tokenizer acknowledged it"
                raise service_unavailable(
                    f"No tokenizer acknowledged the request within {self.ack_timeout_s:g} s."
                ) from None
            self.abort_reason = "request timeout"
            raise request_timeout(self.timeout_s) from None
        except BusError as e:
            self.ended = True  # nothing was dispatched, nothing to abort
            raise bus_unavailable(str(e)) from None
        self._last_heard = time.monotonic()  # a tokenizer holds it from here: its keepalives
        if self._watcher is not None:
            self._watcher.on_accepted()

    async def next(self) -> RequestOutput:
        """The next step's output. Raises APIError for a StreamError, a timeout (504, and the
        request is marked for abort), a silent stream (503/502, marked for abort) or a lost bus
        (503)."""
        assert self._sub is not None, "open() first"
        if self.ended:
            raise RuntimeError(f"stream of {self.request_id} already ended")
        while True:
            if self._interrupt is not None:
                raise replace(self._interrupt)  # a fresh exception each time it is raised
            now = time.monotonic()
            if now >= self._deadline:
                self.abort_reason = "request timeout"
                raise request_timeout(self.timeout_s)
            silent_until = (
                self._last_heard + self.progress_timeout_s
                if self.progress_timeout_s is not None
                else self._deadline
            )
            if now >= silent_until:
                self.abort_reason = "no progress"
                assert self.progress_timeout_s is not None
                raise no_progress(self.progress_timeout_s, self.num_outputs, self.last_holder)
            try:
                msg = await self._sub.next(timeout=min(self._deadline, silent_until) - now)
            except BusInterrupted:
                assert self._interrupt is not None  # only interrupt() interrupts the subscription
                raise replace(self._interrupt) from None
            except BusTimeout:
                continue  # the top of the loop says which clock ran out
            except BusError as e:
                self.abort_reason = "gateway lost the message bus"
                raise bus_unavailable(str(e)) from None
            self._last_heard = time.monotonic()
            try:
                message = STREAM_MESSAGE.decode(msg.data)
            except msgspec.DecodeError as e:
                log.error("undecodable message on %s: %s", msg.subject, e)
                self.abort_reason = "undecodable stream message"
                raise APIError(500, "The server sent an undecodable stream message.") from None
            if isinstance(message, StreamKeepalive):
                state = f", {message.state}" if message.state else ""
                self.last_holder = f"{message.holder}{state}"
                if self._watcher is not None:
                    self._watcher.on_keepalive(message.holder, message.state)
                continue
            if isinstance(message, StreamError):
                self.ended = True
                raise from_stream_error(message)
            assert isinstance(message, StreamOutput)
            self.num_outputs += 1
            self.last_holder = message.executor_id
            if self._watcher is not None:
                self._watcher.on_output(message.executor_id)
            if message.output.finished:
                self.ended = True
            return message.output

    async def close(self, reason: str | None = None) -> None:
        """Abort (if unfinished) and unsubscribe. Idempotent; never raises: it runs on every exit
        path, including while the client connection is being torn down."""
        if not self.ended and self._sub is not None:
            self.ended = True
            reason = reason or self.abort_reason or "client disconnected"
            try:
                await self.bus.publish(
                    subjects.ABORT,
                    ABORT_REQUEST.encode(AbortRequest(request_id=self.request_id, reason=reason)),
                )
            except BusError as e:
                log.warning("could not publish abort of %s: %s", self.request_id, e)
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def __aenter__(self) -> GenerationStream:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
