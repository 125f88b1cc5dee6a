"""Whether Redis answers, for the whole service: the first failed call starts an outage (logged
once), a probe pings until Redis answers again (logged once), and whoever must wait for it waits
on ``wait_back``. While it is down, matches answer with an error at once instead of each waiting
out a timeout."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from services.prefix_index.logic import RedisHealth
from services.prefix_index.store import IndexStoreError, PrefixStore

log = logging.getLogger("llmserve.prefix_index")


class RedisWatch:
    def __init__(
        self, store: PrefixStore, probe_interval_s: float = 0.1, max_probe_interval_s: float = 1.0
    ) -> None:
        self._store = store
        self._probe_interval_s = probe_interval_s
        self._max_probe_interval_s = max_probe_interval_s
        self._health = RedisHealth()
        self._back = asyncio.Event()
        self._back.set()
        self._probe: asyncio.Task[None] | None = None

    @property
    def ok(self) -> bool:
        return self._health.ok

    def failed(self, error: Exception) -> None:
        """A call found Redis unavailable."""
        if not self._health.failed(time.monotonic()):
            return
        log.warning(
            "redis is unavailable (%s): matches answer with an error, and KV event batches stay "
            "unacknowledged in the stream until it is back",
            error,
        )
        self._back.clear()
        self._probe = asyncio.create_task(self._probe_loop())

    async def wait_back(self, timeout_s: float) -> bool:
        """True once Redis answers again; False if it is still down after ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._back.wait(), timeout_s)
        return self._back.is_set()

    async def _probe_loop(self) -> None:
        delay_s = self._probe_interval_s
        while True:
            await asyncio.sleep(delay_s)
            try:
                await self._store.ping()
            except IndexStoreError:
                delay_s = min(2 * delay_s, self._max_probe_interval_s)
                continue
            outage_s = self._health.recovered(time.monotonic())
            log.info("redis is back after %.1fs: the index resumes", outage_s or 0.0)
            self._back.set()
            return

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
