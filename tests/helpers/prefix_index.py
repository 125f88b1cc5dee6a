"""For the prefix index service's tests: its config with test timings, a Redis client on its
keys, polling until the index holds what the executors hold, and match/status over NATS."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from helpers.kv_executor import KVExecutorModel, dump_keys, index_of
from services.prefix_index.config import PrefixIndexConfig
from services.prefix_index.service import PrefixIndexService
from services.prefix_index.store import PrefixStore, connect_redis
from shared.wire import messages, subjects
from shared.wire.bus import Bus
from shared.wire.messages import (
    PrefixIndexStatus,
    PrefixIndexStatusRequest,
    PrefixMatchReply,
    PrefixMatchRequest,
)

MODEL = "m"


def index_config(nats_url: str, redis_url: str, **overrides: Any) -> PrefixIndexConfig:
    settings: dict[str, Any] = dict(
        key_prefix=f"test:pi:{uuid.uuid4().hex[:8]}",
        consumer=f"pi_{uuid.uuid4().hex[:8]}",
        executor_timeout_s=60.0,  # tests that play heartbeats say otherwise
        snapshot_timeout_s=1.0,
        gap_retry_delay_s=0.05,
        resync_after_deliveries=3,
        gap_stall_timeout_s=0.3,
        ack_wait_s=5.0,
        tick_interval_s=0.05,
    )
    return PrefixIndexConfig(nats_url=nats_url, redis_url=redis_url, **{**settings, **overrides})


@contextlib.asynccontextmanager
async def redis_client(config: PrefixIndexConfig) -> AsyncIterator[Any]:
    store = PrefixStore(connect_redis(config.redis_url, 5.0), config.key_prefix, tombstone_ttl_s=60)
    try:
        yield store.client
    finally:
        await store.close()


async def until(
    check: Callable[[], Awaitable[bool]], timeout_s: float = 15.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


async def index_equals(
    client: Any, key_prefix: str, executors: list[KVExecutorModel]
) -> dict[str, set[int]]:
    """Wait until the index holds exactly each executor's true set; returns it."""
    expected = {ex.executor_id: ex.held for ex in executors if ex.held}

    async def check() -> bool:
        return index_of(await dump_keys(client, key_prefix), key_prefix) == expected

    await until(check, what=f"the index to hold {sorted(expected)}'s blocks")
    return expected


async def match(bus: Bus, block_hashes: list[int]) -> PrefixMatchReply:
    data = await bus.request(
        subjects.PREFIX_INDEX_MATCH,
        messages.PREFIX_MATCH_REQUEST.encode(
            PrefixMatchRequest(model=MODEL, block_hashes=block_hashes)
        ),
        timeout=5.0,
    )
    return messages.PREFIX_MATCH_REPLY.decode(data)


async def status(bus: Bus) -> PrefixIndexStatus:
    data = await bus.request(
        subjects.PREFIX_INDEX_STATUS,
        messages.PREFIX_INDEX_STATUS_REQUEST.encode(PrefixIndexStatusRequest()),
        timeout=5.0,
    )
    return messages.PREFIX_INDEX_STATUS.decode(data)


async def counted(
    service: PrefixIndexService, counter: str, expected: int, at_least: bool = False
) -> None:
    """Wait until one of the service's counters is ``expected`` (or more, with ``at_least``)."""

    async def check() -> bool:
        value = getattr(service.counters, counter)
        return bool(value >= expected if at_least else value == expected)

    await until(check, what=f"{counter} to reach {expected}")
