"""Every message that crosses NATS, one msgspec Struct each, with one encoder/decoder per type.

Frozen, keyword-only; the per-step stream message is array_like (positional on the wire: small and
fast to encode). Pydantic appears only at the HTTP edge, never here.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from shared.wire.outputs import CompletionDelta, EngineStats, RequestOutput, TokenLogprobs
from shared.wire.sampling_params import SamplingParams


class ChatMessage(msgspec.Struct, kw_only=True, frozen=True):
    role: str
    content: str


class GenerateRequest(msgspec.Struct, kw_only=True, frozen=True):
    """Gateway → tokenizer. Exactly one of ``prompt`` (text), ``prompt_token_ids`` or ``messages``
    (chat, rendered with the model's template) is set."""

    request_id: str
    model: str  # a served model name, checked by the gateway
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    priority: int = 0
    arrival_time: float = 0.0  # gateway wall clock (time.time()), for queue-time metrics
    deadline: float | None = None  # wall clock after which the request is abandoned


class TokenizedRequest(msgspec.Struct, kw_only=True, frozen=True):
    """Tokenizer → scheduler: the prompt as ids and the chained hashes of its full blocks
    (shared/wire/block_hash.py: one per full block, ``len(prompt_token_ids) // block_size``)."""

    request_id: str
    model: str  # the served model name the client asked for; routing follows it
    prompt_token_ids: list[int]
    block_hashes: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    deadline: float | None = None


class ExecuteRequest(msgspec.Struct, kw_only=True, frozen=True):
    """Scheduler → executor: run this request to completion and stream its deltas.

    ``block_hashes`` are the tokenizer's, passed on unchanged: the engine uses them instead of
    hashing the prompt again, and rejects a request whose hash count is not its prompt's full-block
    count."""

    request_id: str
    model: str  # the executor it is sent to serves it (the router's invariant)
    prompt_token_ids: list[int]
    block_hashes: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    attempt: int = 0  # > 0 when re-routed after an executor died


class StreamError(msgspec.Struct, kw_only=True, frozen=True, tag="error", tag_field="kind"):
    """Ends a request with an error. ``status`` is the HTTP status the gateway answers with (or puts
    in the SSE error event once streaming has begun); ``retry_after_s`` goes to Retry-After on
    429."""

    request_id: str
    status: int
    message: str
    type: str = "server_error"
    param: str | None = None
    retry_after_s: float | None = None


class StreamOutput(msgspec.Struct, kw_only=True, frozen=True, tag="output", tag_field="kind"):
    """Executor → gateway, one per request per step."""

    executor_id: str
    output: RequestOutput


StreamMessage = StreamOutput | StreamError


class AbortRequest(msgspec.Struct, kw_only=True, frozen=True):
    request_id: str
    reason: str = "client disconnected"


class RequestProgress(msgspec.Struct, kw_only=True, frozen=True):
    """Executor → scheduler. ``state``: 'started' (first delta is about to be published) or
    'finished' (finished, aborted or failed; its in-flight slot is free)."""

    request_id: str
    executor_id: str
    state: str


class ExecutorHeartbeat(msgspec.Struct, kw_only=True, frozen=True):
    """Executor → scheduler (and anyone else), every ~0.5 s. A new ``epoch`` means the executor
    restarted and its previous state (KV cache, requests) is gone."""

    executor_id: str
    epoch: str
    role: str  # 'prefill' | 'decode' | 'both'
    model: str  # the served model name: only requests for it are routed here
    max_model_len: int
    block_size: int
    stats: EngineStats
    sent_at: float
    max_num_seqs: int = 0  # the engine's batch limit: the scheduler's in-flight cap (0 = unknown)
    draining: bool = False  # shutting down: finishing what it holds, route nothing new to it


class TokenizerStatusRequest(msgspec.Struct, kw_only=True, frozen=True):
    pass


class TokenizerStatus(msgspec.Struct, kw_only=True, frozen=True):
    max_model_len: int  # prompts longer than this (plus max_tokens) are refused with 400
    block_size: int


class SchedulerStatusRequest(msgspec.Struct, kw_only=True, frozen=True):
    pass


class ExecutorStatus(msgspec.Struct, kw_only=True, frozen=True):
    executor_id: str
    model: str
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    num_in_flight: int
    last_heartbeat_age_s: float


class SchedulerStatus(msgspec.Struct, kw_only=True, frozen=True):
    executors: list[ExecutorStatus]
    num_queued: int
    max_queue_len: int


T = TypeVar("T")


class Codec(Generic[T]):
    """msgpack encoder/decoder pair for one message type, built once."""

    _encoder = msgspec.msgpack.Encoder()

    def __init__(self, type_: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_)

    def encode(self, msg: T) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes) -> T:
        return self._decoder.decode(data)


GENERATE_REQUEST = Codec[GenerateRequest](GenerateRequest)
TOKENIZED_REQUEST = Codec[TokenizedRequest](TokenizedRequest)
EXECUTE_REQUEST = Codec[ExecuteRequest](ExecuteRequest)
STREAM_MESSAGE = Codec[StreamMessage](StreamMessage)
ABORT_REQUEST = Codec[AbortRequest](AbortRequest)
REQUEST_PROGRESS = Codec[RequestProgress](RequestProgress)
EXECUTOR_HEARTBEAT = Codec[ExecutorHeartbeat](ExecutorHeartbeat)
TOKENIZER_STATUS_REQUEST = Codec[TokenizerStatusRequest](TokenizerStatusRequest)
TOKENIZER_STATUS = Codec[TokenizerStatus](TokenizerStatus)
SCHEDULER_STATUS_REQUEST = Codec[SchedulerStatusRequest](SchedulerStatusRequest)
SCHEDULER_STATUS = Codec[SchedulerStatus](SchedulerStatus)

__all__ = [
    "ABORT_REQUEST",
    "EXECUTE_REQUEST",
    "EXECUTOR_HEARTBEAT",
    "GENERATE_REQUEST",
    "REQUEST_PROGRESS",
    "SCHEDULER_STATUS",
    "SCHEDULER_STATUS_REQUEST",
    "STREAM_MESSAGE",
    "TOKENIZED_REQUEST",
    "AbortRequest",
    "ChatMessage",
    "Codec",
    "CompletionDelta",
    "EngineStats",
    "ExecuteRequest",
    "ExecutorHeartbeat",
    "ExecutorStatus",
    "GenerateRequest",
    "RequestOutput",
    "RequestProgress",
    "SamplingParams",
    "SchedulerStatus",
    "SchedulerStatusRequest",
    "StreamError",
    "StreamMessage",
    "StreamOutput",
    "TokenLogprobs",
    "TokenizedRequest",
]
