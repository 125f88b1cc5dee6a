"""Nothing lost when a process dies: the whole stack with the real SmolLM2, supervised as
``llmserve up`` supervises it, and one process SIGKILLed at a time.

- nats-server: every stream in flight ends with an error event at once (no hang), /health says
  NATS is down (503 with Retry-After), the launcher restarts the server on its port (reaped: no
  zombie; JetStream's store kept) and the stack serves again within seconds (measured, printed).
- redis-server: restarted; every request is served throughout (routing by load meanwhile) and
  the prefix index resyncs from the executors' snapshots.
- the scheduler with requests queued in it, the tokenizer with requests it holds: every client
  gets an answer or an error within the bound (the gateway's progress timeout), none hangs; after
  the restart new requests succeed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass

import httpx
import nats
import pytest
from e2e_harness import parse_sse, scheduler_status, served_model

from services.cli.launcher import Stack
from services.cli.servers import ServerProcess
from shared.wire import messages, subjects
from shared.wire.bus import Bus

# The gateway's default progress timeout (GatewayConfig.progress_timeout_s): a request whose
# holder died ends this long after the holder's last keepalive at the latest. The slack covers a
# loaded 2-core host (and the scheduler's tick).
PROGRESS_TIMEOUT_S = 10.0
BOUND_S = PROGRESS_TIMEOUT_S + 5.0
LONG = {"prompt": "Write a very long story about a dragon.", "max_tokens": 400, "ignore_eos": True}


@dataclass
class Outcome:
    status: int  # the HTTP status (200 for a stream that then ended with an error event)
    error: str | None  # the error message, from the body or the stream's error event
    ended_at: float


def server(s: Stack, name: str) -> ServerProcess:
    return next(srv for srv in s.servers if srv.name == name)


def supervised(stack, **settings) -> tuple[Stack, list[str]]:
    s = stack(**settings)
    notes: list[str] = []
    s.supervise_in_background(notes.append, interval_s=0.25)
    return s, notes


async def send(
    client: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None
) -> Outcome:
    """One request to its end; a stream's outcome is its error event, if any. ``started`` is set
    at the first chunk of a stream."""
    try:
        if not body.get("stream"):
            r = await client.post("/v1/completions", json=body)
            error = None if r.status_code == 200 else r.json()["error"]["message"]
            return Outcome(r.status_code, error, time.monotonic())
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                body_ = json.loads(await r.aread())
                return Outcome(r.status_code, body_["error"]["message"], time.monotonic())
            raw = ""
            async for text in r.aiter_text():
                raw += text
                if started is not None:
                    started.set()
            chunks, done = parse_sse(raw)
            assert done, raw[-300:]
            errors = [c["error"]["message"] for c in chunks if "error" in c]
            return Outcome(200, errors[0] if errors else None, time.monotonic())
    finally:
        if started is not None:
            started.set()


def recover(base_url: str, model: str, since: float, timeout: float = 60.0) -> float:
    """Seconds from ``since`` until a completion succeeds again (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base_url, timeout=30) as client:
        while time.monotonic() < deadline:
            try:
                r = client.post(
                    "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2}
                )
                if r.status_code == 200:
                    return time.monotonic() - since
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise AssertionError(f"the stack did not serve again within {timeout}s")


async def kv_stream_messages(s: Stack) -> int:
    """Messages the KV events stream keeps, asked as the stack's admin user."""
    auth = s.admin_auth
    nc = await nats.connect(s.nats_url, user=auth.user, password=auth.password)
    try:
        info = await nc.jetstream().stream_info(subjects.KV_EVENTS_STREAM)
        return int(info.state.messages)
    finally:
        await nc.close()


def test_nats_server_killed_streams_end_with_an_error_and_the_stack_recovers(stack):
    s, notes = supervised(stack, request_timeout_s=300, max_num_seqs=4, num_kv_blocks=512)
    model = served_model(s.base_url, {})
    # A prompt of full blocks: the executor's KV events land in the JetStream stream.
    r = httpx.post(
        s.base_url + "/v1/completions",
        json={"model": model, "prompt": "one two three four five six " * 8, "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    wait_until(lambda: asyncio.run(kv_stream_messages(s)) > 0, 10, "stored KV events")
    stored = asyncio.run(kv_stream_messages(s))
    nats_server = server(s, "nats-server")
    old_pid = nats_server.pid

    async def main() -> tuple[float, list[Outcome], httpx.Response]:
        async with httpx.AsyncClient(base_url=s.base_url, timeout=120) as client:
            firsts = [asyncio.Event() for _ in range(3)]
            body = {"model": model, "stream": True, **LONG, "max_tokens": 1500}
            streams = [asyncio.create_task(send(client, body, f)) for f in firsts]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
            os.kill(old_pid, signal.SIGKILL)
            killed_at = time.monotonic()

            # The gateway sees the connection drop at once; until it is back (the supervisor
            # restarts the server within a few tenths of a second), /health names NATS. Probes
            # go out every 10 ms without waiting for each other: one sent before the drop was
            # noticed waits out its status requests, the window may be over by then.
            async def probe(delay_s: float) -> httpx.Response:
                await asyncio.sleep(delay_s)
                return await client.get("/health")

            answers = await asyncio.gather(*(probe(i * 0.01) for i in range(100)))
            down = [h for h in answers if h.status_code == 503 and "NATS" in h.json()["reason"]]
            health = down[0] if down else answers[-1]
            return killed_at, await asyncio.gather(*streams), health

    killed_at, outcomes, health = asyncio.run(main())
    for o in outcomes:
        assert o.status == 200 and o.error and "message bus" in o.error, o
        assert o.ended_at - killed_at < 2.0  # ended by the lost connection, not a timeout
    assert health.status_code == 503, health.text
    assert "NATS" in health.json()["reason"] and health.json()["dependencies"]["nats"] == "down"
    assert int(health.headers["retry-after"]) >= 1
    recovered_s = recover(s.base_url, model, killed_at)
    print(
        f"\nnats-server SIGKILLed: {len(outcomes)} streams ended with an error within "
        f"{max(o.ended_at - killed_at for o in outcomes):.2f} s; the stack served again "
        f"{recovered_s:.2f} s after the kill"
    )
    print("\n".join(n.splitlines()[0] for n in notes))
    assert nats_server.num_restarts == 1 and nats_server.pid != old_pid
    assert not os.path.exists(f"/proc/{old_pid}")  # reaped, not a zombie
    assert nats_server.port == int(s.nats_url.rsplit(":", 1)[1])
    assert recovered_s < 15.0
    # The executor aborted what it held when it lost the bus: nothing runs on for nobody (the
    # three 1,500-token requests would take half a minute).
    wait_until(lambda: scheduler_status(s).executors[0].num_running == 0, 5, "the cut requests")
    # The JetStream store survived the restart: the KV events kept are still there.
    assert asyncio.run(kv_stream_messages(s)) >= stored
    assert httpx.get(s.base_url + "/health", timeout=10).status_code == 200


def test_redis_server_killed_is_restarted_while_every_request_is_served(stack):
    s, notes = supervised(
        stack, num_executors=2, num_kv_blocks=256, max_model_len=1024, request_timeout_s=120
    )
    model = served_model(s.base_url, {})
    deadline = time.monotonic() + 120
    while len(scheduler_status(s).executors) < 2:
        assert time.monotonic() < deadline, "two executors"
        time.sleep(0.2)
    # A prompt with full blocks: with two executors the scheduler asks the index for each.
    prompt = "The quick brown fox jumps over the lazy dog. " * 12

    def complete(i: int) -> None:
        r = httpx.post(
            s.base_url + "/v1/completions",
            json={"model": model, "prompt": f"{prompt} {i}", "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200, r.text

    complete(0)
    wait_until(lambda: index_status(s).num_block_entries > 0, 20, "an indexed block")
    redis_server = server(s, "redis-server")
    old_pid = redis_server.pid
    os.kill(old_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    served = 0
    while redis_server.num_restarts == 0 or time.monotonic() - killed_at < 3.0:
        complete(served + 1)  # served throughout: routed by load while the index cannot answer
        served += 1
        assert time.monotonic() - killed_at < 60, "redis-server was not restarted"
    # The index finds Redis empty (no persistence) and resyncs from the executors' snapshots.
    wait_until(lambda: index_status(s).num_resyncs >= 1, 30, "a resync")
    wait_until(lambda: index_status(s).num_block_entries > 0, 30, "blocks indexed again")
    resynced_s = time.monotonic() - killed_at
    complete(served + 1)
    wait_until(lambda: scheduler_status(s).index_available, 10, "cache routing again")
    print(
        f"\nredis-server SIGKILLed: {served} requests served meanwhile, all 200 "
        f"({scheduler_status(s).num_index_fallbacks} routed by load without the index); "
        f"the index resynced {resynced_s:.2f} s after the kill"
    )
    print("\n".join(n.splitlines()[0] for n in notes))
    assert redis_server.pid != old_pid and not os.path.exists(f"/proc/{old_pid}")
    assert served >= 1


@pytest.mark.timeout(400)
def test_killed_scheduler_and_tokenizer_leave_no_request_hanging(stack):
    # One sequence at a time and no room to queue at the executor: the rest waits in the
    # scheduler's queue.
    s, notes = supervised(stack, max_num_seqs=1, max_queued=0, request_timeout_s=300)
    model = served_model(s.base_url, {})

    async def scheduler_case() -> tuple[float, list[Outcome], float, float]:
        async with httpx.AsyncClient(base_url=s.base_url, timeout=300) as client:
            body = {"model": model, **LONG, "max_tokens": 100}
            tasks = [asyncio.create_task(send(client, body)) for _ in range(8)]
            deadline = time.monotonic() + 60
            while (await asyncio.to_thread(scheduler_status, s)).num_queued < 5:
                assert time.monotonic() < deadline, "requests queued in the scheduler"
                await asyncio.sleep(0.1)
            await asyncio.to_thread(s.services["scheduler-0"].kill)
            killed_at = time.monotonic()
            # Meanwhile: how soon a scheduler answers again, and a new request is served (behind
            # the one request the executor runs at a time).
            back = asyncio.create_task(asyncio.to_thread(scheduler_back, s, killed_at))
            recovery = asyncio.create_task(asyncio.to_thread(recover, s.base_url, model, killed_at))
            return killed_at, await asyncio.gather(*tasks), await back, await recovery

    killed_at, outcomes, back_s, recovered_s = asyncio.run(scheduler_case())
    stalled = [o for o in outcomes if o.status == 503 and "no progress" in (o.error or "")]
    print(
        f"\nscheduler SIGKILLed with requests queued: {len(stalled)} queued ones got 503 within "
        f"{max(o.ended_at - killed_at for o in outcomes):.1f} s; "
        f"{sum(o.status == 200 and not o.error for o in outcomes)} completed"
    )
    for o in outcomes:
        assert o.ended_at - killed_at < BOUND_S, o  # an answer or an error, never a hang
        assert (o.status == 200 and o.error is None) or o.status == 503, o
    assert len(stalled) >= 5, outcomes  # the queued ones: lost with the scheduler, not hanging
    print(
        f"a scheduler answered again {back_s:.2f} s after the kill; a new request (behind the "
        f"one running) succeeded {recovered_s:.2f} s after the kill"
    )

    # The tokenizer: prompts near its character cap take it a while each, so it holds a queue.
    async def tokenizer_case() -> tuple[float, list[Outcome], float]:
        async with httpx.AsyncClient(base_url=s.base_url, timeout=300) as client:
            big = {"model": model, "prompt": "word " * 26_000, "max_tokens": 1}
            first = asyncio.Event()

            async def one() -> Outcome:
                o = await send(client, big)
                first.set()
                return o

            tasks = [asyncio.create_task(one()) for _ in range(40)]
            await asyncio.wait_for(first.wait(), 120)  # it is tokenizing: the first is answered
            await asyncio.to_thread(s.services["tokenizer-0"].kill)
            killed_at = time.monotonic()
            recovery = asyncio.create_task(asyncio.to_thread(recover, s.base_url, model, killed_at))
            return killed_at, await asyncio.gather(*tasks), await recovery

    killed_at, outcomes, recovered_s = asyncio.run(tokenizer_case())
    held = [o for o in outcomes if o.status == 503]
    print(
        f"tokenizer SIGKILLed holding requests: {len(held)} got 503 within "
        f"{max(o.ended_at - killed_at for o in outcomes):.1f} s, "
        f"{sum(o.status == 400 for o in outcomes)} were answered (400: over the context) before"
    )
    for o in outcomes:
        assert o.ended_at - killed_at < BOUND_S, o
        assert o.status in (400, 503), o
    assert held, outcomes
    print(f"a new request succeeded {recovered_s:.2f} s after the kill")
    print("\n".join(n.splitlines()[0] for n in notes))


def scheduler_back(s: Stack, since: float, timeout: float = 60.0) -> float:
    """Seconds from ``since`` until a scheduler answers its status request."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            scheduler_status(s)
            return time.monotonic() - since
        except Exception:
            time.sleep(0.05)
    raise AssertionError(f"no scheduler answered within {timeout}s")


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def index_status(s: Stack) -> messages.PrefixIndexStatus:
    async def ask() -> messages.PrefixIndexStatus:
        async with await Bus.connect(s.nats_url, "e2e-test", auth=s.admin_auth) as bus:
            data = await bus.request(
                subjects.PREFIX_INDEX_STATUS,
                messages.PREFIX_INDEX_STATUS_REQUEST.encode(messages.PrefixIndexStatusRequest()),
                timeout=5,
            )
            return messages.PREFIX_INDEX_STATUS.decode(data)

    return asyncio.run(ask())
