"""Per-key limits enforced through Redis, shared by every gateway replica (limits_lua.py: the
atomic check-and-take).

    admit(key, cost)   → a Lease (release it when the request ends), or APIError 429 naming
                         the limit, with Retry-After; 400 when the request alone costs more
                         than tokens_per_minute
    release(lease, n)  gives back the concurrency slot, and the reserved tokens beyond the n
                       the request used
    a renewal task     pushes back the expiry of this gateway's leases every lease_ttl_s / 3, so a
                       crashed gateway's concurrency slots expire after lease_ttl_s

Redis unreachable (or refusing us): the request is admitted (fail open), a warning is logged once
per outage, ``llmserve:api_key_limiter_unavailable_total`` counts the requests let through, and
Redis is not tried again for ``RETRY_DOWN_S`` (requests do not each wait on a dead server).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from . import limits_lua
from .api_keys import ApiKey
from .errors import APIError
from .metrics import GatewayMetrics

log = logging.getLogger("llmserve.gateway.limits")

DEFAULT_KEY_PREFIX = "llmserve:gw"
RETRY_DOWN_S = 1.0  # after a failed call, requests are let through unchecked this long

_SHAS = {
    name: hashlib.sha1(script.encode()).hexdigest()
    for name, script in (
        ("admit", limits_lua.ADMIT),
        ("renew", limits_lua.RENEW),
        ("refund", limits_lua.REFUND),
    )
}
_SCRIPTS = {"admit": limits_lua.ADMIT, "renew": limits_lua.RENEW, "refund": limits_lua.REFUND}


@dataclass(eq=False)
class Lease:
    """What a request took from its key's limits: a concurrency slot (``lease_id`` None: none
    taken) and ``num_reserved_tokens`` from a ``tokens_per_minute`` bucket (0: none)."""

    key_name: str
    lease_id: str | None = None
    tokens_per_minute: int = 0
    num_reserved_tokens: int = 0
    released: bool = field(default=False)

    @property
    def holds_anything(self) -> bool:
        return self.lease_id is not None or self.num_reserved_tokens > 0


def rate_limited(key: ApiKey, limit: str, wait_ms: float) -> APIError:
    value = getattr(key, limit)
    if limit == "max_concurrent":
        what = f"{value} concurrent requests"
    else:
        what = f"{value} {limit.removesuffix('_per_minute')} per minute"
    return APIError(
        429,
        f"Rate limit reached for API key '{key.name}': {limit} ({what}). "
        f"Retry after {wait_ms / 1000:.1f} s.",
        param=limit,
        retry_after_s=wait_ms / 1000,
    )


class Limiter:
    def __init__(
        self,
        client: aioredis.Redis,
        metrics: GatewayMetrics,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        lease_ttl_s: float = 30.0,
    ) -> None:
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self.client = client
        self.metrics = metrics
        self.key_prefix = key_prefix
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self._held: dict[str, set[str]] = {}  # key name -> lease ids this gateway holds
        self._down_until = 0.0
        self._down = False
        self._renewer: asyncio.Task[None] | None = None

    def _keys(self, name: str) -> list[str]:
        base = f"{self.key_prefix}:{{{name}}}"
        return [f"{base}:buckets", f"{base}:leases"]

    # -- admission -----------------------------------------------------------------------------

    async def admit(self, key: ApiKey, cost: int) -> Lease:
        if not key.limited:
            return Lease(key.name)
        if time.monotonic() < self._down_until:
            return self._fail_open(key, None)
        lease_id = uuid.uuid4().hex if key.max_concurrent is not None else ""
        args = [
            key.requests_per_minute or 0,
            key.tokens_per_minute or 0,
            key.max_concurrent or 0,
            cost,
            lease_id,
            self.lease_ttl_ms,
        ]
        try:
            reply = await self._call("admit", self._keys(key.name), args)
        except redis.exceptions.RedisError as e:
            return self._fail_open(key, e)
        self._back_up()
        status = reply[0]
        if status == "rejected":
            limit, wait_ms = str(reply[1]), float(reply[2])
            self.metrics.api_key_rejected.labels(key.name, limit).inc()
            raise rate_limited(key, limit, wait_ms)
        if status == "too_large":
            self.metrics.api_key_rejected.labels(key.name, "tokens_per_minute").inc()
            raise APIError(
                400,
                f"The request reserves {reply[2]} tokens (prompt + max_tokens x n), more than API "
                f"key '{key.name}' may use: tokens_per_minute ({key.tokens_per_minute}).",
                param="max_tokens",
            )
        tokens_per_minute = key.tokens_per_minute or 0
        lease = Lease(
            key.name,
            lease_id or None,
            tokens_per_minute,
            num_reserved_tokens=cost if tokens_per_minute else 0,
        )
        if lease_id:
            self._held.setdefault(key.name, set()).add(lease_id)
        return lease

    async def release(self, lease: Lease, num_used_tokens: int) -> None:
        """Give back a lease's slot and the reserved tokens beyond ``num_used_tokens``;
        idempotent, and never raises (a slot that could not be given back expires with its lease;
        tokens that could not be, stay spent)."""
        if lease.released:
            return
        lease.released = True
        buckets, leases = self._keys(lease.key_name)
        try:
            if lease.lease_id is not None:
                held = self._held.get(lease.key_name)
                if held is not None:
                    held.discard(lease.lease_id)
                await self.client.zrem(leases, lease.lease_id)
            unused = lease.num_reserved_tokens - num_used_tokens
            if unused > 0:
                await self._call("refund", [buckets], [lease.tokens_per_minute, unused])
                self.metrics.api_key_tokens_refunded.labels(lease.key_name).inc(unused)
        except redis.exceptions.RedisError as e:
            log.info("could not give back what key %r's request held (%s)", lease.key_name, e)

    def _fail_open(self, key: ApiKey, error: Exception | None) -> Lease:
        self.metrics.api_key_limiter_unavailable.inc()
        if error is not None:
            self._down_until = time.monotonic() + RETRY_DOWN_S
            if not self._down:
                self._down = True
                log.warning(
                    "redis unreachable for per-key limits (%s): admitting requests unchecked "
                    "until it is back",
                    error,
                )
        return Lease(key.name)

    def _back_up(self) -> None:
        if self._down:
            self._down = False
            log.warning("redis reachable again: per-key limits enforced")

    # -- leases --------------------------------------------------------------------------------

    def start(self) -> None:
        if self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
        await self.client.aclose()

    async def renew(self) -> None:
        for name, lease_ids in list(self._held.items()):
            if not lease_ids:
                self._held.pop(name, None)
                continue
            await self._call("renew", [self._keys(name)[1]], [self.lease_ttl_ms, *lease_ids])

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl_ms / 3000)
            try:
                await self.renew()
            except redis.exceptions.RedisError as e:
                log.info("could not renew concurrency leases (%s)", e)

    # -- Lua -----------------------------------------------------------------------------------

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.client.evalsha(_SHAS[name], len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            pass
        # A server that never saw it, or restarted since: load it and call once more.
        await self.client.script_load(_SCRIPTS[name])
        return await self.client.evalsha(_SHAS[name], len(keys), *keys, *args)
