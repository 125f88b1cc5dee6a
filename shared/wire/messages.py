"""Every message that crosses NATS, one msgspec Struct each, with one encoder/decoder per type.

Frozen, keyword-only; the per-step stream message is array_like (positional on the wire: small and
fast to encode). Pydantic appears only at the HTTP edge, never here.
"""

from __future__ import annotations

import msgspec

from shared.wire.codec import Codec
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
    # ``prompt`` only: encode special-token texts in it as plain text. A chat message's content is
    # always plain text (only the template writes control tokens), whatever this says.
    split_special_tokens: bool = False
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
    # prompt tokens the prefix index said this executor holds (its matched blocks x block size):
    # the executor counts the rest as prefill work ahead of later requests until this one starts
    num_expected_cached_tokens: int = 0
    # Disaggregated: prefill here, sample the first token, stream it, then hand the request (its KV
    # pages) to this decode executor (services/executor/handoff.py). None: run it here to the end.
    decode_executor_id: str | None = None


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


class StreamKeepalive(msgspec.Struct, kw_only=True, frozen=True, tag="keepalive", tag_field="kind"):
    """Whoever holds a request that has nothing to stream yet (tokenizer: queued or tokenizing;
    scheduler: waiting in its queue; executor: not started, or silent since its last output) says
    so on the request's stream every ``KEEPALIVE_INTERVAL_S``. It carries no output: the gateway
    only restarts its progress clock, so a request whose holder died is failed once its stream has
    been silent for the gateway's progress timeout instead of waiting out the request timeout."""

    request_id: str
    holder: str  # the process that holds it: "tokenizer", "scheduler", an executor id
    state: str = ""  # what it waits for there: "tokenizing", "queued", "prefilling", "running"


# How often a holder sends a StreamKeepalive for a request it holds. The gateway's progress timeout
# must be several of these (GatewayConfig checks it), so a slow loop never fails a live request.
KEEPALIVE_INTERVAL_S = 2.0


class KVPageLayout(msgspec.Struct, kw_only=True, frozen=True):
    """What one KV page (a block of every layer, K and V) is made of; pages move only between
    engines whose layouts are equal (shared/engine/kv_transfer.py)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    row: int
    dtype: str


class KVOffer(msgspec.Struct, kw_only=True, frozen=True):
    """Prefill executor → decode executor (request/reply on ``subjects.kv_offer``): a request whose
    first token is out, its pages ready to send. The decode side reserves blocks for the prompt
    (its own cached leading blocks, by block hash, included) before it accepts."""

    request_id: str
    prefill_executor_id: str
    layout: KVPageLayout
    prompt_token_ids: list[int]
    block_hashes: list[int]
    params: SamplingParams
    priority: int
    first_token_id: int
    num_emitted_chars: int
    num_cached_tokens: int
    generator_state: bytes | None
    # Seconds from the offer within which every page must have arrived: past it the decode side
    # frees its reservation and never commits (so the prefill side, which gives up a grace period
    # later, knows the request did not start there).
    timeout_s: float


class KVOfferReply(msgspec.Struct, kw_only=True, frozen=True):
    """Accepted: send pages [num_cached_blocks, end) of the prompt's blocks. Refused (no room, a
    layout or prompt it cannot take, draining): ``reason`` says why; the prefill side decodes the
    request itself."""

    accepted: bool
    num_cached_blocks: int = 0
    reason: str = ""


class KVChunkAck(msgspec.Struct, kw_only=True, frozen=True):
    """Decode executor → prefill executor, the reply to one chunk of pages. The reply to the last
    chunk means every page is installed and the request decodes there: the prefill side frees its
    blocks."""

    ok: bool
    reason: str = ""


# Every message on ``subjects.stream(rid)``, told apart by ``kind``. A reader must accept (skip) the
# variants it has no use for: keepalives were added after outputs and errors.
StreamMessage = StreamOutput | StreamError | StreamKeepalive


class AbortRequest(msgspec.Struct, kw_only=True, frozen=True):
    request_id: str
    reason: str = "client disconnected"


class ExecutorLoad(msgspec.Struct, kw_only=True, frozen=True):
    """What an executor holds, as it counts it: the weight (sequences: n of each request) of the
    requests it accepted and has not finished. ``version`` grows by one at every accept, start and
    finish within an epoch, so of two reports the one with the larger version is the newer.
    It refuses a request that would take ``num_admitted`` past ``max_admitted`` (its max_num_seqs
    plus the queue it advertises), unless it holds nothing."""

    version: int
    num_admitted: int
    max_admitted: int
    # prompt tokens still to prefill of the requests it holds that have not started (each
    # request's prompt less what the index expected cached): work ahead of a new request's prefill
    num_pending_prefill_tokens: int = 0
    peak_num_admitted: int = 0  # the most it has held at once in this epoch
    num_refused: int = 0  # dispatches it refused as full in this epoch


class RequestProgress(msgspec.Struct, kw_only=True, frozen=True):
    """Executor → scheduler. ``state``: 'started' (first delta is about to be published),
    'adopted' (a decode executor installed the pages of a request prefilled elsewhere: it holds the
    request from now on) or 'finished' (finished, aborted, failed or handed off; its in-flight slot
    is free). ``load``: the executor's
    load after it, so every scheduler replica sees the freed room at once, not at the next
    heartbeat."""

    request_id: str
    executor_id: str
    state: str
    load: ExecutorLoad | None = None
    # 'finished' of a request handed off: the decode executor that acknowledged every page (it
    # holds the request now), so a scheduler that sees this before that executor's 'adopted'
    # (progress from two connections is not ordered) still moves the request there.
    handed_to: str | None = None


class ExecuteReply(msgspec.Struct, kw_only=True, frozen=True):
    """Executor → scheduler, the reply to an ExecuteRequest: taken (its output follows on the
    request's stream) or refused because it is full (route it elsewhere or queue it); either way
    with the executor's load after the decision."""

    executor_id: str
    epoch: str
    accepted: bool
    load: ExecutorLoad


class ExecutorMemory(msgspec.Struct, kw_only=True, frozen=True):
    """An executor's memory ledger (shared/engine/memory.py), planned against actual. ``planned_*``:
    what ``llmserve plan`` prints for this executor's settings (weights counted from the
    parameters); the others: what the loaded engine holds. Activations are transient and only
    planned. Fixed once the engine is loaded, except ``process_rss_bytes``."""

    memory_budget_bytes: int  # 0: the KV pool was sized by a block count, not a budget
    weight_dtype: str
    kv_dtype: str
    planned_weight_bytes: int
    planned_activation_bytes: int
    planned_kv_cache_bytes: int
    planned_num_kv_blocks: int
    weight_bytes: int  # resident: packed weights and a tied head's copy included
    kv_cache_bytes: int  # the allocated pool, padding block included
    num_kv_blocks: int  # the pool's blocks, padding block included
    kv_bytes_per_block: int
    process_rss_bytes: int = 0  # the whole process's resident memory when sent (0: unknown)
    max_num_batched_tokens: int = 0  # the step's token budget the activations are planned for


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
    load: ExecutorLoad | None = None  # None: an executor that does not count its admissions
    memory: ExecutorMemory | None = None  # None: an executor that does not report its ledger


class PrefixMatchRequest(msgspec.Struct, kw_only=True, frozen=True):
    """Scheduler → prefix index: which executors of ``model`` hold how much of this prompt."""

    model: str
    block_hashes: list[int]  # the prompt's chained full-block hashes, first block first


class PrefixMatchReply(msgspec.Struct, kw_only=True, frozen=True):
    """``num_blocks[executor_id]``: how many leading blocks of the prompt it holds (executors that
    hold none are absent). ``error``: the index could not answer (Redis unavailable); the caller
    routes without it."""

    num_blocks: dict[str, int]
    error: str | None = None


class PrefixIndexStatusRequest(msgspec.Struct, kw_only=True, frozen=True):
    pass


class PrefixIndexStatus(msgspec.Struct, kw_only=True, frozen=True):
    """One index replica's view: the index's size in Redis and its own apply counters."""

    redis_ok: bool
    num_executors: int  # executors with entries in the index
    num_block_entries: int  # (block hash, executor) pairs, over every model
    num_batches_applied: int  # by this replica, replays excluded
    num_replays: int  # batches this replica found already applied
    num_resyncs: int  # snapshots this replica installed
    num_purges: int  # executors this replica purged (silent, restarted or cleared)
    last_apply_lag_s: float  # publish (stream timestamp) → applied, of the last batch applied


class TokenizerStatusRequest(msgspec.Struct, kw_only=True, frozen=True):
    pass


class TokenizerModelStatus(msgspec.Struct, kw_only=True, frozen=True):
    name: str  # the served model name requests select it by
    max_model_len: int  # prompts longer than this (plus max_tokens) are refused with 400
    block_size: int


class TokenizerStatus(msgspec.Struct, kw_only=True, frozen=True):
    # Every model the tokenizer serves, each with its own limits; a request for any other model
    # ends with 404.
    models: list[TokenizerModelStatus]


class SchedulerStatusRequest(msgspec.Struct, kw_only=True, frozen=True):
    pass


class ExecutorStatus(msgspec.Struct, kw_only=True, frozen=True):
    executor_id: str
    model: str
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    num_in_flight: int  # requests this scheduler replica routed there and has not seen finish
    last_heartbeat_age_s: float
    load_estimate: int = 0  # sequences it holds, as this replica estimates (router/executors.py)
    capacity: int = 0  # the most it accepts
    prefix_cache_queries_tokens: int = 0  # cumulative, from its heartbeat
    prefix_cache_hits_tokens: int = 0
    role: str = "both"  # 'prefill' ones take no whole request (the gateway's health skips them)


class SchedulerStatus(msgspec.Struct, kw_only=True, frozen=True):
    executors: list[ExecutorStatus]
    num_queued: int
    max_queue_len: int
    routing: str = "cache"  # the placement policy
    index_available: bool = True  # False: the prefix index did not answer; routing by load alone
    num_index_fallbacks: int = 0  # requests routed without the index's answer because of that
    index_lookup_ms_p50: float = 0.0  # median prefix-index round trip, of the last 1000 lookups
    num_refused_dispatches: int = 0  # dispatches an executor refused as full (then re-routed)
    # Requests leaving the queue per second while it is not empty, smoothed (0: not measured yet),
    # and the Retry-After a 429 would carry now: the queue's length over that rate.
    drain_rate_per_s: float = 0.0
    retry_after_s: float = 0.0


class MetricSample(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """One sample as prometheus-client names it: ``name`` is the family's name plus its suffix
    (``_total``, ``_bucket``, ``_sum``, ``_count``), ``labels`` include ``le`` on a bucket."""

    name: str
    labels: dict[str, str]
    value: float


class MetricFamilyData(msgspec.Struct, kw_only=True, frozen=True):
    """One metric family of a service's registry: ``type`` is prometheus-client's ('counter',
    'gauge', 'histogram', 'summary'); counters and histogram buckets are cumulative since that
    process started."""

    name: str
    type: str
    documentation: str
    samples: list[MetricSample]


class MetricsReport(msgspec.Struct, kw_only=True, frozen=True):
    """Every service → gateways (publish on ``subjects.metrics(service, instance)`` every
    METRICS_INTERVAL_S): the whole of its metrics registry. A gateway's /metrics re-exports the
    latest report of each live instance, labelled ``service`` and ``instance``; an instance whose
    reports stop is left out (shared/metrics/book.py)."""

    service: str  # the kind: 'gateway', 'tokenizer', 'scheduler', 'executor', 'prefix_index'
    instance: str  # unique per process (an executor: its id)
    sent_at: float  # wall clock
    families: list[MetricFamilyData]


# How often each service publishes its MetricsReport. A gateway drops an instance whose last report
# is older than METRICS_STALE_AFTER_S: several intervals, so one late report does not flap it.
METRICS_INTERVAL_S = 1.0
METRICS_STALE_AFTER_S = 5.0


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
EXECUTE_REPLY = Codec[ExecuteReply](ExecuteReply)
PREFIX_MATCH_REQUEST = Codec[PrefixMatchRequest](PrefixMatchRequest)
PREFIX_MATCH_REPLY = Codec[PrefixMatchReply](PrefixMatchReply)
PREFIX_INDEX_STATUS_REQUEST = Codec[PrefixIndexStatusRequest](PrefixIndexStatusRequest)
PREFIX_INDEX_STATUS = Codec[PrefixIndexStatus](PrefixIndexStatus)
METRICS_REPORT = Codec[MetricsReport](MetricsReport)
KV_OFFER = Codec[KVOffer](KVOffer)
KV_OFFER_REPLY = Codec[KVOfferReply](KVOfferReply)
KV_CHUNK_ACK = Codec[KVChunkAck](KVChunkAck)

__all__ = [
    "ABORT_REQUEST",
    "EXECUTE_REPLY",
    "EXECUTE_REQUEST",
    "EXECUTOR_HEARTBEAT",
    "GENERATE_REQUEST",
    "KEEPALIVE_INTERVAL_S",
    "METRICS_INTERVAL_S",
    "METRICS_REPORT",
    "METRICS_STALE_AFTER_S",
    "PREFIX_INDEX_STATUS",
    "PREFIX_INDEX_STATUS_REQUEST",
    "PREFIX_MATCH_REPLY",
    "PREFIX_MATCH_REQUEST",
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
    "ExecuteReply",
    "ExecuteRequest",
    "ExecutorHeartbeat",
    "ExecutorLoad",
    "ExecutorStatus",
    "GenerateRequest",
    "MetricFamilyData",
    "MetricSample",
    "MetricsReport",
    "PrefixIndexStatus",
    "PrefixIndexStatusRequest",
    "PrefixMatchReply",
    "PrefixMatchRequest",
    "RequestOutput",
    "RequestProgress",
    "SamplingParams",
    "SchedulerStatus",
    "SchedulerStatusRequest",
    "StreamError",
    "StreamKeepalive",
    "StreamMessage",
    "StreamOutput",
    "TokenLogprobs",
    "TokenizedRequest",
]
