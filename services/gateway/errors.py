"""OpenAI-style errors at the HTTP edge.

Every failure a client sees, whatever its origin (edge validation, auth, a StreamError from a
backend service, a timeout), becomes one ``APIError`` and is rendered the same way:

    HTTP <status>   {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

or, once an SSE stream has begun (the status line is already sent), as a final ``data: {"error":
...}`` event. Pure module: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shared.wire.messages import StreamError

# OpenAI puts client mistakes under one type and tells them apart by ``code``.
INVALID_REQUEST = "invalid_request_error"

# The ``code`` OpenAI clients branch on, by status, when the origin gave none. A 404 has none: it
# is ``model_not_found`` only when it is about the model (``model_not_found``, from_stream_error),
# not for an unknown route.
_DEFAULT_CODES: dict[int, str] = {
    401: "invalid_api_key",
    429: "rate_limit_exceeded",
    504: "request_timeout",
}
MODEL_NOT_FOUND = "model_not_found"

# Retry-After of a 503 the gateway decides alone (the bus or a service is away), or one that came
# without: about the time a supervised process takes to come back. A 429 or 503 from the scheduler
# carries its own, from the queue's measured drain rate.
UNAVAILABLE_RETRY_AFTER_S = 2.0


def _default_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status == 503:
        return "service_unavailable"
    if status == 504:
        return "timeout_error"
    return INVALID_REQUEST if 400 <= status < 500 else "server_error"


# Not frozen, and compared by identity like any exception: Starlette clears the traceback of an
# exception its handler answered (``exc.__traceback__ = None``), which a frozen dataclass refuses;
# that error, raised after the response, closed the client's keep-alive connection.
@dataclass(eq=False)
class APIError(Exception):
    """An error for the client. ``retry_after_s`` becomes the Retry-After header (whole seconds,
    rounded up: the header takes no fractions and rounding down would invite an early retry)."""

    status: int
    message: str
    type: str = ""
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None

    def __post_init__(self) -> None:
        if not 400 <= self.status <= 599:
            raise ValueError(f"APIError status must be a 4xx/5xx HTTP status, got {self.status}")
        if not self.type:
            object.__setattr__(self, "type", _default_type(self.status))
        if self.code is None:
            object.__setattr__(self, "code", _DEFAULT_CODES.get(self.status))

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param)


def from_stream_error(err: StreamError) -> APIError:
    """A backend service's error, passed through with its status and type. A status outside 4xx/5xx
    would be a bug upstream; the client still gets a well-formed 500 rather than a crash."""
    status = err.status if 400 <= err.status <= 599 else 500
    # StreamError.type defaults to "server_error" even for client errors; prefer the status' type.
    type_ = err.type if err.type != "server_error" or status >= 500 else ""
    code = MODEL_NOT_FOUND if status == 404 and err.param == "model" else None
    retry_after_s = err.retry_after_s
    if retry_after_s is None and status in (429, 503):  # "come back later" always says when
        retry_after_s = UNAVAILABLE_RETRY_AFTER_S
    return APIError(status, err.message, type_, err.param, code, retry_after_s=retry_after_s)


def unauthorized() -> APIError:
    return APIError(
        401,
        "Invalid or missing API key. Pass it as 'Authorization: Bearer <key>'.",
        INVALID_REQUEST,
    )


def model_not_found(model: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model '{model}' does not exist. This server serves '{served}'.",
        INVALID_REQUEST,
        "model",
        MODEL_NOT_FOUND,
    )


def route_not_found(method: str, path: str) -> APIError:
    """OpenAI's answer to an unknown URL: a plain not-found, no ``code``."""
    return APIError(404, f"Invalid URL ({method} {path})", INVALID_REQUEST)


def payload_too_large(what: str, num_bytes: int | None, limit: int) -> APIError:
    size = f"{num_bytes} bytes, " if num_bytes is not None else ""
    return APIError(
        413,
        f"The {what} is {size}over this server's limit of {limit} bytes.",
        INVALID_REQUEST,
        code="request_too_large",
    )


def unsupported_media_type(content_type: str | None) -> APIError:
    got = f"'{content_type}'" if content_type else "none"
    return APIError(
        415,
        f"The request body must be JSON, sent with 'Content-Type: application/json' (got {got}).",
        INVALID_REQUEST,
        code="unsupported_media_type",
    )


def shutting_down(retry_after_s: float = 1.0) -> APIError:
    """This gateway is stopping: the client should retry, on another replica or after a restart."""
    return APIError(
        503, "The server is shutting down; retry the request.", retry_after_s=retry_after_s
    )


def request_timeout(timeout_s: float) -> APIError:
    return APIError(504, f"The request did not complete within {timeout_s:g} s and was aborted.")


def body_timeout(timeout_s: float) -> APIError:
    return APIError(
        408,
        f"The request body did not arrive within {timeout_s:g} s of the request's start.",
        INVALID_REQUEST,
        code="body_timeout",
    )


def service_unavailable(message: str, retry_after_s: float = UNAVAILABLE_RETRY_AFTER_S) -> APIError:
    """A 503, always with Retry-After: the client should come back, not give up."""
    return APIError(503, message, retry_after_s=retry_after_s)


def bus_unavailable(detail: str = "") -> APIError:
    return service_unavailable(
        "The message bus (NATS) is unreachable from the gateway"
        + (f" ({detail})" if detail else "")
        + "; retry shortly."
    )


def no_progress(timeout_s: float, num_outputs: int, last_heard: str) -> APIError:
    """The request's stream was silent for ``timeout_s``: whoever held it stopped. Before any
    output the request can be retried as it is (503); after, the output is incomplete (502)."""
    if num_outputs == 0:
        return service_unavailable(
            f"The request made no progress for {timeout_s:g} s (last heard from {last_heard}); "
            "the service holding it may have stopped. Retry it."
        )
    return APIError(
        502,
        f"The response stalled for {timeout_s:g} s (last heard from {last_heard}); "
        "the output is incomplete.",
    )
