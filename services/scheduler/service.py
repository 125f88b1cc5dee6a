"""The scheduler actor: feeds NATS messages into the pure ``Router`` and publishes its actions.

Subscriptions: SCHEDULER_SUBMIT (queue group: each request is routed by one scheduler),
EXECUTOR_STATS_ALL, SCHEDULER_PROGRESS and ABORT (fan-out: every scheduler instance keeps its own
executor table and tracks the requests it routed), SCHEDULER_STATUS (queue group, request/reply).
A ticker declares silent executors dead and expires queued requests.
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.scheduler.config import SchedulerConfig
from services.scheduler.router import Action, Dispatch, Fail, Router
from shared.wire import messages, subjects
from shared.wire.bus import Bus, BusError, Msg

log = logging.getLogger("llmserve.scheduler")


class SchedulerService:
    def __init__(self, bus: Bus, config: SchedulerConfig) -> None:
        self.bus = bus
        self.config = config
        self.router = Router(config.router, time.monotonic())
        self._ticker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.bus.subscribe(
            subjects.SCHEDULER_SUBMIT, self._on_submit, queue=subjects.QUEUE_SCHEDULER
        )
        await self.bus.subscribe(subjects.EXECUTOR_STATS_ALL, self._on_heartbeat)
        await self.bus.subscribe(subjects.SCHEDULER_PROGRESS, self._on_progress)
        await self.bus.subscribe(subjects.ABORT, self._on_abort)
        await self.bus.subscribe(
            subjects.SCHEDULER_STATUS, self._on_status, queue=subjects.QUEUE_SCHEDULER
        )
        await self.bus.flush()
        self._ticker = asyncio.create_task(self._tick_loop())

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)

    # -- handlers (each small; the router holds the logic) --------------------------------------

    async def _on_submit(self, msg: Msg) -> None:
        req = messages.TOKENIZED_REQUEST.decode(msg.data)
        await self._apply(self.router.submit(req, time.monotonic(), time.time()), msg.headers)
        if msg.reply:  # the tokenizer waits for this ack: "a scheduler has routed it"
            await msg.respond(b"")

    async def _on_heartbeat(self, msg: Msg) -> None:
        hb = messages.EXECUTOR_HEARTBEAT.decode(msg.data)
        await self._apply(self.router.on_heartbeat(hb, time.monotonic()))

    async def _on_progress(self, msg: Msg) -> None:
        progress = messages.REQUEST_PROGRESS.decode(msg.data)
        await self._apply(self.router.on_progress(progress, time.monotonic()))

    async def _on_abort(self, msg: Msg) -> None:
        abort = messages.ABORT_REQUEST.decode(msg.data)
        await self._apply(self.router.abort(abort.request_id, time.monotonic()))

    async def _on_status(self, msg: Msg) -> None:
        if msg.reply:
            await msg.respond(
                messages.SCHEDULER_STATUS.encode(self.router.status(time.monotonic()))
            )

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_interval_s)
            try:
                await self._apply(self.router.tick(time.monotonic(), time.time()))
            except Exception:
                log.exception("scheduler tick failed")

    async def _apply(self, actions: list[Action], headers: dict[str, str] | None = None) -> None:
        for action in actions:
            try:
                if isinstance(action, Dispatch):
                    await self.bus.publish(
                        subjects.executor_decode(action.executor_id),
                        messages.EXECUTE_REQUEST.encode(action.request),
                        headers=headers,
                    )
                elif isinstance(action, Fail):
                    log.info(
                        "request %s failed: %d %s",
                        action.error.request_id,
                        action.error.status,
                        action.error.message,
                    )
                    await self.bus.publish(
                        subjects.stream(action.error.request_id),
                        messages.STREAM_MESSAGE.encode(action.error),
                    )
            except BusError:
                log.exception("cannot publish a scheduler action")


async def serve(config: SchedulerConfig, stop: asyncio.Event) -> None:
    bus = await Bus.connect(config.nats_url, config.name)
    service = SchedulerService(bus, config)
    await service.start()
    log.info(
        "scheduler ready (max_queue_len=%d, heartbeat_timeout=%.1fs)",
        config.router.max_queue_len,
        config.router.heartbeat_timeout_s,
    )
    await stop.wait()
    await service.stop()
    await bus.drain()
