"""Who may publish and subscribe to what on the bus: the NATS permissions of each kind of service,
derived from ``subjects`` in this one place. On a closed bus (``llmserve up`` generates one per
stack; ``llmserve credentials`` writes the same for a server of your own) a subject nobody is
granted here is a subject no service can use: grant a new subject here, to the kinds that need it.

Each kind connects as the NATS user of its name. What each may do, and why::

    kind          publishes                            subscribes
    gateway       tokenizer.generate, *.status, abort  stream.* (its requests' outputs),
                                                       metrics.> (the stack's, for /metrics),
                                                       executor.*.stats (the console's ledgers)
    tokenizer     scheduler.submit, abort, stream.*    tokenizer.generate, tokenizer.status
    scheduler     prefix_index.match,                  scheduler.submit, scheduler.status,
                  executor.*.decode, stream.*          scheduler.progress, executor.*.stats,
                                                       abort
    executor      stream.*, scheduler.progress,        executor.*.decode, abort,
                  executor.*.stats, kv_events.*,       executor.*.kv_snapshot,
                  executor.*.kv_offer, kv.*.*          executor.*.kv_offer, kv.*.* (KV pages
                  JetStream: its stream's INFO, CREATE   from prefill to decode executors)
    prefix_index  executor.*.kv_snapshot, JetStream:   prefix_index.match, prefix_index.status,
                  INFO, CREATE, its consumer, acks     executor.*.stats

(every subject under ``llm.v1.``; each kind also publishes its MetricsReport on
``metrics.<kind>.*``; a tokenizer or scheduler publishes on ``stream.*`` only to end a
request with an error, or to say it still holds it: a StreamKeepalive). Nobody else connects: an
anonymous client is refused.

Replies: a requester subscribes to its own inbox prefix, ``_INBOX.<user>.>``, and nothing else's
(nats-py is told the prefix: ``BusAuth.inbox_prefix``), so no kind reads the replies another asked
for; a responder publishes its reply under NATS's ``allow_responses`` (one reply to each request it
received), not by a grant on anyone's inbox. JetStream's own replies and deliveries come to the
requester's inbox from the server.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.wire import subjects

__all__ = [
    "ADMIN_USER",
    "PERMISSIONS",
    "SERVICE_KINDS",
    "Permissions",
    "inbox_prefix",
]

# The service kinds, each one NATS user; the launcher's process names are "<kind>" or "<kind>-<n>".
SERVICE_KINDS = ("gateway", "tokenizer", "scheduler", "executor", "prefix_index")
# Every subject, both ways: for operators and tests that watch or drive a stack. No service
# connects as it.
ADMIN_USER = "admin"


def inbox_prefix(user: str) -> str:
    """The prefix of the reply subjects of ``user``'s requests."""
    if not user or any(c in user for c in ".*> \t\r\n"):
        raise ValueError(f"a NATS user name must be one subject token, got {user!r}")
    return f"_INBOX.{user}"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # May publish one reply to the reply subject of each request it received, beyond ``publish``.
    allow_responses: bool = False


# The JetStream API subjects of the KV events stream (nats-py: stream_info, add_stream;
# pull_subscribe's consumer_info, add_consumer, fetch; msg.ack / nak): this stream only, and no
# DELETE, PURGE or UPDATE of it.
_STREAM = subjects.KV_EVENTS_STREAM
_KV_STREAM_ENSURE = (f"$JS.API.STREAM.INFO.{_STREAM}", f"$JS.API.STREAM.CREATE.{_STREAM}")
_KV_STREAM_CONSUME = (
    f"$JS.API.CONSUMER.INFO.{_STREAM}.>",
    f"$JS.API.CONSUMER.CREATE.{_STREAM}.>",
    f"$JS.API.CONSUMER.DURABLE.CREATE.{_STREAM}.>",
    f"$JS.API.CONSUMER.MSG.NEXT.{_STREAM}.>",
    f"$JS.ACK.{_STREAM}.>",
)


def _own_inbox(user: str) -> str:
    return f"{inbox_prefix(user)}.>"


PERMISSIONS: dict[str, Permissions] = {
    "gateway": Permissions(
        publish=(
            subjects.TOKENIZER_GENERATE,
            subjects.TOKENIZER_STATUS,
            subjects.SCHEDULER_STATUS,
            subjects.PREFIX_INDEX_STATUS,
            subjects.ABORT,
            subjects.metrics_of("gateway"),
        ),
        subscribe=(
            subjects.STREAM_ALL,
            subjects.METRICS_ALL,
            subjects.EXECUTOR_STATS_ALL,
            _own_inbox("gateway"),
        ),
    ),
    "tokenizer": Permissions(
        publish=(
            subjects.SCHEDULER_SUBMIT,
            subjects.ABORT,
            subjects.STREAM_ALL,
            subjects.metrics_of("tokenizer"),
        ),
        subscribe=(
            subjects.TOKENIZER_GENERATE,
            subjects.TOKENIZER_STATUS,
            _own_inbox("tokenizer"),
        ),
        allow_responses=True,
    ),
    "scheduler": Permissions(
        publish=(
            subjects.PREFIX_INDEX_MATCH,
            subjects.EXECUTOR_DECODE_ALL,
            subjects.STREAM_ALL,
            subjects.metrics_of("scheduler"),
        ),
        subscribe=(
            subjects.SCHEDULER_SUBMIT,
            subjects.SCHEDULER_STATUS,
            subjects.SCHEDULER_PROGRESS,
            subjects.EXECUTOR_STATS_ALL,
            subjects.ABORT,
            _own_inbox("scheduler"),
        ),
        allow_responses=True,
    ),
    "executor": Permissions(
        publish=(
            subjects.STREAM_ALL,
            subjects.SCHEDULER_PROGRESS,
            subjects.EXECUTOR_STATS_ALL,
            subjects.KV_EVENTS_ALL,
            subjects.EXECUTOR_KV_OFFER_ALL,
            subjects.KV_PAGES_ALL,
            subjects.metrics_of("executor"),
            *_KV_STREAM_ENSURE,
        ),
        subscribe=(
            subjects.EXECUTOR_DECODE_ALL,
            subjects.EXECUTOR_KV_SNAPSHOT_ALL,
            subjects.EXECUTOR_KV_OFFER_ALL,
            subjects.KV_PAGES_ALL,
            subjects.ABORT,
            _own_inbox("executor"),
        ),
        allow_responses=True,
    ),
    "prefix_index": Permissions(
        publish=(
            subjects.EXECUTOR_KV_SNAPSHOT_ALL,
            subjects.metrics_of("prefix_index"),
            *_KV_STREAM_ENSURE,
            *_KV_STREAM_CONSUME,
        ),
        subscribe=(
            subjects.PREFIX_INDEX_MATCH,
            subjects.PREFIX_INDEX_STATUS,
            subjects.EXECUTOR_STATS_ALL,
            _own_inbox("prefix_index"),
        ),
        allow_responses=True,
    ),
    ADMIN_USER: Permissions(publish=(">",), subscribe=(">",)),
}
