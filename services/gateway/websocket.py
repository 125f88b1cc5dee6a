"""WebSocket streaming: ``/v1/ws``.

Protocol (one request at a time per socket; the socket stays open for the next one):

    client → {completions or chat request JSON}     ("messages" present → chat, else completions;
                                                     "stream" is implied)
    server → {chunk}  {chunk} ...                   exactly the objects SSE would send as data: ...
    server → {"error": {...}}                       only on failure (any time, even before a chunk)
    server → {"done": true}                         always last for that request
    client → {"abort": true}                        optional, mid-request: abort it; then "done"

Auth: the same ``Authorization: Bearer <key>`` header on the upgrade request; a bad key gets an
error object and close code 1008. Closing the socket mid-request aborts the request on the bus.

Bounds: a message over ``max_body_bytes`` is closed with 1009 by the server (uvicorn's
``ws_max_size``); one nested deeper than the JSON depth limit gets an error object and close code
1007 with the reason. A browser page of another origin is refused (1008): WebSockets bypass CORS.
While the gateway drains (server.py) it reads no new request: an idle socket is closed (1001) at
once, a busy one once its request has ended, as usual or, cut short at the deadline, with an error
object and ``{"done": true}``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio
import msgspec
from fastapi import FastAPI, WebSocket

from .api_keys import ApiKey
from .errors import APIError, bad_request
from .generation import ClientDisconnected, Gateway, race_disconnect
from .metrics import CLIENT_CLOSED
from .openai_schema import JSON_TOO_DEEP, parse_json_object
from .protocol import Api

log = logging.getLogger("llmserve.gateway.ws")

ENDPOINT = "ws"
_DONE = {"done": True}
_encoder = msgspec.json.Encoder()
GOING_AWAY = 1001
INVALID_PAYLOAD = 1007
POLICY_VIOLATION = 1008


class _Inbox:
    """Everything the client sends, read by one task so a disconnect is seen even mid-stream."""

    def __init__(self, websocket: WebSocket) -> None:
        self._ws = websocket
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()  # None = disconnected
        self.closed = False
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                msg = await self._ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                data = msg.get("bytes") or (msg.get("text") or "").encode()
                self._queue.put_nowait(data)
        finally:
            self.closed = True
            self._queue.put_nowait(None)

    async def get(self) -> bytes | None:
        data = await self._queue.get()
        if data is None:
            self._queue.put_nowait(None)  # stays visible to every later reader
        return data

    def stop(self) -> None:
        self._task.cancel()


def register_websocket(app: FastAPI, gw: Gateway) -> None:
    @app.websocket("/v1/ws")
    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            if not _same_origin(websocket):
                raise APIError(
                    403, "Cross-origin WebSocket connections are not allowed.", code="forbidden"
                )
            key = gw.authenticate(websocket.headers.get("authorization"))
        except APIError as e:
            gw.metrics.count(ENDPOINT, e.status)
            await websocket.send_text(_encoder.encode(e.body()).decode())
            await websocket.close(code=POLICY_VIOLATION)
            return
        inbox = _Inbox(websocket)
        try:
            while (data := await _next_request(gw, inbox)) is not None:
                try:
                    if not await _serve_one(gw, websocket, data, inbox, key):
                        return
                except _Refused as e:
                    await _send(websocket, e.error.body())
                    await websocket.close(code=INVALID_PAYLOAD, reason=e.error.message[:120])
                    return
                if gw.draining.is_set():
                    break
            if not inbox.closed:  # draining: a close frame, never a bare TCP close
                await websocket.close(code=GOING_AWAY, reason="server shutting down")
        finally:
            inbox.stop()


def _same_origin(websocket: WebSocket) -> bool:
    """True unless a browser says the page that opened the socket is of another origin than this
    server (non-browser clients send no Origin)."""
    origin = websocket.headers.get("origin")
    if origin is None:
        return True
    host = websocket.headers.get("host", "")
    return origin.split("://", 1)[-1].rstrip("/").lower() == host.lower()


class _Refused(Exception):
    """A message the socket must be closed over (1007), not merely answered."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


async def _next_request(gw: Gateway, inbox: _Inbox) -> bytes | None:
    """The client's next message; None once it is gone, or the gateway drains while it idles."""
    if gw.draining.is_set():
        return None
    get = asyncio.ensure_future(inbox.get())
    drain = asyncio.ensure_future(gw.draining.wait())
    try:
        await asyncio.wait({get, drain}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        drain.cancel()
        if not get.done():
            get.cancel()
    return get.result() if get.done() and not get.cancelled() else None


async def _send(websocket: WebSocket, obj: Any) -> None:
    await websocket.send_text(_encoder.encode(obj).decode())


async def _serve_one(
    gw: Gateway, websocket: WebSocket, data: bytes, inbox: _Inbox, key: ApiKey | None
) -> bool:
    """Serve one request; False when the client is gone."""
    try:
        try:
            obj = parse_json_object(data)
        except APIError as e:
            if e.code == JSON_TOO_DEEP:
                gw.metrics.count(ENDPOINT, e.status)
                raise _Refused(e) from None
            raise
        api: Api = "chat" if "messages" in obj else "completion"
        p = await gw.prepare(api, data, force_stream=True)
        lease = await gw.admit(key, p)
    except APIError as e:
        gw.metrics.count(ENDPOINT, e.status)
        await _send(websocket, e.body())
        await _send(websocket, _DONE)
        return True

    tracker = gw.metrics.tracker(ENDPOINT, gw.releaser(lease, p))
    gw.record(p, ENDPOINT, tracker)
    aborted = False

    async def stopped() -> None:
        """Returns when the client disconnects or asks to abort; other messages get an error."""
        nonlocal aborted
        while (msg := await inbox.get()) is not None:
            try:
                if parse_json_object(msg).get("abort") is True:
                    aborted = True
                    return
            except APIError:
                pass
            await _send(
                websocket,
                bad_request(
                    "A request is in progress on this socket; send "
                    '{"abort": true} or wait for {"done": true}.'
                ).body(),
            )

    try:
        stream, first = await gw.start(p, stopped)
    except APIError as e:
        tracker.done(e.status)
        await _send(websocket, e.body())
        await _send(websocket, _DONE)
        return True
    except ClientDisconnected:
        tracker.done(CLIENT_CLOSED)
        if aborted:
            await _send(websocket, _DONE)
        return aborted
    except BaseException as e:  # never left in flight, whatever failed
        tracker.done(CLIENT_CLOSED if isinstance(e, asyncio.CancelledError) else 500)
        raise

    events = gw.chunk_events(p, stream, first, tracker)

    async def pump() -> None:
        try:
            async for item in events:
                await _send(websocket, item)
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()  # aborts the request if it did not end

    try:
        await race_disconnect(pump(), stopped)
    except ClientDisconnected:
        log.info(
            "%s: websocket client %s",
            p.generate.request_id,
            "aborted the request" if aborted else "disconnected",
        )
        if not aborted:
            return False
    except Exception as e:  # the socket failed under us (send on a closed connection)
        log.info("%s: websocket send failed (%r); aborted", p.generate.request_id, e)
        return False
    finally:
        # A pump cancelled before it ran never reached its finally: close here too (idempotent).
        with anyio.CancelScope(shield=True):
            await gw.close_stream(stream)
        tracker.done(CLIENT_CLOSED)  # a no-op when the events ran to their end
    await _send(websocket, _DONE)
    return True
