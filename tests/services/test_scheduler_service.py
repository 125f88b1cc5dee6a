"""The scheduler service over a real nats-server, with fake executors written here: they publish
heartbeats and consume ExecuteRequests, as the real executor does. Covers spreading by in-flight
load, 429 on a full queue, 503 without executors, fail-over when an executor goes silent, aborts
and the status request the gateway's /health uses."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest

from helpers.stats import engine_stats
from services.scheduler.router import RouterConfig
from services.scheduler.service import SchedulerConfig, SchedulerService
from shared.wire import messages, subjects
from shared.wire.bus import Bus
from shared.wire.messages import (
    AbortRequest,
    ExecuteReply,
    ExecuteRequest,
    ExecutorHeartbeat,
    ExecutorLoad,
    RequestProgress,
    SamplingParams,
    StreamError,
    TokenizedRequest,
)

STATS = engine_stats()


class FakeExecutor:
    """Accepts every dispatch (as the real executor does while it has room) and reports its load:
    what it accepted less what it said finished."""

    def __init__(self, bus: Bus, executor_id: str, max_num_seqs: int = 2) -> None:
        self.bus, self.executor_id, self.max_num_seqs = bus, executor_id, max_num_seqs
        self.received: asyncio.Queue[ExecuteRequest] = asyncio.Queue()
        self._beat: asyncio.Task[None] | None = None
        self.load = ExecutorLoad(version=0, num_admitted=0, max_admitted=max_num_seqs)

    def _count(self, delta: int) -> None:
        self.load = ExecutorLoad(
            version=self.load.version + 1,
            num_admitted=self.load.num_admitted + delta,
            max_admitted=self.max_num_seqs,
        )

    async def start(self) -> None:
        async def on_execute(msg) -> None:
            self.received.put_nowait(messages.EXECUTE_REQUEST.decode(msg.data))
            self._count(+1)
            reply = ExecuteReply(
                executor_id=self.executor_id, epoch="e", accepted=True, load=self.load
            )
            await msg.respond(messages.EXECUTE_REPLY.encode(reply))

        self._sub = await self.bus.subscribe(subjects.executor_decode(self.executor_id), on_execute)
        await self.bus.flush()
        self._beat = asyncio.create_task(self._beat_loop())

    async def _beat_loop(self) -> None:
        while True:
            hb = ExecutorHeartbeat(
                executor_id=self.executor_id,
                epoch="e",
                role="both",
                model="m",
                max_model_len=2048,
                block_size=16,
                stats=STATS,
                sent_at=0.0,
                max_num_seqs=self.max_num_seqs,
            )
            await self.bus.publish(
                subjects.executor_stats(self.executor_id), messages.EXECUTOR_HEARTBEAT.encode(hb)
            )
            await asyncio.sleep(0.1)

    def go_silent(self) -> None:
        assert self._beat is not None
        self._beat.cancel()

    async def progress(self, rid: str, state: str) -> None:
        if state == "finished":
            self._count(-1)
        await self.bus.publish(
            subjects.SCHEDULER_PROGRESS,
            messages.REQUEST_PROGRESS.encode(
                RequestProgress(
                    request_id=rid, executor_id=self.executor_id, state=state, load=self.load
                )
            ),
        )


class Harness:
    """A scheduler service, a client bus that submits like the tokenizer, and fake executors."""

    def __init__(self, nats_url: str, **router_kw) -> None:
        self.nats_url = nats_url
        self.keepalives: list[messages.StreamKeepalive] = []
        # Heartbeats every 0.1 s; the timeout leaves room for a loaded machine to stall the loop.
        self.router_kw = {
            "max_queue_len": 1,
            "heartbeat_timeout_s": 2.0,
            "no_executor_timeout_s": 30.0,
            **router_kw,
        }

    async def __aenter__(self) -> Harness:
        self.sched_bus = await Bus.connect(self.nats_url, "scheduler-test")
        self.scheduler = SchedulerService(
            self.sched_bus,
            SchedulerConfig(
                nats_url=self.nats_url, router=RouterConfig(**self.router_kw), tick_interval_s=0.05
            ),
        )
        await self.scheduler.start()
        self.client = await Bus.connect(self.nats_url, "client-test")
        self.errors: dict[str, StreamError] = {}
        self.error_event = asyncio.Event()

        async def on_stream(msg) -> None:
            out = messages.STREAM_MESSAGE.decode(msg.data)
            if isinstance(out, StreamError):
                self.errors[out.request_id] = out
                self.error_event.set()
            elif isinstance(out, messages.StreamKeepalive):
                self.keepalives.append(out)

        await self.client.subscribe(subjects.STREAM_ALL, on_stream)
        await self.client.flush()
        self.executors: list[FakeExecutor] = []
        return self

    async def executor(self, executor_id: str, max_num_seqs: int = 2) -> FakeExecutor:
        ex = FakeExecutor(self.client, executor_id, max_num_seqs)
        await ex.start()
        self.executors.append(ex)
        return ex

    async def wait_executors(self, n: int) -> messages.SchedulerStatus:
        for _ in range(100):
            status = await self.status()
            if len(status.executors) == n:
                return status
            await asyncio.sleep(0.05)
        raise AssertionError(f"scheduler never saw {n} executors")

    async def status(self) -> messages.SchedulerStatus:
        data = await self.client.request(
            subjects.SCHEDULER_STATUS,
            messages.SCHEDULER_STATUS_REQUEST.encode(messages.SchedulerStatusRequest()),
            timeout=2,
        )
        return messages.SCHEDULER_STATUS.decode(data)

    async def submit(self, rid: str | None = None) -> str:
        rid = rid or uuid.uuid4().hex
        req = TokenizedRequest(
            request_id=rid,
            model="m",
            prompt_token_ids=[1, 2, 3],
            block_hashes=[],
            params=SamplingParams(max_tokens=4),
        )
        # As the tokenizer submits: a request the scheduler acks once it has routed it.
        ack = await self.client.request(
            subjects.SCHEDULER_SUBMIT, messages.TOKENIZED_REQUEST.encode(req), timeout=2
        )
        assert ack == b""
        return rid

    async def error_for(self, rid: str, timeout: float = 5.0) -> StreamError:
        deadline = asyncio.get_running_loop().time() + timeout
        while rid not in self.errors:
            self.error_event.clear()
            remaining = deadline - asyncio.get_running_loop().time()
            assert remaining > 0, f"no StreamError for {rid}"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.error_event.wait(), remaining)
        return self.errors[rid]

    async def __aexit__(self, *exc) -> None:
        for ex in self.executors:
            if ex._beat:
                ex._beat.cancel()
        await self.scheduler.stop()
        await self.client.close()
        await self.sched_bus.close()


async def recv(ex: FakeExecutor, timeout: float = 5.0) -> ExecuteRequest:
    return await asyncio.wait_for(ex.received.get(), timeout)


def test_spread_queue_429_and_drain_on_finish(nats_url):
    async def main() -> None:
        async with Harness(nats_url) as h:
            a, b = await h.executor("a"), await h.executor("b")
            await h.wait_executors(2)
            rids = [await h.submit() for _ in range(4)]
            got = [await recv(a), await recv(a), await recv(b), await recv(b)]
            assert sorted(r.request_id for r in got) == sorted(
                rids
            )  # 2 + 2: load counted at routing
            queued = await h.submit()  # both full: waits
            rejected = await h.submit()  # queue (1) full: 429
            err = await h.error_for(rejected)
            assert (err.status, err.type, err.retry_after_s) == (429, "rate_limit_error", 1.0)
            assert (await h.status()).num_queued == 1
            await a.progress(got[0].request_id, "started")
            await a.progress(got[0].request_id, "finished")
            assert (await recv(a)).request_id == queued
            assert queued not in h.errors

    asyncio.run(main())


def test_dead_executor_reroutes_unstarted_and_fails_started(nats_url):
    async def main() -> None:
        async with Harness(nats_url, max_queue_len=4) as h:
            a = await h.executor("a", max_num_seqs=2)
            await h.wait_executors(1)
            started, unstarted = await h.submit(), await h.submit()
            assert {(await recv(a)).request_id, (await recv(a)).request_id} == {started, unstarted}
            await a.progress(started, "started")
            b = await h.executor("b")
            await h.wait_executors(2)
            a.go_silent()
            err = await h.error_for(started, timeout=10)
            assert err.status == 502 and "executor a" in err.message and "incomplete" in err.message
            retry = await recv(b)
            assert (retry.request_id, retry.attempt) == (unstarted, 1)
            assert unstarted not in h.errors
            assert [e.executor_id for e in (await h.wait_executors(1)).executors] == ["b"]

    asyncio.run(main())


def test_no_executor_gives_503(nats_url):
    async def main() -> None:
        async with Harness(nats_url, no_executor_timeout_s=0.3) as h:
            rid = await h.submit()
            err = await h.error_for(rid)
            assert err.status == 503 and "no executor" in err.message
            assert (await h.status()).executors == []

    asyncio.run(main())


def test_abort_removes_a_queued_request(nats_url):
    async def main() -> None:
        async with Harness(nats_url, max_queue_len=2) as h:
            a = await h.executor("a", max_num_seqs=1)
            await h.wait_executors(1)
            first = await h.submit()
            assert (await recv(a)).request_id == first
            waiting = await h.submit()
            for _ in range(50):
                if (await h.status()).num_queued == 1:
                    break
                await asyncio.sleep(0.02)
            await h.client.publish(
                subjects.ABORT, messages.ABORT_REQUEST.encode(AbortRequest(request_id=waiting))
            )
            for _ in range(50):
                if (await h.status()).num_queued == 0:
                    break
                await asyncio.sleep(0.02)
            assert (await h.status()).num_queued == 0
            await a.progress(first, "finished")
            await asyncio.sleep(0.2)
            assert a.received.empty()  # the aborted one never runs

    asyncio.run(main())


def test_retry_after_follows_the_measured_drain_rate_and_queued_requests_get_keepalives(nats_url):
    """An executor that finishes one request every 0.4 s and a queue of 6 kept full: a 429's
    Retry-After is the queue over the drain rate the test itself observes (not the 1 s it starts
    from), and every queued request's stream hears from the scheduler while it waits."""

    async def main() -> None:
        async with Harness(nats_url, max_queue_len=6) as h:
            a = await h.executor("a", max_num_seqs=1)
            await h.wait_executors(1)
            await h.submit()
            running = (await recv(a, 5)).request_id
            for _ in range(6):
                await h.submit()
            assert (await h.status()).num_queued == 6
            loop = asyncio.get_running_loop()
            started, departures = loop.time(), 0
            while loop.time() - started < 4.0:
                await asyncio.sleep(0.4)
                await a.progress(running, "finished")  # a queued one takes its place
                running = (await recv(a, 5)).request_id
                departures += 1
                await h.submit()  # and a new one the freed place in the queue
            observed_rate = departures / (loop.time() - started)
            err = await h.error_for(await h.submit())
            expected = 6 / observed_rate
            print(
                f"\n{observed_rate:.2f} requests/s left the queue: Retry-After "
                f"{err.retry_after_s:.2f} s for 6 queued (expected {expected:.2f})"
            )
            assert err.status == 429 and err.retry_after_s is not None
            assert err.retry_after_s == pytest.approx(expected, rel=0.3)
            assert err.retry_after_s > 1.5  # not the constant it starts from
            status = await h.status()
            assert status.drain_rate_per_s == pytest.approx(observed_rate, rel=0.3)
            # Requests that waited over a keepalive interval heard from the scheduler meanwhile.
            assert {k.holder for k in h.keepalives} == {"scheduler"}
            assert {k.state for k in h.keepalives} == {"queued"}
            assert len({k.request_id for k in h.keepalives}) >= 6

    asyncio.run(main())
