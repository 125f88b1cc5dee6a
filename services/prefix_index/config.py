"""The prefix index process's config, from flags over the environment (a flag beats its
variable)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from services.connections import (
    RedisAuth,
    add_nats_auth_arguments,
    add_redis_auth_arguments,
    nats_auth_from_args,
    redis_auth_from_args,
)
from services.prefix_index.logic import hash_tag_prefix
from services.runtime import env_float, env_int, env_str
from shared.field_checks import require_at_least, require_positive
from shared.wire import subjects
from shared.wire.bus_auth import BusAuth
from shared.wire.kv_stream import KV_EVENTS_MAX_AGE_S

DEFAULT_KEY_PREFIX = "llmserve:pi"


@dataclass(frozen=True)
class PrefixIndexConfig:
    nats_url: str
    redis_url: str
    key_prefix: str = DEFAULT_KEY_PREFIX  # every key is {key_prefix}:...
    # The durable JetStream consumer every replica pulls from; another name is another,
    # independent index over the same stream (give it its own key_prefix or Redis db).
    consumer: str = subjects.QUEUE_PREFIX_INDEX
    name: str = "prefix_index"  # the NATS connection's name
    executor_timeout_s: float = 3.0  # silent this long (no heartbeat): its entries are purged
    snapshot_timeout_s: float = 5.0  # an executor answers a snapshot request between two steps
    redis_timeout_s: float = 2.0  # one command (applies, snapshots, purges)
    match_timeout_s: float = 0.25  # a match that takes longer answers with an error
    ack_wait_s: float = 30.0  # a fetched batch not acked in this long goes to another replica
    gap_retry_delay_s: float = 0.25  # a batch after a gap is redelivered this much later...
    # ...until the executor's applied seq has stood still this long, over at least this many
    # deliveries of the waiting batch: then it resyncs (logic.GapTracker).
    gap_stall_timeout_s: float = 1.0
    resync_after_deliveries: int = 3
    tick_interval_s: float = 0.25  # liveness checks
    max_match_blocks: int = 1 << 16  # a longer match request is refused
    # A dead executor's tombstone outlives every batch of its epoch the stream still holds.
    tombstone_ttl_s: float = KV_EVENTS_MAX_AGE_S
    # Who it is on NATS and on Redis (services.connections).
    bus_auth: BusAuth = field(default_factory=BusAuth)
    redis_auth: RedisAuth = field(default_factory=RedisAuth)

    def __post_init__(self) -> None:
        if not self.nats_url or not self.redis_url:
            raise ValueError("nats_url and redis_url must not be empty")
        if self.redis_auth.uses_tls_files and not self.redis_url.startswith("rediss://"):
            raise ValueError("the Redis TLS files need a rediss:// URL")
        hash_tag_prefix(self.key_prefix)  # raises ValueError on a bad prefix
        # A JetStream consumer name is one subject token.
        if not self.consumer or any(c in self.consumer for c in ".*> \t\r\n"):
            raise ValueError(f"invalid consumer name: {self.consumer!r}")
        require_positive(
            self,
            "executor_timeout_s",
            "snapshot_timeout_s",
            "redis_timeout_s",
            "match_timeout_s",
            "ack_wait_s",
            "gap_retry_delay_s",
            "gap_stall_timeout_s",
            "tick_interval_s",
        )
        require_at_least(self, 1, "resync_after_deliveries", "max_match_blocks", "tombstone_ttl_s")


def parse_config(argv: list[str] | None = None) -> PrefixIndexConfig:
    p = argparse.ArgumentParser(
        prog="python -m services.prefix_index",
        description="The global prefix index: executors' KV events in, prefix matches out.",
    )
    p.add_argument("--nats-url", default=env_str("NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--redis-url", default=env_str("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument(
        "--key-prefix",
        default=env_str("LLMSERVE_PREFIX_INDEX_KEY_PREFIX", DEFAULT_KEY_PREFIX),
        help="Redis keys are {prefix}:...",
    )
    p.add_argument(
        "--consumer",
        default=env_str("LLMSERVE_PREFIX_INDEX_CONSUMER", subjects.QUEUE_PREFIX_INDEX),
        help="durable JetStream consumer shared by the replicas of one index",
    )
    p.add_argument(
        "--executor-timeout",
        type=float,
        default=env_float("LLMSERVE_EXECUTOR_TIMEOUT", 3.0),
        help="seconds without a heartbeat after which an executor's entries are purged",
    )
    p.add_argument(
        "--snapshot-timeout",
        type=float,
        default=env_float("LLMSERVE_SNAPSHOT_TIMEOUT", 5.0),
        help="seconds to wait for an executor's KV cache snapshot when resyncing",
    )
    p.add_argument(
        "--redis-timeout",
        type=float,
        default=env_float("LLMSERVE_REDIS_TIMEOUT", 2.0),
        help="seconds one Redis command may take",
    )
    p.add_argument(
        "--match-timeout",
        type=float,
        default=env_float("LLMSERVE_MATCH_TIMEOUT", 0.25),
        help="seconds a match may take in Redis before it answers with an error",
    )
    p.add_argument(
        "--ack-wait",
        type=float,
        default=env_float("LLMSERVE_KV_EVENTS_ACK_WAIT", 30.0),
        help="seconds before a fetched, unacknowledged batch is redelivered (set when the "
        "consumer is created)",
    )
    p.add_argument(
        "--resync-after",
        type=int,
        default=env_int("LLMSERVE_RESYNC_AFTER_DELIVERIES", 3),
        help="deliveries of a batch after a gap before resyncing from a snapshot (at least)",
    )
    p.add_argument(
        "--gap-stall-timeout",
        type=float,
        default=env_float("LLMSERVE_GAP_STALL_TIMEOUT", 1.0),
        help="seconds an executor's applied batches may stand still behind a gap before resyncing",
    )
    p.add_argument("--name", default="prefix_index", help="connection name")
    add_nats_auth_arguments(p)
    add_redis_auth_arguments(p)
    a = p.parse_args(argv)
    try:
        return PrefixIndexConfig(
            nats_url=a.nats_url,
            redis_url=a.redis_url,
            key_prefix=a.key_prefix,
            consumer=a.consumer,
            name=a.name,
            executor_timeout_s=a.executor_timeout,
            snapshot_timeout_s=a.snapshot_timeout,
            redis_timeout_s=a.redis_timeout,
            match_timeout_s=a.match_timeout,
            ack_wait_s=a.ack_wait,
            resync_after_deliveries=a.resync_after,
            gap_stall_timeout_s=a.gap_stall_timeout,
            bus_auth=nats_auth_from_args(a),
            redis_auth=redis_auth_from_args(a),
        )
    except ValueError as e:
        p.error(str(e))
        raise
