"""One request's life on the bus, as the gateway sees it.

    open():  SUB llm.v1.stream.<rid>  →  REQ llm.v1.tokenizer.generate (GenerateRequest) → ack
             (no tokenizer listening: 503 at once, not a wait for the deadline)
    next():  StreamOutput → its RequestOutput   |  StreamError → APIError  |  deadline → 504
    close(): if the request did not end (finished output or error): PUB llm.v1.abort, so the
             executor frees its KV blocks; then UNSUB.

Subscribe-before-publish on the same connection: the server registers the SUB before it sees the
PUB, and every stream message is caused by that PUB, so none can be missed (see shared/wire/bus.py).
Messages of one subject arrive in publish order, so deltas are applied in the executor's order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

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
    StreamOutput,
)
from shared.wire.outputs import RequestOutput

from .errors import APIError, from_stream_error, request_timeout, service_unavailable

log = logging.getLogger("llmserve.gateway.streams")


class GenerationStream:
    """Use as ``async with GenerationStream(...) as stream:`` — exiting always closes (and aborts
    an unfinished request), whether the block returned, raised or was cancelled."""

    def __init__(
        self,
        bus: Bus,
        request: GenerateRequest,
        timeout_s: float,
        payload: bytes | None = None,
    ) -> None:
        """``payload``: the request already encoded (by the caller, which checked its size)."""
        self.bus = bus
        self.request = request
        self.timeout_s = timeout_s
        self._payload = payload if payload is not None else GENERATE_REQUEST.encode(request)
        self._deadline = time.monotonic() + timeout_s
        self._sub: Subscription | None = None
        self.ended = False  # a finished output or an error arrived: nothing to abort
        self.abort_reason: str | None = None
        self._interrupt: APIError | None = None

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
            await self.bus.request(
                subjects.TOKENIZER_GENERATE,
                self._payload,
                timeout=max(self._deadline - time.monotonic(), 0.001),
            )
        except BusNoResponders:
            self.ended = True  # nobody took it, nothing to abort
            raise service_unavailable("No tokenizer is running.") from None
        except BusTimeout:  # a tokenizer may still take it late: close() aborts it
            self.abort_reason = "request timeout"
            raise request_timeout(self.timeout_s) from None
        except BusError as e:
            self.ended = True  # nothing was dispatched, nothing to abort
            raise service_unavailable(f"The message bus is unavailable: {e}") from None

    async def next(self) -> RequestOutput:
        """The next step's output. Raises APIError for a StreamError, a timeout (504, and the
        request is marked for abort) or a lost bus (503)."""
        assert self._sub is not None, "open() first"
        if self.ended:
            raise RuntimeError(f"stream of {self.request_id} already ended")
        if self._interrupt is not None:
            raise replace(self._interrupt)  # a fresh exception each time it is raised
        remaining = self._deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise BusTimeout("deadline passed")
            msg = await self._sub.next(timeout=remaining)
        except BusInterrupted:
            assert self._interrupt is not None  # only interrupt() interrupts the subscription
            raise replace(self._interrupt) from None
        except BusTimeout:
            self.abort_reason = "request timeout"
            raise request_timeout(self.timeout_s) from None
        except BusError as e:
            self.abort_reason = "gateway lost the message bus"
            raise service_unavailable(f"The message bus is unavailable: {e}") from None
        try:
            message = STREAM_MESSAGE.decode(msg.data)
        except msgspec.DecodeError as e:
            log.error("undecodable message on %s: %s", msg.subject, e)
            self.abort_reason = "undecodable stream message"
            raise APIError(500, "The server sent an undecodable stream message.") from None
        if isinstance(message, StreamError):
            self.ended = True
            raise from_stream_error(message)
        assert isinstance(message, StreamOutput)
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
