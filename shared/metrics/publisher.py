"""The thin async shell that publishes a service's registry as a MetricsReport every interval.

``new_instance_id`` names a process that has no unique name of its own (several tokenizers or
schedulers share theirs): the name plus a random suffix, fresh per process start.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from prometheus_client import CollectorRegistry

from shared.metrics.report import registry_families
from shared.wire import subjects
from shared.wire.bus import Bus, BusError
from shared.wire.messages import METRICS_INTERVAL_S, METRICS_REPORT, MetricsReport

log = logging.getLogger("llmserve.metrics")


def new_instance_id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def report_of(service: str, instance: str, registry: CollectorRegistry) -> MetricsReport:
    return MetricsReport(
        service=service,
        instance=instance,
        sent_at=time.time(),
        families=registry_families(registry),
    )


class MetricsPublisher:
    """Publishes ``registry`` on ``subjects.metrics(service, instance)`` every ``interval_s``,
    from ``start()`` until ``stop()``; a failed publish is logged and the next one tried."""

    def __init__(
        self,
        bus: Bus,
        service: str,
        instance: str,
        registry: CollectorRegistry,
        interval_s: float = METRICS_INTERVAL_S,
    ) -> None:
        self.subject = subjects.metrics(service, instance)  # ValueError on a bad token
        self._bus, self._service, self._instance = bus, service, instance
        self._registry, self._interval_s = registry, interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def publish(self) -> None:
        report = report_of(self._service, self._instance, self._registry)
        await self._bus.publish(self.subject, METRICS_REPORT.encode(report))

    async def _loop(self) -> None:
        while True:
            try:
                await self.publish()
            except BusError as e:
                log.debug("metrics report not sent: %s", e)
            except Exception:
                log.exception("metrics report failed")
            await asyncio.sleep(self._interval_s)
