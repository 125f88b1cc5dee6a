"""The prefix index in Redis: which executor holds which prefix's KV blocks.

Every key starts with the configured prefix inside a hash tag, ``{llmserve:pi}``, so the whole index
lives in one cluster slot and one Lua call may touch any of it::

    {llmserve:pi}:executors            SET   ids of executors with a live record
    {llmserve:pi}:x:<executor>         HASH  epoch, seq, model   (+ dead=1: a tombstone, expiring)
    {llmserve:pi}:xb:<executor>        SET   block hashes it holds (decimal strings)
    {llmserve:pi}:b:<model>:<hash>     SET   executor ids holding block <hash> of <model>

             match(model, [h1, h2, h3])                    purge(e2)
                  │                                            │
    b:m:h1 ───── {e1, e2, e3}                     xb:e2 {h1, h2}  ── SREM e2 from b:m:h1, b:m:h2
    SMISMEMBER xb:e1 h1 h2 h3 → 1 1 1, xb:e2 → 1 1 0, xb:e3 → 1 0 1
                                 → e1: 3, e2: 2, e3: 1

Each operation is one Lua call (lua.py: the contracts), atomic: Redis 7's server-side functions
where the server has them, else EVALSHA of the same bodies, loaded again when the server answers
NOSCRIPT (a restarted Redis has forgotten them). Errors come out typed: ``IndexUnavailable`` when
Redis cannot answer now (down, timed out, busy, loading), ``IndexAccessDenied`` when it refuses our
credentials or a command (NOAUTH, WRONGPASS, NOPERM), ``IndexStoreError`` otherwise.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from enum import StrEnum
from typing import Any, NamedTuple

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.connections import RedisAuth
from services.prefix_index import lua
from services.prefix_index.logic import encode_events, hash_tag_prefix
from shared.wire.bus_auth import AccessRefused
from shared.wire.kv_events import KVCacheSnapshot, KVEventsMessage

__all__ = [
    "ApplyOutcome",
    "ApplyResult",
    "IndexAccessDenied",
    "IndexStoreError",
    "IndexUnavailable",
    "PrefixStore",
    "connect_redis",
]

log = logging.getLogger("llmserve.prefix_index.store")


class IndexStoreError(Exception):
    """Redis answered with an error that waiting will not fix (a bug, a wrong server)."""


class IndexUnavailable(IndexStoreError):
    """Redis cannot answer now: down, unreachable, timed out, loading or busy. Retry later."""


class IndexAccessDenied(IndexStoreError, AccessRefused):
    """Redis refused our user or password, or a command our user is not granted: a configuration
    error that waiting will not fix."""


class ApplyResult(StrEnum):
    APPLIED = "applied"
    REPLAY = "replay"  # already applied: nothing written
    GAP = "gap"  # a batch before it is not applied (yet): wait for it, or resync
    STALE = "stale"  # from an epoch the index has moved past (or declared dead): drop


class ApplyOutcome(NamedTuple):
    result: ApplyResult
    seq: int  # the executor's record's seq after the call: how far its batches are applied


# Error replies that mean "not now" rather than "never": the call is retried once Redis is back.
_TRANSIENT_REPLIES = ("BUSY", "LOADING", "READONLY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "OOM")


def connect_redis(url: str, timeout_s: float, auth: RedisAuth | None = None) -> aioredis.Redis:
    """A client whose every command fails within ``timeout_s`` (connecting included) and is tried
    at most twice (a pooled connection a restarted server dropped fails once): the service does
    its own retrying, and a match must fail fast rather than wait. It authenticates as ``auth``
    says (or as the URL says), on every connection it opens."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
        decode_responses=True,
        **(auth or RedisAuth()).client_options(),
    )


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


_SHAS = {name: _sha1(script) for name, script in lua.SCRIPTS.items()}


class PrefixStore:
    """The index's operations on one Redis client. ``use_functions`` None: detect (Redis >= 7)."""

    def __init__(
        self,
        client: aioredis.Redis,
        key_prefix: str,
        *,
        tombstone_ttl_s: float,
        use_functions: bool | None = None,
    ) -> None:
        if tombstone_ttl_s < 1:
            raise ValueError(f"tombstone_ttl_s must be >= 1, got {tombstone_ttl_s}")
        self.client = client
        self.prefix = hash_tag_prefix(key_prefix)
        self.executors_key = f"{self.prefix}:executors"
        self._tombstone_ttl_s = int(tombstone_ttl_s)
        self._use_functions = use_functions
        self._library_loaded = False

    # -- operations --------------------------------------------------------------------------

    async def apply(self, message: KVEventsMessage) -> ApplyOutcome:
        batch = message.batch
        if batch.seq < 1:
            raise ValueError(f"batch seq must be >= 1, got {batch.seq}")
        status, seq = await self._call(
            "apply",
            [
                message.executor_id,
                message.epoch,
                message.model,
                batch.seq,
                *encode_events(batch.events),
            ],
        )
        return ApplyOutcome(ApplyResult(status), int(seq))

    async def install_snapshot(self, snapshot: KVCacheSnapshot) -> str:
        """'installed', 'current' (the index is at or past it already) or 'stale'."""
        return str(
            await self._call(
                "install",
                [
                    snapshot.executor_id,
                    snapshot.epoch,
                    snapshot.model,
                    snapshot.seq,
                    *map(str, snapshot.block_hashes),
                ],
            )
        )

    async def purge(self, executor_id: str, epoch: str | None = None) -> str:
        """'purged', 'absent' or 'newer' (``epoch`` given and a later one holds the record)."""
        return str(await self._call("purge", [executor_id, epoch or "", self._tombstone_ttl_s]))

    async def observe(self, executor_id: str, epoch: str, model: str) -> str:
        """A heartbeat: 'ok', 'restarted', 'dead', 'stale' or 'unknown' (lua.py)."""
        return str(await self._call("observe", [executor_id, epoch, model]))

    async def match(self, model: str, block_hashes: Sequence[int]) -> dict[str, int]:
        """How many leading blocks of ``block_hashes`` each executor holds (absent: none)."""
        if not block_hashes:
            return {}
        flat = await self._call("match", [model, " ".join(map(str, block_hashes))])
        return {str(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def stats(self) -> tuple[int, int]:
        """(executors holding at least one block, (block, executor) entries over every model)."""
        num_executors, num_entries = await self._call("stats", [])
        return int(num_executors), int(num_entries)

    async def executors(self) -> dict[str, str]:
        """Every executor with a live record → its epoch."""
        flat = await self._call("executors", [])
        return {str(flat[i]): str(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def ping(self) -> None:
        await self._guard(self.client.ping())

    async def close(self) -> None:
        await self.client.aclose()

    # -- calling Lua ---------------------------------------------------------------------------

    async def _call(self, name: str, args: list[Any]) -> Any:
        argv = [self.prefix, *args]
        if self._use_functions is None:
            self._use_functions = await self._server_has_functions()
        if self._use_functions:
            return await self._fcall(name, argv)
        try:
            return await self._guard(self.client.evalsha(_SHAS[name], 1, self.executors_key, *argv))
        except IndexStoreError as e:
            if not isinstance(e.__cause__, redis.exceptions.NoScriptError):
                raise
        # A server that never saw it, or restarted since: load it and call once more.
        await self._guard(self.client.script_load(lua.SCRIPTS[name]))
        return await self._guard(self.client.evalsha(_SHAS[name], 1, self.executors_key, *argv))

    async def _fcall(self, name: str, argv: list[Any]) -> Any:
        if not self._library_loaded:
            await self._load_library()
        function = lua.FUNCTION_NAMES[name]
        try:
            return await self._guard(self.client.fcall(function, 1, self.executors_key, *argv))
        except IndexStoreError as e:
            if "function not found" not in str(e).lower():
                raise
        self._library_loaded = False  # a restarted server that had not persisted it
        await self._load_library()
        return await self._guard(self.client.fcall(function, 1, self.executors_key, *argv))

    async def _load_library(self) -> None:
        try:
            await self._guard(self.client.function_load(lua.FUNCTION_LIBRARY))
        except IndexStoreError as e:
            if "already exists" not in str(e):  # loaded by another replica: the same code
                raise
        self._library_loaded = True

    async def _server_has_functions(self) -> bool:
        info = await self._guard(self.client.info("server"))
        major = int(str(info.get("redis_version", "0")).split(".")[0] or 0)
        log.info(
            "redis %s: the index runs as %s",
            info.get("redis_version"),
            "server-side functions" if major >= 7 else "EVALSHA scripts",
        )
        return major >= 7

    @staticmethod
    async def _guard(awaitable: Any) -> Any:
        """Await a redis-py call, turning its errors into ours."""
        try:
            return await awaitable
        # Before ConnectionError: AuthenticationError is one, but no reconnecting will cure it.
        except (redis.exceptions.AuthenticationError, redis.exceptions.NoPermissionError) as e:
            raise IndexAccessDenied(f"redis refused us: {e}") from e
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
            raise IndexUnavailable(f"redis unavailable: {e}") from e
        except redis.exceptions.ResponseError as e:
            if str(e).startswith(_TRANSIENT_REPLIES):
                raise IndexUnavailable(f"redis cannot answer now: {e}") from e
            raise IndexStoreError(f"redis error: {e}") from e
        except redis.exceptions.RedisError as e:
            raise IndexStoreError(f"redis error: {e}") from e
