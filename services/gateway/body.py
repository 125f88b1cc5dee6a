"""Reading a JSON request body at the edge, bounded.

- ``Content-Type`` must be JSON (415 otherwise, a missing one included): a browser sends a
  cross-origin POST without asking first (no CORS preflight) only as ``text/plain``, a form, or with
  no type at all, so refusing those keeps another site's page from driving a local, keyless
  gateway. The gateway answers no CORS preflight and sends no ``Access-Control-Allow-*`` header.
- The body is read chunk by chunk and refused (413) as soon as it passes the limit, or at once when
  its ``Content-Length`` says it will: a 100 MB body is never held, nor read whole.
- The whole body must arrive within ``timeout_s`` (408 otherwise): a client trickling a byte at
  a time would hold a connection and a request slot for as long as it liked, since the
  keep-alive timeout only covers the time before the request's head is complete.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from .errors import body_timeout, payload_too_large, unsupported_media_type


def require_json(request: Request) -> None:
    content_type = request.headers.get("content-type")
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not (
        media_type.startswith("application/") and media_type.endswith("+json")
    ):
        raise unsupported_media_type(content_type)


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise payload_too_large("request body", int(declared), max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise payload_too_large("request body", None, max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise body_timeout(timeout_s) from None
    return b"".join(chunks)
