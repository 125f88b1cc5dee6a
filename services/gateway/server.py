"""The gateway under uvicorn: a drain on SIGTERM that ends every stream properly, and idle
connections closed.

Drain (first SIGTERM / SIGINT):

    t = 0           new HTTP requests: 503 + Retry-After; /health: 503 "draining"; idle (and new)
                    WebSockets get a close frame (1001); uvicorn keeps listening
    until deadline  running requests finish as usual (``drain_timeout_s``; a second signal
                    skips the wait)
    deadline        what still runs is interrupted: an SSE stream ends with an error event and
                    ``data: [DONE]``, a WebSocket with an error message, ``{"done": true}`` and a
                    close frame, a JSON request with a 503; each is aborted on the bus
    then            uvicorn's own shutdown: stop listening, close idle connections, lifespan exit
                    (drains the NATS connection)

Uvicorn left alone would stop accepting at once and, after its graceful timeout, cancel what runs:
streams then end with a bare TCP close, which a client cannot tell from a network failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from types import FrameType

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .generation import Gateway

log = logging.getLogger("llmserve.gateway")

# After the deadline, how long interrupted streams get to write their last events.
INTERRUPT_GRACE_S = 2.0
# uvicorn's own graceful shutdown, after ours: only responses already ending are left.
UVICORN_GRACE_S = 3


class IdleClosingHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol on httptools (a C parser, cheaper per streamed token than h11).

    uvicorn closes a keep-alive connection idle ``timeout_keep_alive`` after a response, but not
    one that never completes a request head: opened and left silent, or sending its head a byte at
    a time (uvicorn disarms its timer at every byte). Here, from the connection's start and from
    the end of each response, the next request's head must be complete within the same time."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._on_head_timeout)

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        waiting_for_head = self.cycle is None or self.cycle.response_complete
        # A connection upgraded to a WebSocket belongs to another protocol now.
        if (
            waiting_for_head
            and not self.transport.is_closing()
            and self.transport.get_protocol() is self
        ):
            self.transport.close()


class GatewayServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Gateway, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._gateway = gateway
        self._drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._hurry: asyncio.Event | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._hurry = asyncio.Event()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler (uvicorn installs it with signal.signal): hand over to the loop. Once
        # the drain is over (should_exit), uvicorn's own handling applies (a repeat SIGINT forces).
        if self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain(sig))
        elif self._hurry is not None:
            log.info("second signal: ending the running requests now")
            self._hurry.set()

    async def _drain(self, sig: int) -> None:
        gw = self._gateway
        assert self._hurry is not None and self._loop is not None
        gw.draining.set()
        log.info(
            "draining: %d request(s) running get up to %.0f s; new requests get 503",
            len(gw.streams),
            self._drain_timeout_s,
        )
        deadline = self._loop.time() + self._drain_timeout_s
        while gw.streams and not self._hurry.is_set() and self._loop.time() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._hurry.wait(), 0.05)
        if gw.streams:
            log.warning(
                "drain deadline: ending %d running request(s) with an error",
                gw.interrupt_streams(),
            )
            grace_end = self._loop.time() + INTERRUPT_GRACE_S
            while gw.streams and self._loop.time() < grace_end:
                await asyncio.sleep(0.02)
        log.info("drained; shutting down")
        super().handle_exit(sig, None)
