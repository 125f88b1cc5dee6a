"""Server-sent events: the byte framing, and a response that notices a vanished client at once.

Starlette's StreamingResponse only notices a disconnect when its next ``send`` fails (ASGI ≥ 2.4) —
for a request waiting on a slow prefill that may be minutes, holding KV blocks for nobody. This
response listens for ``http.disconnect`` the whole time and then cancels the body, and it always
``aclose()``s the body iterator (shielded), so the body's ``finally`` (which aborts the request on
the bus) runs before the response returns, on every path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


def sse_event(obj: Any) -> bytes:
    """One ``data: {json}`` event. msgspec writes non-finite floats as null: always valid JSON."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncIterator[bytes],
        headers: Mapping[str, str] | None = None,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``on_close`` runs last, on every path: an async generator body that never started
        (the client was gone before the first send) runs no ``finally`` of its own."""
        self.body_iterator = body
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        # no-cache: proxies must not hold events; X-Accel-Buffering: nginx must not buffer them.
        self.init_headers(
            {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.body_iterator
        try:
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_disconnect)
                try:
                    await send(
                        {
                            "type": "http.response.start",
                            "status": self.status_code,
                            "headers": self.raw_headers,
                        }
                    )
                    async for chunk in body:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:
                    pass  # the client went away (ASGI >= 2.4 servers raise on send)
                finally:
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await body.aclose()  # type: ignore[attr-defined]
                if self.on_close is not None:
                    await self.on_close()
