"""Every NATS subject llmserve uses: versioned ``llm.v1.<service>.<verb>``. No subject string may
appear anywhere else; build them here. Queue group = the service name."""

from __future__ import annotations

PREFIX = "llm.v1"

# Gateway → tokenizer (request/reply, queue group "tokenizer"): GenerateRequest → an empty ack, sent
# when a tokenizer takes the request; its output then comes on the request's stream subject. With no
# tokenizer listening, NATS answers "no responders" at once and the gateway returns 503.
TOKENIZER_GENERATE = f"{PREFIX}.tokenizer.generate"
# Anyone → tokenizer (request/reply, queue group "tokenizer"): TokenizerStatusRequest →
# TokenizerStatus (the gateway's /health).
TOKENIZER_STATUS = f"{PREFIX}.tokenizer.status"
# Tokenizer → scheduler (request/reply, queue group "scheduler"): TokenizedRequest → an empty ack
# once routed (dispatched, queued or failed on the request's stream); "no responders": no scheduler
# runs.
SCHEDULER_SUBMIT = f"{PREFIX}.scheduler.submit"
# Executor → scheduler (publish): RequestProgress, when a request streams its first token and when
# it finishes, so in-flight load and fail-over know what each executor holds.
SCHEDULER_PROGRESS = f"{PREFIX}.scheduler.progress"
# Anyone → scheduler (request/reply): SchedulerStatusRequest → SchedulerStatus.
SCHEDULER_STATUS = f"{PREFIX}.scheduler.status"
# Gateway → everyone (publish, fan-out): AbortRequest.
ABORT = f"{PREFIX}.abort"
# Scheduler → prefix index (request/reply, queue group "prefix_index"): PrefixMatchRequest →
# PrefixMatchReply, how many leading blocks of a prompt each executor holds.
PREFIX_INDEX_MATCH = f"{PREFIX}.prefix_index.match"
# Anyone → prefix index (request/reply, queue group "prefix_index"): PrefixIndexStatusRequest →
# PrefixIndexStatus (size, apply lag, whether Redis answers).
PREFIX_INDEX_STATUS = f"{PREFIX}.prefix_index.status"
# Every executor's heartbeat, for wildcard subscribers.
EXECUTOR_STATS_ALL = f"{PREFIX}.executor.*.stats"
# Every executor's work and snapshot subjects (executor_decode, executor_kv_snapshot), for the NATS
# permissions (shared/wire/permissions.py): who may send to, or listen as, any executor.
EXECUTOR_DECODE_ALL = f"{PREFIX}.executor.*.decode"
EXECUTOR_KV_SNAPSHOT_ALL = f"{PREFIX}.executor.*.kv_snapshot"
EXECUTOR_KV_OFFER_ALL = f"{PREFIX}.executor.*.kv_offer"
# Every KV page transfer (kv_pages), for the permissions: executors send pages to any executor.
KV_PAGES_ALL = f"{PREFIX}.kv.*.*"
# Every executor's KV events, for wildcard subscribers (the prefix index): see kv_events().
KV_EVENTS_ALL = f"{PREFIX}.kv_events.*"
# Every service's MetricsReport (see metrics()), for the gateways' /metrics.
METRICS_ALL = f"{PREFIX}.metrics.*.*"
# Token deltas of every request, for wildcard subscribers (the gateway's permission, tests).
STREAM_ALL = f"{PREFIX}.stream.*"

QUEUE_TOKENIZER = "tokenizer"
QUEUE_SCHEDULER = "scheduler"
# The prefix index's queue group, and the name of its durable JetStream consumer (one consumer
# group: every replica pulls from it, each batch is applied by one of them).
QUEUE_PREFIX_INDEX = "prefix_index"

# The JetStream stream that keeps every executor's KV event batches (subjects KV_EVENTS_ALL), so a
# prefix index that restarts replays what it missed.
KV_EVENTS_STREAM = "LLMSERVE_KV_EVENTS"


def _token(value: str, what: str) -> str:
    # A subject token may not contain separators or wildcards, or it would address other subjects.
    if not value or any(c in value for c in ".*> \t\r\n"):
        raise ValueError(f"invalid {what} for a NATS subject: {value!r}")
    return value


def executor_decode(executor_id: str) -> str:
    """Work assignments for an executor that runs the whole request (role 'decode' or 'both')."""
    return f"{PREFIX}.executor.{_token(executor_id, 'executor id')}.decode"


def executor_kv_snapshot(executor_id: str) -> str:
    """Prefix index → one executor (request/reply): KVSnapshotRequest → KVCacheSnapshot, its whole
    set of cached block hashes, to resynchronise after a gap in its event batches."""
    return f"{PREFIX}.executor.{_token(executor_id, 'executor id')}.kv_snapshot"


def executor_stats(executor_id: str) -> str:
    return f"{PREFIX}.executor.{_token(executor_id, 'executor id')}.stats"


def stream(request_id: str) -> str:
    """Token deltas, final usage or an error for one request; the gateway subscribes before
    dispatch."""
    return f"{PREFIX}.stream.{_token(request_id, 'request id')}"


def kv_events(executor_id: str) -> str:
    """Executor → prefix index (publish, kept by the KV_EVENTS_STREAM JetStream stream): a
    KVEventsMessage after every step that changed its cached blocks; its batch's seq counts that
    executor's batches (a new epoch starts it again at 1)."""
    return f"{PREFIX}.kv_events.{_token(executor_id, 'executor id')}"


def metrics(service: str, instance: str) -> str:
    """A service instance → every gateway (publish, fan-out): its MetricsReport, periodically."""
    return f"{PREFIX}.metrics.{_token(service, 'service')}.{_token(instance, 'instance')}"


def metrics_of(service: str) -> str:
    """Every instance of one kind of service's reports: what that kind may publish."""
    return f"{PREFIX}.metrics.{_token(service, 'service')}.*"


def executor_kv_offer(executor_id: str) -> str:
    """Prefill executor → decode executor (request/reply): KVOffer → KVOfferReply."""
    return f"{PREFIX}.executor.{_token(executor_id, 'executor id')}.kv_offer"


def kv_pages(decode_executor_id: str, request_id: str) -> str:
    """Prefill executor → decode executor (request/reply per chunk): one request's KV pages, raw
    bytes with the chunk's place in headers (shared/wire/kv_transport.py) → KVChunkAck."""
    decode = _token(decode_executor_id, "executor id")
    return f"{PREFIX}.kv.{decode}.{_token(request_id, 'request id')}"


def kv_pages_of(decode_executor_id: str) -> str:
    """Every transfer to one decode executor: what it subscribes to."""
    return f"{PREFIX}.kv.{_token(decode_executor_id, 'executor id')}.*"
