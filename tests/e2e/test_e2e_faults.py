"""End to end under faults, the whole stack with the real SmolLM2: a client that leaves mid-stream
gives its KV blocks back; an overloaded scheduler answers 429 with Retry-After while the admitted
requests complete; a killed executor ends every waiting client's request with an error, promptly."""

from __future__ import annotations

import asyncio
import time

import httpx
from e2e_harness import parse_sse, scheduler_status, served_model, wait_for

from services.cli.launcher import Stack

LONG_PROMPT = "Write a very long story about a dragon who learns to bake bread."


def free_blocks(s: Stack) -> int:
    [executor] = scheduler_status(s).executors
    return executor.num_free_blocks


def test_client_disconnect_returns_kv_blocks(stack):
    s = stack(num_kv_blocks=128)
    model = served_model(s.base_url, {})
    baseline = free_blocks(s)
    body = {
        "model": model,
        "prompt": LONG_PROMPT,
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with (
        httpx.Client(base_url=s.base_url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(40):  # 20 events (blank separator lines between them)
            next(lines)
        # mid-generation the request holds blocks: its prompt and 20 tokens fill two or more
        # 16-token blocks; a heartbeat from its first steps may still report fewer, so wait for
        # a newer one
        wait_for(lambda: baseline - free_blocks(s) >= 2, 10, "two or more blocks in use")
    # the connection is closed here, mid-stream
    # the executor frees them once the abort arrives (seen through its next heartbeats)
    wait_for(lambda: free_blocks(s) == baseline, 15, "the blocks to come back")
    assert scheduler_status(s).executors[0].num_running == 0


def test_overload_gives_429_with_retry_after_and_admitted_requests_complete(stack):
    s = stack(max_num_seqs=1, max_queue_len=1)
    model = served_model(s.base_url, {})

    async def one(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": LONG_PROMPT,
                "max_tokens": 24,
                "ignore_eos": True,
                "temperature": 0,
            },
        )

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=s.base_url, timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(8)))

    responses = asyncio.run(main())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 429}, [r.text for r in responses]
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
    for r in responses:
        if r.status_code == 429:
            assert float(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] and r.json()["error"]["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 24
    # and it is not stuck: a request after the burst is served
    with httpx.Client(base_url=s.base_url, timeout=120) as client:
        assert (
            client.post(
                "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2}
            ).status_code
            == 200
        )


def test_killed_executor_fails_every_waiting_request_promptly(stack):
    s = stack(request_timeout_s=120, heartbeat_timeout_s=3.0)
    model = served_model(s.base_url, {})
    # 1500 tokens fit the KV cache of 127 usable blocks (16 tokens each) with the prompt.
    body = {
        "model": model,
        "prompt": LONG_PROMPT,
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
    }

    async def streaming(client: httpx.AsyncClient, first: asyncio.Event) -> tuple[str, float]:
        try:
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200, await r.aread()
                raw = ""
                async for text in r.aiter_text():
                    raw += text
                    first.set()
            return raw, time.monotonic()
        finally:
            first.set()  # never leave the test waiting on a request that failed

    async def plain(client: httpx.AsyncClient) -> tuple[httpx.Response, float]:
        r = await client.post("/v1/completions", json=body)
        return r, time.monotonic()

    async def main() -> tuple[float, list, tuple]:
        async with httpx.AsyncClient(base_url=s.base_url, timeout=120) as client:
            firsts = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(streaming(client, f)) for f in firsts]
            non_streaming = asyncio.create_task(plain(client))
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
            for t in streams:
                if t.done():
                    t.result()  # a request that failed before the kill: raise its error
            await asyncio.sleep(0.5)
            await asyncio.to_thread(s.services["executor-0"].kill)
            killed_at = time.monotonic()
            return killed_at, await asyncio.gather(*streams), await non_streaming

    killed_at, streamed, (response, response_at) = asyncio.run(main())
    bound = 20.0  # heartbeat timeout (3 s) + the scheduler's tick, far below the request timeout
    for raw, ended_at in streamed:
        chunks, done = parse_sse(raw)
        assert done and "error" in chunks[-1], raw[-500:]
        assert chunks[-1]["error"]["message"]
        assert ended_at - killed_at < bound
    assert response.status_code >= 500 and response.json()["error"]["message"]
    assert response_at - killed_at < bound
