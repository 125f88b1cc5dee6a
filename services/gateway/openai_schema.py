"""Pydantic models of the OpenAI request bodies: the HTTP edge only (never on the wire).

They check *types* (strictly: ``"5"`` is not an integer, ``true`` is not 1, ``5.0`` is not a
max_tokens); *ranges* are checked once, by ``SamplingParams.__post_init__`` (see protocol.py), so
there is a single definition of a valid temperature or top_p. Unknown fields are ignored: OpenAI
clients send extras this server has no use for. Fields a client may send as ``null`` accept None.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import INVALID_REQUEST, APIError, bad_request

MAX_JSON_DEPTH = 200

__all__ = [
    "JSON_TOO_DEEP",
    "MAX_JSON_DEPTH",
    "ChatCompletionRequest",
    "ChatMessageIn",
    "CompletionRequest",
    "StreamOptions",
    "parse_chat_request",
    "parse_completion_request",
    "parse_json_object",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class StreamOptions(_Model):
    include_usage: bool | None = False


class _CommonRequest(_Model):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extensions)."""

    model: str
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    # False: no speculative decoding for this request (same output, decoded a token a step).
    speculative: bool | None = True
    priority: int | None = 0


class CompletionRequest(_CommonRequest):
    # A string, a list of token ids, or (a batch) a list of either.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    # Special-token texts in the prompt ("<|im_start|>") are those tokens by default, as vLLM and
    # llama.cpp parse them in a raw prompt; true: the prompt is plain text (HF's and vLLM's name).
    # A chat message's content is always plain text.
    split_special_tokens: bool | None = False


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessageIn(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Plain text, or OpenAI's content-part list restricted to text parts.
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM extension: render the assistant turn's opening (the normal case for a chat request).
    add_generation_prompt: bool | None = True


# Messages for fields whose union types make pydantic's own error unreadable.
_FIELD_HINTS: dict[str, str] = {
    "prompt": "must be a string, a list of token ids, or a list of one of those",
    "stop": "must be a string or a list of strings",
    "content": 'must be a string or a list of {"type": "text", "text": ...} parts',
    "stream_options": 'must be an object like {"include_usage": true}',
}


# pydantic's JSON parser (jiter) refuses nesting deeper than 200 levels with this message, before
# any recursion of ours: the depth limit of every JSON the gateway reads (HTTP and WebSocket).
_TOO_DEEP = "recursion limit exceeded"


JSON_TOO_DEEP = "json_too_deep"


def too_deep() -> APIError:
    return APIError(
        400,
        f"The JSON is nested too deeply (at most {MAX_JSON_DEPTH} levels).",
        INVALID_REQUEST,
        code=JSON_TOO_DEEP,
    )


def parse_json_object(data: bytes) -> dict[str, Any]:
    """A JSON object, parsed with the same depth limit as the request bodies; APIError 400."""
    try:
        obj = pydantic_core.from_json(data)
    except ValueError as e:
        if _TOO_DEEP in str(e):
            raise too_deep() from None
        raise bad_request(f"The request is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request("The request must be a JSON object.")
    return obj


def _edge_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        if _TOO_DEEP in first["msg"]:
            return too_deep()
        return bad_request(f"The request body is not valid JSON: {first['msg']}")
    if first["type"] == "model_type" and not first["loc"]:
        return bad_request("The request body must be a JSON object.")
    loc = [str(p) for p in first["loc"]]
    param = loc[0] if loc else None
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{'.'.join(loc)}'.", param)
    for i, part in enumerate(loc):
        if part in _FIELD_HINTS:  # cut pydantic's union-member tags ("prompt.str") off the path
            return bad_request(f"Invalid '{'.'.join(loc[: i + 1])}': {_FIELD_HINTS[part]}.", param)
    return bad_request(f"Invalid '{'.'.join(loc)}': {first['msg']}.", param)


def parse_completion_request(body: bytes) -> CompletionRequest:
    """The validated body of a completions request; ``APIError`` 400 on malformed JSON or types."""
    try:
        return CompletionRequest.model_validate_json(body)
    except ValidationError as e:
        raise _edge_error(e) from None


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """The validated body of a chat completions request; ``APIError`` 400 as above."""
    try:
        return ChatCompletionRequest.model_validate_json(body)
    except ValidationError as e:
        raise _edge_error(e) from None
