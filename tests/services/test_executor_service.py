"""The executor: its engine thread (EngineWorker, synchronously with a fake engine) and the service
over a real nats-server with the real SmolLM2 engine: greedy output over NATS equals the engine run
directly, progress and heartbeats, 400 on a bad request, abort, and drain."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid

import pytest

from helpers.stats import engine_stats
from services.executor.service import ExecutorService, ExecutorServiceConfig
from services.executor.worker import (
    Abort,
    Aborted,
    Add,
    EngineWorker,
    Event,
    Failed,
    Outputs,
    Rejected,
)
from shared.wire import messages, subjects
from shared.wire.block_hash import hash_prompt_blocks
from shared.wire.bus import Bus
from shared.wire.keepalive import KEEPALIVE_INTERVAL_S
from shared.wire.kv_events import (
    KV_CACHE_SNAPSHOT,
    KV_EVENTS_MESSAGE,
    KV_SNAPSHOT_REQUEST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVSnapshotRequest,
)
from shared.wire.messages import (
    AbortRequest,
    CompletionDelta,
    ExecuteRequest,
    RequestOutput,
    SamplingParams,
    StreamError,
    StreamKeepalive,
    StreamOutput,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


# -- the engine thread, with a fake engine ---------------------------------------------------------


class FakeEngine:
    """Each request yields one token per step, ``max_tokens`` of them; prompt [0] is rejected,
    prompt [666] makes the step raise."""

    def __init__(self) -> None:
        self.requests: dict[str, list[int]] = {}
        self.thread_ids: set[int] = set()

    def add_request(self, request_id, prompt, params, *, priority=0, block_hashes=None):
        self.thread_ids.add(threading.get_ident())
        if prompt == [0]:
            raise ValueError("prompt is empty")
        self.requests[request_id] = [params.max_tokens, 0, prompt[0]]

    def step(self):
        self.thread_ids.add(threading.get_ident())
        outs = []
        for rid, state in list(self.requests.items()):
            if state[2] == 666:
                raise RuntimeError("kernel exploded")
            state[1] += 1
            done = state[1] == state[0]
            outs.append(
                RequestOutput(
                    request_id=rid,
                    num_prompt_tokens=1,
                    num_cached_tokens=0,
                    finished=done,
                    deltas=[
                        CompletionDelta(
                            index=0,
                            token_ids=[state[1]],
                            text=str(state[1]),
                            finish_reason="length" if done else None,
                        )
                    ],
                )
            )
            if done:
                del self.requests[rid]
        return outs

    def take_kv_events(self):
        self.thread_ids.add(threading.get_ident())
        return None

    def take_first_scheduled(self) -> list[str]:
        return []

    def kv_cache_snapshot(self) -> tuple[int, list[int]]:
        return 0, []

    def abort(self, request_id):
        return self.requests.pop(request_id, None) is not None

    def has_unfinished(self):
        return bool(self.requests)

    def stats(self):
        return engine_stats(num_running=len(self.requests), num_total_blocks=10, num_free_blocks=10)


def run_worker(commands, until):
    """Start a worker on a FakeEngine, feed commands, collect events until ``until(events)``."""
    engine = FakeEngine()
    worker = EngineWorker(engine)
    got: queue.SimpleQueue = queue.SimpleQueue()

    def deliver(evs: list[Event]) -> None:
        for e in evs:
            got.put(e)

    worker.start(deliver)
    for c in commands:
        worker.submit(c)
    events: list[Event] = []
    while not until(events):
        events.append(got.get(timeout=5))
    worker.stop(5)
    assert not worker.alive
    assert engine.thread_ids == {worker._thread.ident}  # only the engine thread touched it
    return events


def ex(rid: str, prompt: list[int], max_tokens: int = 3) -> Add:
    return Add(
        ExecuteRequest(
            request_id=rid,
            model="m",
            prompt_token_ids=prompt,
            block_hashes=[],
            params=SamplingParams(max_tokens=max_tokens),
        )
    )


def finished(events, rid):
    return any(
        isinstance(e, Outputs) and any(o.request_id == rid and o.finished for o in e.outputs)
        for e in events
    )


def test_worker_steps_until_done_and_rejects_bad_requests():
    events = run_worker(
        [ex("a", [5]), ex("bad", [0])],
        lambda evs: finished(evs, "a") and any(isinstance(e, Rejected) for e in evs),
    )
    assert Rejected("bad", "prompt is empty") in events
    tokens = [
        d.token_ids[0]
        for e in events
        if isinstance(e, Outputs)
        for o in e.outputs
        for d in o.deltas
    ]
    assert tokens == [1, 2, 3]


def test_worker_abort_and_failed_step():
    events = run_worker(
        [ex("a", [5], max_tokens=10**6), Abort("a"), Abort("unknown")],
        lambda evs: sum(isinstance(e, Aborted) for e in evs) == 2,
    )
    assert Aborted("a", True) in events and Aborted("unknown", False) in events
    events = run_worker([ex("x", [666])], lambda evs: any(isinstance(e, Failed) for e in evs))
    failure = next(e for e in events if isinstance(e, Failed))
    assert failure.request_ids == ["x"] and "kernel exploded" in failure.message


# -- the service over NATS, with the real engine ---------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine

    return Engine(
        EngineConfig(dtype="float32", num_kv_blocks=64, max_num_seqs=4, num_threads=1),
        progress=False,
    )


def direct_greedy(engine, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("direct", prompt_ids, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.deltas[0].token_ids
    return tokens


class Client:
    """Plays scheduler + gateway: sends ExecuteRequests and records streams, progress,
    heartbeats."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.progress: list[tuple[str, str]] = []
        self.heartbeats: list[messages.ExecutorHeartbeat] = []
        self.kv_batches: list[KVEventBatch] = []
        self.kv_senders: set[tuple[str, str, str]] = set()  # (executor_id, epoch, model)

    async def start(self) -> None:
        async def on_progress(msg) -> None:
            p = messages.REQUEST_PROGRESS.decode(msg.data)
            self.progress.append((p.request_id, p.state))

        async def on_heartbeat(msg) -> None:
            self.heartbeats.append(messages.EXECUTOR_HEARTBEAT.decode(msg.data))

        async def on_kv_events(msg) -> None:
            assert msg.subject == subjects.kv_events("ex-test")
            message = KV_EVENTS_MESSAGE.decode(msg.data)
            self.kv_senders.add((message.executor_id, message.epoch, message.model))
            self.kv_batches.append(message.batch)

        await self.bus.subscribe(subjects.KV_EVENTS_ALL, on_kv_events)
        await self.bus.subscribe(subjects.SCHEDULER_PROGRESS, on_progress)
        await self.bus.subscribe(subjects.EXECUTOR_STATS_ALL, on_heartbeat)
        await self.bus.flush()

    async def dispatch(
        self, executor_id: str, rid: str, prompt: list[int], params: SamplingParams
    ) -> messages.ExecuteReply:
        """As the scheduler dispatches: a request the executor answers."""
        request = ExecuteRequest(
            request_id=rid,
            model="m",
            prompt_token_ids=prompt,
            block_hashes=hash_prompt_blocks(prompt, 16),
            params=params,
        )
        data = await self.bus.request(
            subjects.executor_decode(executor_id),
            messages.EXECUTE_REQUEST.encode(request),
            timeout=5,
        )
        return messages.EXECUTE_REPLY.decode(data)

    async def run(
        self,
        executor_id: str,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        abort_after: int | None = None,
        block_hashes: list[int] | None = None,
    ) -> list:
        out = []
        if block_hashes is None:
            block_hashes = hash_prompt_blocks(prompt, 16)  # as the tokenizer sends them
        async with await self.bus.subscribe_iter(subjects.stream(rid)) as sub:
            await self.bus.publish(
                subjects.executor_decode(executor_id),
                messages.EXECUTE_REQUEST.encode(
                    ExecuteRequest(
                        request_id=rid,
                        model="m",
                        prompt_token_ids=prompt,
                        block_hashes=block_hashes,
                        params=params,
                    )
                ),
            )
            while True:
                msg = messages.STREAM_MESSAGE.decode((await sub.next(60)).data)
                if isinstance(msg, StreamKeepalive):  # a slow step: the request is alive
                    continue
                out.append(msg)
                if abort_after is not None and len(out) == abort_after:
                    await self.bus.publish(
                        subjects.ABORT, messages.ABORT_REQUEST.encode(AbortRequest(request_id=rid))
                    )
                if isinstance(msg, StreamError) or msg.output.finished:
                    return out


def replay(batches: list[KVEventBatch]) -> set[int]:
    """The cached set that applying the batches in order describes."""
    held: set[int] = set()
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()
    return held


async def wait_for(predicate, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_service_over_nats_matches_engine(nats_url, engine):
    prompt = engine.tokenizer.encode("The capital of France is")
    expected = direct_greedy(engine, prompt, GREEDY)
    assert len(expected) == 12

    async def main() -> None:
        service_bus = await Bus.connect(nats_url, "executor-test")
        service = ExecutorService(
            service_bus,
            EngineWorker(engine, num_threads=1),
            ExecutorServiceConfig(
                executor_id="ex-test",
                model_name=engine.model_name,
                max_model_len=engine.max_model_len,
                block_size=16,
                max_num_seqs=4,
                max_queued=1,
                heartbeat_interval_s=0.1,
                drain_timeout_s=0.5,
            ),
        )
        client = Client(await Bus.connect(nats_url, "client-test"))
        await client.start()
        await service.start()
        try:
            # Greedy output over NATS equals the engine run directly, and streams in several deltas.
            rid = uuid.uuid4().hex
            outs = await client.run("ex-test", rid, prompt, GREEDY)
            assert all(isinstance(o, StreamOutput) and o.executor_id == "ex-test" for o in outs)
            assert [t for o in outs for t in o.output.deltas[0].token_ids] == expected
            assert len(outs) > 1 and outs[-1].output.deltas[0].finish_reason == "length"
            assert "".join(o.output.deltas[0].text for o in outs) == engine.tokenizer.decode(
                expected
            )
            await wait_for(lambda: (rid, "finished") in client.progress)
            assert [s for r, s in client.progress if r == rid] == ["started", "finished"]
            # Its KV events: consecutive batches, the prompt's full blocks stored under its hashes.
            await wait_for(lambda: bool(client.kv_batches))
            seqs = [b.seq for b in client.kv_batches]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            stored = [
                h
                for b in client.kv_batches
                for e in b.events
                if isinstance(e, BlockStored)
                for h in e.block_hashes
            ]
            assert stored[: len(prompt) // 16] == hash_prompt_blocks(prompt, 16)
            assert client.kv_senders == {("ex-test", service.epoch, engine.model_name)}

            # Two at once: both complete with the same greedy tokens (batched together).
            r1, r2 = uuid.uuid4().hex, uuid.uuid4().hex
            a, b = await asyncio.gather(
                client.run("ex-test", r1, prompt, GREEDY), client.run("ex-test", r2, prompt, GREEDY)
            )
            for outs in (a, b):
                assert [t for o in outs for t in o.output.deltas[0].token_ids] == expected

            # A request the engine refuses: 400 and 'finished' (no 'started').
            bad = uuid.uuid4().hex
            outs = await client.run("ex-test", bad, [10**8], GREEDY)
            assert isinstance(outs[-1], StreamError) and outs[-1].status == 400
            assert outs[-1].type == "invalid_request_error" and "vocabulary" in outs[-1].message
            await wait_for(lambda: (bad, "finished") in client.progress)
            assert (bad, "started") not in client.progress

            # Block hashes that do not fit the prompt (one per full block of 16): 400, never run.
            long_prompt = prompt * 8
            assert len(long_prompt) // 16 >= 2
            bad_hashes = uuid.uuid4().hex
            outs = await client.run(
                "ex-test",
                bad_hashes,
                long_prompt,
                GREEDY,
                block_hashes=hash_prompt_blocks(long_prompt, 16)[:-1],
            )
            assert isinstance(outs[-1], StreamError) and outs[-1].status == 400
            assert "block_hashes has" in outs[-1].message and "blocks of 16" in outs[-1].message

            # Abort mid-generation: a final 'abort' output, then 'finished'; the KV blocks come
            # back.
            long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            ab = uuid.uuid4().hex
            outs = await client.run("ex-test", ab, prompt, long, abort_after=2)
            assert outs[-1].output.finished and outs[-1].output.deltas[0].finish_reason == "abort"
            assert sum(len(o.output.deltas[0].token_ids) for o in outs) < 200
            await wait_for(lambda: (ab, "finished") in client.progress)

            # Admission: 4 running + 1 queued are taken, the sixth is refused as full; each reply
            # carries the load after its decision.
            held = [uuid.uuid4().hex for _ in range(6)]
            replies = [await client.dispatch("ex-test", rid, prompt, long) for rid in held]
            assert [r.accepted for r in replies] == [True] * 5 + [False]
            assert [r.load.num_admitted for r in replies] == [1, 2, 3, 4, 5, 5]
            assert {r.load.max_admitted for r in replies} == {5}
            versions = [r.load.version for r in replies[:5]]
            assert versions == sorted(set(versions))
            for rid in held[:5]:
                await client.bus.publish(
                    subjects.ABORT, messages.ABORT_REQUEST.encode(AbortRequest(request_id=rid))
                )
            for rid in held[:5]:
                await wait_for(lambda rid=rid: (rid, "finished") in client.progress)

            # The snapshot is the set the event batches describe, up to the last batch's seq.
            await asyncio.sleep(0.3)  # the aborted requests' last steps' events are published
            data = await client.bus.request(
                subjects.executor_kv_snapshot("ex-test"),
                KV_SNAPSHOT_REQUEST.encode(KVSnapshotRequest()),
                timeout=5,
            )
            snapshot = KV_CACHE_SNAPSHOT.decode(data)
            assert (snapshot.executor_id, snapshot.epoch) == ("ex-test", service.epoch)
            assert snapshot.seq == client.kv_batches[-1].seq
            assert sorted(snapshot.block_hashes) == sorted(replay(client.kv_batches))

            # Heartbeats: one epoch, the engine's numbers (nothing running once the abort is
            # applied).
            await wait_for(
                lambda: len(client.heartbeats) >= 3 and client.heartbeats[-1].stats.num_running == 0
            )
            hb = client.heartbeats[-1]
            assert {h.epoch for h in client.heartbeats} == {service.epoch}
            assert (hb.executor_id, hb.role, hb.max_num_seqs, hb.draining) == (
                "ex-test",
                "both",
                4,
                False,
            )
            assert hb.stats.num_total_blocks == 63 and hb.stats.num_free_blocks == 63

            # Drain: an in-flight request that cannot finish in drain_timeout gets a 503 error
            # event; a request arriving while draining gets 503 at once; heartbeats say draining.
            slow = uuid.uuid4().hex
            task = asyncio.create_task(client.run("ex-test", slow, prompt, long))
            await wait_for(lambda: (slow, "started") in client.progress, 30)
            await service.drain()
            outs = await asyncio.wait_for(task, 10)
            assert isinstance(outs[-1], StreamError) and outs[-1].status == 503
            assert "shut down" in outs[-1].message
            assert client.heartbeats[-1].draining
            late = await client.run("ex-test", uuid.uuid4().hex, prompt, GREEDY)
            assert isinstance(late[-1], StreamError) and late[-1].status == 503
            # Dispatched as the scheduler does, it is refused instead (routed elsewhere).
            refused = await client.dispatch("ex-test", uuid.uuid4().hex, prompt, GREEDY)
            assert not refused.accepted and refused.load.num_admitted == 0
        finally:
            await client.bus.close()
            await service_bus.close()

    asyncio.run(main())


class SilentEngine(FakeEngine):
    """Prompt [777] is taken and then produces nothing, step after step (a long prefill, or a
    request waiting for room); the others run as FakeEngine's."""

    def step(self):
        time.sleep(0.02)  # a step takes time: no busy loop while the silent request is held
        silent = {rid: s for rid, s in self.requests.items() if s[2] == 777}
        for rid in silent:
            del self.requests[rid]
        try:
            return super().step()
        finally:
            self.requests.update(silent)


def test_a_request_without_output_gets_keepalives_until_it_ends(nats_url):
    """Its stream is never silent for longer than a keepalive interval (and a heartbeat): the
    executor says it holds the request, still waiting for its first token, until it is aborted."""

    async def main() -> None:
        engine = SilentEngine()
        service_bus = await Bus.connect(nats_url, "executor-keepalive-test")
        service = ExecutorService(
            service_bus,
            EngineWorker(engine),
            ExecutorServiceConfig(
                executor_id="ex-keep",
                model_name="m",
                max_model_len=64,
                block_size=16,
                max_num_seqs=2,
                heartbeat_interval_s=0.25,
            ),
        )
        client = Client(await Bus.connect(nats_url, "client-test"))
        await client.start()
        await service.start()
        try:
            rid = uuid.uuid4().hex
            async with await client.bus.subscribe_iter(subjects.stream(rid)) as sub:
                reply = await client.dispatch("ex-keep", rid, [777], GREEDY)
                assert reply.accepted
                loop = asyncio.get_running_loop()
                last = loop.time()
                gaps: list[float] = []
                keepalives: list[StreamKeepalive] = []
                while len(keepalives) < 2:
                    msg = messages.STREAM_MESSAGE.decode((await sub.next(10)).data)
                    now = loop.time()
                    gaps.append(now - last)
                    last = now
                    assert isinstance(msg, StreamKeepalive), msg
                    keepalives.append(msg)
                assert {(k.holder, k.state) for k in keepalives} == {("ex-keep", "waiting")}
                assert max(gaps) < KEEPALIVE_INTERVAL_S + 1.0
                await client.bus.publish(
                    subjects.ABORT, messages.ABORT_REQUEST.encode(AbortRequest(request_id=rid))
                )
                while True:  # the aborted request's final output ends the keepalives
                    msg = messages.STREAM_MESSAGE.decode((await sub.next(10)).data)
                    if isinstance(msg, StreamOutput):
                        assert msg.output.finished
                        break
            await wait_for(lambda: (rid, "finished") in client.progress)
        finally:
            await service.drain()
            await client.bus.close()
            await service_bus.close()

    asyncio.run(main())


def test_a_request_nobody_reads_is_aborted_and_one_read_is_not(nats_url):
    """A request whose stream lost its reader (its gateway died: no abort was ever sent) is aborted
    at the next client check; one whose reader is there runs on, however long it is silent."""

    async def main() -> None:
        engine = SilentEngine()
        service_bus = await Bus.connect(nats_url, "executor-orphan-test")
        service = ExecutorService(
            service_bus,
            EngineWorker(engine),
            ExecutorServiceConfig(
                executor_id="ex-orphan",
                model_name="m",
                max_model_len=64,
                block_size=16,
                max_num_seqs=2,
                client_check_interval_s=0.3,
            ),
        )
        client = Client(await Bus.connect(nats_url, "client-orphan-test"))
        await client.start()
        await service.start()
        read, orphan = uuid.uuid4().hex, uuid.uuid4().hex
        try:
            async with await client.bus.subscribe_iter(subjects.stream(read)):
                async with await client.bus.subscribe_iter(subjects.stream(orphan)):
                    for rid in (read, orphan):
                        assert (await client.dispatch("ex-orphan", rid, [777], GREEDY)).accepted
                    await asyncio.sleep(0.8)  # two checks: both have readers
                    assert set(engine.requests) == {read, orphan}
                # The orphan's reader is gone without an abort, as when its gateway dies.
                t0 = time.monotonic()
                await wait_for(lambda: (orphan, "finished") in client.progress)
                assert time.monotonic() - t0 < 0.3 + 0.3 / 5 + 0.5
                assert set(engine.requests) == {read}
                await asyncio.sleep(0.8)  # more checks: the request still read stays
                assert set(engine.requests) == {read} and (read, "finished") not in client.progress
        finally:
            await service.drain()
            await client.bus.close()
            await service_bus.close()

    asyncio.run(main())
