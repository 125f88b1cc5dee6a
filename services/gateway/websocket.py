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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
from fastapi import FastAPI, WebSocket

from .errors import APIError, bad_request
from .generation import ClientDisconnected, Gateway, race_disconnect
from .metrics import CLIENT_CLOSED
from .protocol import Api

log = logging.getLogger("llmserve.gateway.ws")

ENDPOINT = "ws"
_DONE = {"done": True}
_encoder = msgspec.json.Encoder()
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


def register_websocket(
    app: FastAPI, gw: Gateway, check_api_key: Callable[[Any, str | None], None]
) -> None:
    @app.websocket("/v1/ws")
    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            check_api_key(gw.config, websocket.headers.get("authorization"))
        except APIError as e:
            gw.metrics.count(ENDPOINT, e.status)
            await websocket.send_text(_encoder.encode(e.body()).decode())
            await websocket.close(code=POLICY_VIOLATION)
            return
        inbox = _Inbox(websocket)
        try:
            while (data := await inbox.get()) is not None:
                if not await _serve_one(gw, websocket, data, inbox):
                    break
        finally:
            inbox.stop()


async def _send(websocket: WebSocket, obj: Any) -> None:
    await websocket.send_text(_encoder.encode(obj).decode())


async def _serve_one(gw: Gateway, websocket: WebSocket, data: bytes, inbox: _Inbox) -> bool:
    """Serve one request; False when the client is gone."""
    try:
        obj = msgspec.json.decode(data)
        if not isinstance(obj, dict):
            raise bad_request("The request must be a JSON object.")
        api: Api = "chat" if "messages" in obj else "completion"
        p = await gw.prepare(api, data, force_stream=True)
    except msgspec.DecodeError as e:
        p, err = None, bad_request(f"The request is not valid JSON: {e}")
    except APIError as e:
        p, err = None, e
    if p is None:
        gw.metrics.count(ENDPOINT, err.status)
        await _send(websocket, err.body())
        await _send(websocket, _DONE)
        return True

    tracker = gw.metrics.tracker(ENDPOINT)
    aborted = False

    async def stopped() -> None:
        """Returns when the client disconnects or asks to abort; other messages get an error."""
        nonlocal aborted
        while (msg := await inbox.get()) is not None:
            try:
                if msgspec.json.decode(msg).get("abort") is True:
                    aborted = True
                    return
            except (msgspec.DecodeError, AttributeError):
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
    await _send(websocket, _DONE)
    return True
