"""Cache-aware routing end to end, the whole stack with the real SmolLM2 and a real prefix index
over Redis: requests that share a 1,000-token system prompt go to the executor that holds it and
report the cached tokens; with the index or Redis down every request is still served (routing by
load) and routing recovers by itself when they come back; three scheduler replicas never push an
executor past its cap plus the queue it advertises."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
from e2e_harness import index_match, scheduler_status, wait_for

from services.cli.launcher import Stack
from services.cli.servers import start_redis
from shared.wire import messages, subjects
from shared.wire.block_hash import hash_prompt_blocks
from shared.wire.bus import Bus

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16
SYSTEM_LEN = 1000


def shared_prompt_requests(n: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """A 1,000-token system prompt (ids) and ``n`` prompts that extend it with 20 tokens each."""
    rng = random.Random(seed)
    system = [rng.randrange(1000, 40000) for _ in range(SYSTEM_LEN)]
    return system, [system + [rng.randrange(1000, 40000) for _ in range(20)] for _ in range(n)]


def complete(base_url: str, prompt: list[int], max_tokens: int = 4) -> dict:
    r = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def queries_by_executor(s: Stack) -> dict[str, int]:
    return {e.executor_id: e.prefix_cache_queries_tokens for e in scheduler_status(s).executors}


def test_shared_system_prompt_goes_to_its_holder_and_survives_index_and_redis_outages(stack):
    s = stack(num_executors=2, num_kv_blocks=512, max_model_len=2048)
    system, prompts = shared_prompt_requests(12)
    full_system_blocks = SYSTEM_LEN // BLOCK_SIZE * BLOCK_SIZE  # 992 tokens

    # The first request pays for the system prompt; the index learns who holds it (its KV events
    # reach Redis through the stream); every later one goes there and hits all its full blocks.
    before = queries_by_executor(s)
    first = complete(s.base_url, prompts[0])
    assert cached_tokens(first) == 0
    changed = wait_for(
        lambda: [e for e, q in queries_by_executor(s).items() if q > before.get(e, 0)],
        10,
        "the first request's prefix-cache query in a heartbeat",
    )
    [holder] = changed
    before = queries_by_executor(s)
    wait_for(lambda: index_knows(s, system), 10, "the index to hold the system prompt")
    for prompt in prompts[1:5]:
        assert cached_tokens(complete(s.base_url, prompt)) >= full_system_blocks
    queries = queries_by_executor(s)
    others = [e for e in queries if e != holder]
    assert all(queries[e] == before.get(e, 0) for e in others), queries  # nothing went elsewhere
    status = scheduler_status(s)
    assert status.index_available and status.num_index_fallbacks == 0

    # The index goes away: requests are still served, by load; the scheduler says so.
    index = s.services["prefix_index-0"]
    index.kill()
    for prompt in prompts[5:7]:
        complete(s.base_url, prompt)
    status = scheduler_status(s)
    assert not status.index_available and status.num_index_fallbacks >= 1
    # It comes back: it replays what it missed from the stream, and routing recovers by itself.
    index.spawn()
    wait_for(lambda: index_answers(s), 60, "the restarted index to answer")
    time.sleep(1.2)  # past the scheduler's retry interval
    assert cached_tokens(complete(s.base_url, prompts[7])) >= full_system_blocks
    assert scheduler_status(s).index_available

    # Redis goes away (and comes back empty, it keeps no data): served all along; the index
    # resynchronises from the executors' snapshots and cache routing recovers.
    redis = next(srv for srv in s.servers if srv.name == "redis-server")
    port = redis.port
    redis.stop()
    for prompt in prompts[8:10]:
        complete(s.base_url, prompt)
    assert not scheduler_status(s).index_available
    assert s.credentials is not None  # it comes back as closed as it was: the same index user
    s.servers[s.servers.index(redis)] = start_redis(port, acl=s.credentials.redis_acl())
    wait_for(lambda: index_knows(s, system), 60, "the index to resync after Redis")
    time.sleep(1.2)
    for prompt in prompts[10:]:
        assert cached_tokens(complete(s.base_url, prompt)) >= full_system_blocks
    assert scheduler_status(s).index_available


def index_answers(s: Stack) -> bool:
    return index_match(s, MODEL, [1]) is not None


def index_knows(s: Stack, system: list[int]) -> bool:
    hashes = hash_prompt_blocks(system, BLOCK_SIZE)
    num_blocks = index_match(s, MODEL, hashes)
    return num_blocks is not None and max(num_blocks.values(), default=0) == len(hashes)


def test_three_schedulers_keep_each_executor_within_its_cap(stack):
    max_num_seqs, max_queued = 8, 2
    s = stack(
        num_executors=2,
        num_schedulers=3,
        max_num_seqs=max_num_seqs,
        max_queued=max_queued,
        num_kv_blocks=256,
        max_queue_len=256,
    )
    peaks: dict[str, int] = {}
    refused: dict[str, int] = {}

    async def main() -> list[int]:
        bus = await Bus.connect(s.nats_url, "test-heartbeats", auth=s.admin_auth)

        async def on_heartbeat(msg) -> None:
            hb = messages.EXECUTOR_HEARTBEAT.decode(msg.data)
            if hb.load is not None:
                peaks[hb.executor_id] = hb.load.peak_num_admitted
                refused[hb.executor_id] = hb.load.num_refused

        await bus.subscribe(subjects.EXECUTOR_STATS_ALL, on_heartbeat)
        async with httpx.AsyncClient(base_url=s.base_url, timeout=300) as client:

            async def one(i: int) -> int:
                r = await client.post(
                    "/v1/completions",
                    json={
                        "model": MODEL,
                        "prompt": f"Request {i}: tell me a story.",
                        "max_tokens": 24,
                        "ignore_eos": True,
                    },
                )
                return r.status_code

            statuses = await asyncio.gather(*(one(i) for i in range(60)))
        await asyncio.sleep(1.0)  # the last heartbeats
        await bus.close()
        return list(statuses)

    statuses = asyncio.run(main())
    assert statuses == [200] * 60
    assert set(peaks) == {"executor-0", "executor-1"}
    # Each executor held at most its batch plus its advertised queue; together they held more than
    # one executor's cap, so both were used and the cap was reached.
    assert all(peak <= max_num_seqs + max_queued for peak in peaks.values()), peaks
    assert sum(peaks.values()) > max_num_seqs + max_queued, peaks
    print(f"peaks {peaks}, refused {refused}")
