"""OpenAI ⇄ llmserve conversions, pure and synchronous (no NATS, no asyncio, no HTTP).

Inbound: a validated OpenAI request body → ``GenerateRequest`` (with ``SamplingParams`` as the
single range check; its ValueErrors become 400s naming the field). Outbound: the ``RequestOutput``
deltas a request's stream carries → OpenAI chunk objects (streaming) or one response object
(non-streaming), in OpenAI's exact shapes:

  completions  text_completion          choices[i] = {text, index, logprobs, finish_reason}
  chat         chat.completion(.chunk)  choices[i] = {index, message|delta, logprobs, finish_reason}

Deltas already hold detokenized text with stop strings removed and logprobs with their tokens'
text (named by the executor, which decodes); this module only concatenates, counts tokens and
formats logprobs. The gateway loads no vocabulary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from shared.wire.messages import ChatMessage, GenerateRequest
from shared.wire.outputs import CompletionDelta, RequestOutput, TokenLogprobs
from shared.wire.sampling_params import MAX_INT32, SamplingParams

from .errors import bad_request
from .openai_schema import ChatCompletionRequest, CompletionRequest

Api = Literal["completion", "chat"]

# OpenAI's default for the legacy completions endpoint; chat defaults to "until the context is
# full".
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


# JSON has no -inf; a token with zero probability gets vLLM's stand-in value.
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN (comparison false)


def token_name(token_id: int, text: str | None) -> str:
    """A logprobs token as the API shows it: its text, or (none given) vLLM's
    return_tokens_as_token_ids format."""
    return text if text is not None else f"token_id:{token_id}"


def _top(lp: TokenLogprobs) -> list[tuple[str, float]]:
    """The top alternatives as (name, logprob), in the sampler's order."""
    texts = lp.top_tokens if lp.top_tokens is not None else [None] * len(lp.top)
    if len(texts) != len(lp.top):
        raise ValueError(
            f"logprobs of token {lp.token_id}: {len(lp.top)} top tokens, {len(texts)} names"
        )
    return [(token_name(t, text), p) for (t, p), text in zip(lp.top, texts, strict=True)]


# --------------------------------------------------------------------------------------- inbound


@dataclass(frozen=True)
class Limits:
    """The gateway's limits on a request. The model name is checked before conversion, against the
    served set (Gateway.check_model), and carried on unchanged."""

    max_tokens_default: int | None  # None: per API (16 for completions, unlimited for chat)


_FIELD_AT_START = re.compile(r"^(\w+)")


def make_sampling_params(
    fields: dict[str, Any], renames: dict[str, str] | None = None
) -> SamplingParams:
    """``SamplingParams(**fields)``, None values meaning "default" (except max_tokens, where None
    means "until the context is full"). A ValueError becomes a 400 whose param is the offending
    field, renamed to the name the client used (``renames``)."""
    renames = renames or {}
    try:
        return SamplingParams(
            **{k: v for k, v in fields.items() if v is not None or k == "max_tokens"}
        )
    except (ValueError, TypeError) as e:
        message = str(e)
        m = _FIELD_AT_START.match(message)
        param = m.group(1) if m and m.group(1) in SamplingParams.__struct_fields__ else None
        if param in renames:
            message = renames[param] + message[len(param) :]
            param = renames[param]
        raise bad_request(message, param) from None


def _common_fields(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server.", "logit_bias")
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    return {
        "n": req.n,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "seed": req.seed,
        "stop": stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "speculative": req.speculative,
    }


def _priority(priority: int | None) -> int:
    """The scheduler orders by it (lower first); bounded so it fits the wire and the sort key."""
    if priority is None:
        return 0
    if not -MAX_INT32 <= priority <= MAX_INT32:
        raise bad_request(
            f"priority must be an integer in [{-MAX_INT32}, {MAX_INT32}].", "priority"
        )
    return priority


def _single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """One prompt: a string or a non-empty list of token ids. A batch of one is unwrapped."""
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise bad_request("prompt must not be an empty list.", "prompt")
    if isinstance(prompt[0], int):
        ids: list[int] = prompt
        # The tokenizer checks them against the vocabulary; here only what the wire can carry.
        if any(not 0 <= t <= MAX_INT32 for t in ids):
            raise bad_request(f"prompt token ids must be integers in [0, {MAX_INT32}].", "prompt")
        return ids
    if len(prompt) > 1:
        raise bad_request(
            f"A list of {len(prompt)} prompts is not supported: send one prompt per request.",
            "prompt",
        )
    return _single_prompt(prompt[0])


def completion_to_generate(
    req: CompletionRequest,
    *,
    request_id: str,
    limits: Limits,
    arrival_time: float,
    deadline: float | None,
) -> GenerateRequest:
    if req.echo:
        raise bad_request("echo is not supported by this server.", "echo")
    if req.suffix:
        raise bad_request("suffix is not supported by this server.", "suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("best_of other than n is not supported by this server.", "best_of")
    prompt = _single_prompt(req.prompt)
    max_tokens = (
        req.max_tokens
        if req.max_tokens is not None
        else (limits.max_tokens_default or COMPLETIONS_DEFAULT_MAX_TOKENS)
    )
    params = make_sampling_params(
        {**_common_fields(req), "max_tokens": max_tokens, "logprobs": req.logprobs}
    )
    return GenerateRequest(
        request_id=request_id,
        model=req.model,
        params=params,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=prompt if isinstance(prompt, list) else None,
        split_special_tokens=bool(req.split_special_tokens),
        priority=_priority(req.priority),
        arrival_time=arrival_time,
        deadline=deadline,
    )


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)  # text parts, joined as vLLM joins them


def chat_to_generate(
    req: ChatCompletionRequest,
    *,
    request_id: str,
    limits: Limits,
    arrival_time: float,
    deadline: float | None,
) -> GenerateRequest:
    if req.tools:
        raise bad_request("tools are not supported by this server.", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request('Only response_format {"type": "text"} is supported.', "response_format")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
    # max_completion_tokens replaces the deprecated max_tokens; both are accepted.
    max_tokens_param = (
        "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    )
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    if max_tokens is None:
        max_tokens = limits.max_tokens_default
    params = make_sampling_params(
        {
            **_common_fields(req),
            "max_tokens": max_tokens,
            "logprobs": (req.top_logprobs or 0) if req.logprobs else None,
        },
        renames={"logprobs": "top_logprobs", "max_tokens": max_tokens_param},
    )
    # 'developer' is OpenAI's newer name for 'system'; model chat templates only know 'system'.
    messages = [
        ChatMessage(
            role="system" if m.role == "developer" else m.role, content=_message_text(m.content)
        )
        for m in req.messages
    ]
    return GenerateRequest(
        request_id=request_id,
        model=req.model,
        params=params,
        messages=messages,
        add_generation_prompt=req.add_generation_prompt is not False,
        priority=_priority(req.priority),
        arrival_time=arrival_time,
        deadline=deadline,
    )


# -------------------------------------------------------------------------------------- outbound


@dataclass(frozen=True)
class ResponseSpec:
    """What shapes a request's output: fixed for the request's lifetime."""

    api: Api
    request_id: str
    model: str
    created: int
    n: int
    logprobs: int | None  # None: no logprobs; N: chosen token + top N alternatives
    include_usage: bool = False  # stream_options.include_usage (streaming only)


@dataclass
class _Choice:
    texts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    num_chars: int = 0  # running text_offset for completions logprobs
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None


class ResponseBuilder:
    """Accumulates one request's outputs; renders stream chunks as they come and the final
    response / usage at the end. Invariant: every delta is applied exactly once, in stream order."""

    def __init__(self, spec: ResponseSpec) -> None:
        self.spec = spec
        self._choices = [_Choice() for _ in range(spec.n)]
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0
        self._started = False
        self.finished = False

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_tokens for c in self._choices)

    def apply(self, out: RequestOutput, *, render: bool = True) -> list[dict[str, Any]]:
        """Record one step's output; returns its stream chunks (none when ``render`` is False)."""
        spec = self.spec
        self._num_prompt_tokens = out.num_prompt_tokens
        self._num_cached_tokens = out.num_cached_tokens
        chunks: list[dict[str, Any]] = []
        if render and spec.api == "chat" and not self._started:
            # OpenAI opens every choice with a role-only delta.
            chunks.extend(
                self._chunk(i, {"role": "assistant", "content": ""}, None, None)
                for i in range(spec.n)
            )
        self._started = True
        for delta in out.deltas:
            if not 0 <= delta.index < spec.n:
                raise ValueError(f"delta for choice {delta.index} of a request with n={spec.n}")
            choice = self._choices[delta.index]
            choice.num_tokens += len(delta.token_ids)
            choice.texts.append(delta.text)
            lp = self._render_logprobs(choice, delta)
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason
            if render and (delta.text or delta.finish_reason is not None or lp is not None):
                chunks.append(self._delta_chunk(delta, lp))
        if out.finished:
            self.finished = True
        return chunks

    # -- rendering -----------------------------------------------------------------------------

    def _chunk(
        self, index: int, body: dict[str, Any] | str, logprobs: Any, finish_reason: str | None
    ) -> dict[str, Any]:
        spec = self.spec
        if spec.api == "chat":
            choice = {
                "index": index,
                "delta": body,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            obj = "chat.completion.chunk"
        else:
            choice = {
                "text": body,
                "index": index,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            obj = "text_completion"
        chunk = {
            "id": spec.request_id,
            "object": obj,
            "created": spec.created,
            "model": spec.model,
            "system_fingerprint": None,
            "choices": [choice],
        }
        if spec.include_usage:
            chunk["usage"] = (
                None  # OpenAI: null on every chunk but the last when usage is asked for
            )
        return chunk

    def _delta_chunk(self, delta: CompletionDelta, logprobs: Any) -> dict[str, Any]:
        if self.spec.api == "chat":
            body: dict[str, Any] | str = {"content": delta.text} if delta.text else {}
        else:
            body = delta.text
        return self._chunk(delta.index, body, logprobs, delta.finish_reason)

    def _render_logprobs(self, choice: _Choice, delta: CompletionDelta) -> Any:
        """This delta's logprobs in the API's format (also appended to the choice's full list)."""
        if self.spec.logprobs is None or not delta.logprobs:
            return None
        if self.spec.api == "chat":
            entries = [self._chat_logprob(lp) for lp in delta.logprobs]
            choice.logprobs.extend(entries)
            return {"content": entries, "refusal": None}
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for lp in delta.logprobs:
            text = token_name(lp.token_id, lp.token)
            tokens.append(text)
            token_logprobs.append(_finite(lp.logprob))
            # OpenAI: the top N, plus the sampled token (so up to N + 1 entries).
            top = {name: _finite(p) for name, p in _top(lp)}
            top.setdefault(text, _finite(lp.logprob))
            top_logprobs.append(top)
            offsets.append(choice.num_chars)
            choice.num_chars += len(text)
        rendered = {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }
        choice.logprobs.append(rendered)
        return rendered

    def _chat_logprob(self, lp: TokenLogprobs) -> dict[str, Any]:
        def entry(text: str, logprob: float) -> dict[str, Any]:
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

        return {
            **entry(token_name(lp.token_id, lp.token), lp.logprob),
            "top_logprobs": [entry(name, p) for name, p in _top(lp)],
        }

    # -- the end -------------------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        completion = self.num_output_tokens
        return {
            "prompt_tokens": self._num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self._num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self._num_cached_tokens},
        }

    def usage_chunk(self) -> dict[str, Any]:
        """The extra last chunk of stream_options.include_usage: no choices, the whole usage."""
        spec = self.spec
        obj = "chat.completion.chunk" if spec.api == "chat" else "text_completion"
        return {
            "id": spec.request_id,
            "object": obj,
            "created": spec.created,
            "model": spec.model,
            "system_fingerprint": None,
            "choices": [],
            "usage": self.usage(),
        }

    def response(self) -> dict[str, Any]:
        """The non-streaming response object."""
        spec = self.spec
        choices: list[dict[str, Any]] = []
        for i, c in enumerate(self._choices):
            text = "".join(c.texts)
            if spec.api == "chat":
                logprobs = (
                    {"content": c.logprobs, "refusal": None} if spec.logprobs is not None else None
                )
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": text, "refusal": None},
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "text": text,
                        "index": i,
                        "logprobs": _merge_completion_logprobs(c.logprobs)
                        if spec.logprobs is not None
                        else None,
                        "finish_reason": c.finish_reason,
                    }
                )
        obj = "chat.completion" if spec.api == "chat" else "text_completion"
        return {
            "id": spec.request_id,
            "object": obj,
            "created": spec.created,
            "model": spec.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": self.usage(),
        }


def _merge_completion_logprobs(parts: list[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    merged: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for part in parts:
        for key, values in part.items():
            merged[key].extend(values)
    return merged
