"""Turn a ``GenerateRequest`` into a validated ``TokenizedRequest``: pick the requested model's
tokenizer, render chat messages with its template, encode, check the length against its context,
hash the full blocks with its block size.

Pure logic (no NATS, no asyncio); every rejection is a ``PromptError`` carrying the OpenAI error
fields the gateway returns (400 ``invalid_request_error`` and the offending parameter; 404 for a
model this tokenizer does not serve, as the scheduler answers for one no executor serves).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.engine.tokenizer import ChatTemplateError, Tokenizer, read_gguf_metadata
from shared.field_checks import require_at_least
from shared.wire.block_hash import hash_prompt_blocks
from shared.wire.messages import GenerateRequest, StreamError, TokenizedRequest


class PromptError(ValueError):
    status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def to_stream_error(self, request_id: str) -> StreamError:
        return StreamError(
            request_id=request_id,
            status=self.status,
            type="invalid_request_error",
            message=str(self),
            param=self.param,
        )


class UnknownModelError(PromptError):
    """A model this tokenizer does not serve: the scheduler's 404, in the same words."""

    status = 404

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__(
            f"The model '{model}' does not exist. This server serves '{', '.join(served)}'.",
            "model",
        )


# A prompt that fits the context averages far fewer characters per token (English ~4, code ~3);
# the cap only has to stop a text that cannot fit before it is tokenized (time grows with its
# length: ~1 s per million characters here, and a 7 MB prompt held a tokenizer for 13-25 s).
MAX_PROMPT_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class PromptLimits:
    """``max_prompt_chars``: the most characters a prompt (or all messages' contents together) may
    have, checked before tokenizing; None: ``MAX_PROMPT_CHARS_PER_TOKEN`` x the context."""

    max_model_len: int
    block_size: int = 16
    max_prompt_chars: int | None = None

    def __post_init__(self) -> None:
        require_at_least(self, 2, "max_model_len")
        require_at_least(self, 1, "block_size")
        if self.max_prompt_chars is None:
            object.__setattr__(
                self, "max_prompt_chars", MAX_PROMPT_CHARS_PER_TOKEN * self.max_model_len
            )
        elif self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")

    @property
    def prompt_char_cap(self) -> int:
        assert self.max_prompt_chars is not None  # set in __post_init__
        return self.max_prompt_chars


@dataclass(frozen=True)
class ModelTokenizer:
    """One served model's tokenizer and the limits its executors enforce."""

    tokenizer: Tokenizer
    limits: PromptLimits


def select_model(models: Mapping[str, ModelTokenizer], model: str) -> ModelTokenizer:
    found = models.get(model)
    if found is None:
        raise UnknownModelError(model, sorted(models))
    return found


def model_context_len(model: str) -> int:
    """The model's trained context length, read from its metadata (default 2048, like the
    loader)."""
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        with open(path) as f:
            config: dict[str, Any] = json.load(f)
        return int(config.get("max_position_embeddings", 2048))
    metadata = read_gguf_metadata(model)
    arch = metadata.get("general.architecture", "llama")
    return int(metadata.get(f"{arch}.context_length", 2048))


def _encode_chat(req: GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    assert req.messages is not None
    messages = [{"role": m.role, "content": m.content} for m in req.messages]
    try:
        # Content is plain text: only the template writes control tokens (no role forgery).
        return tokenizer.encode_chat(messages, add_generation_prompt=req.add_generation_prompt)
    except ChatTemplateError as e:
        raise PromptError(f"cannot render the chat template: {e}", "messages") from e


def check_prompt_size(req: GenerateRequest, limits: PromptLimits) -> None:
    """Refuse a text that cannot fit the context before spending time tokenizing it."""
    cap = limits.prompt_char_cap
    if req.messages is not None:
        # Each message renders to at least one token in any template.
        if len(req.messages) >= limits.max_model_len:
            raise PromptError(
                f"The request has {len(req.messages)} messages; this model's context of "
                f"{limits.max_model_len} tokens cannot hold more than {limits.max_model_len - 1}.",
                "messages",
            )
        num_chars, param, what = sum(len(m.content) for m in req.messages), "messages", "messages"
    elif req.prompt is not None:
        num_chars, param, what = len(req.prompt), "prompt", "prompt"
    else:
        return
    if num_chars > cap:
        raise PromptError(
            f"The {what} {'hold' if what == 'messages' else 'has'} {num_chars} characters; this "
            f"model accepts at most {cap} characters (its context is {limits.max_model_len} "
            f"tokens). Please shorten the {what}.",
            param,
        )


def prompt_token_ids(req: GenerateRequest, tokenizer: Tokenizer) -> tuple[list[int], str]:
    """The prompt's ids and the name of the parameter they came from."""
    given = [
        name
        for name in ("prompt", "prompt_token_ids", "messages")
        if getattr(req, name) is not None
    ]
    if len(given) != 1:
        raise PromptError(
            f"exactly one of prompt, prompt_token_ids or messages must be given, got "
            f"{', '.join(given) or 'none'}",
            "prompt",
        )
    if req.messages is not None:
        if not req.messages:
            raise PromptError("messages must not be empty", "messages")
        return _encode_chat(req, tokenizer), "messages"
    if req.prompt is not None:
        if not req.prompt:
            raise PromptError("prompt must not be empty", "prompt")
        return tokenizer.encode(
            req.prompt, add_special_tokens=True, split_special_tokens=req.split_special_tokens
        ), "prompt"
    ids = list(req.prompt_token_ids or [])
    bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise PromptError(
            f"prompt token ids must be in [0, {tokenizer.vocab_size}); got {bad[:5]}", "prompt"
        )
    return ids, "prompt"


def tokenize_request(
    req: GenerateRequest, tokenizer: Tokenizer, limits: PromptLimits
) -> TokenizedRequest:
    check_prompt_size(req, limits)
    ids, param = prompt_token_ids(req, tokenizer)
    if not ids:
        raise PromptError(f"the {param} encodes to zero tokens", param)
    max_tokens = req.params.max_tokens
    num_prompt = len(ids)
    # The prompt must leave room for at least one generated token.
    if num_prompt >= limits.max_model_len or num_prompt + (max_tokens or 0) > limits.max_model_len:
        where = "in the messages" if param == "messages" else "in the prompt"
        raise PromptError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
            f"requested {num_prompt + (max_tokens or 0)} tokens ({num_prompt} {where}, "
            f"{max_tokens or 0} for the completion). Please reduce the length of the {param} "
            f"or the completion (max_tokens).",
            param if num_prompt >= limits.max_model_len or not max_tokens else "max_tokens",
        )
    return TokenizedRequest(
        request_id=req.request_id,
        model=req.model,
        prompt_token_ids=ids,
        block_hashes=hash_prompt_blocks(ids, limits.block_size),
        params=req.params,
        priority=req.priority,
        arrival_time=req.arrival_time,
        deadline=req.deadline,
    )
