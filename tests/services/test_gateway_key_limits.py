"""Per-key limits shared across gateway replicas: two gateway processes, one real redis-server, the
fake backend (no model). Also the limiter alone: the gateway's Redis user (ACL) and failing open."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest

from helpers.gateway_harness import FAKE_MODEL, GatewayProcess, wait_until
from services.cli.credentials import REDIS_GATEWAY_USER, StackCredentials
from services.cli.servers import free_port, start_redis
from services.connections import RedisAuth
from services.gateway.api_keys import ApiKey
from services.gateway.errors import APIError
from services.gateway.limiter import Limiter
from services.gateway.metrics import GatewayMetrics
from services.prefix_index.store import connect_redis

LEASE_TTL_S = 1.5


def _key(**limits) -> tuple[str, str, dict]:
    """A fresh key (and name: the session's Redis is shared) as a keys-file line."""
    name, key = f"k-{uuid.uuid4().hex[:8]}", f"sk-{uuid.uuid4().hex}"
    return name, key, {"key": key, "name": name, **limits}


@pytest.fixture
def replicas(tmp_path, nats_server, redis_server, backend):
    """A factory: two gateways on one Redis, for the keys-file lines given."""
    with ExitStack() as stack:

        def start(*lines: dict) -> tuple[GatewayProcess, GatewayProcess]:
            path = tmp_path / "keys.jsonl"
            path.write_text("".join(json.dumps(line) + "\n" for line in lines))
            args = (
                "--api-keys-file",
                str(path),
                "--redis-url",
                redis_server.url,
                "--limits-lease-ttl",
                str(LEASE_TTL_S),
            )
            gws = (GatewayProcess(nats_server.url, *args), GatewayProcess(nats_server.url, *args))
            for gw in gws:
                stack.callback(gw.stop)
            return gws

        yield start


def _post(base_url: str, key: str, **body) -> httpx.Response:
    payload = {"model": FAKE_MODEL, "prompt": "hello", "max_tokens": 2, **body}
    return httpx.post(
        base_url + "/v1/completions",
        json=payload,
        timeout=20,
        headers={"Authorization": f"Bearer {key}"},
    )


def _metric(text: str, name: str, **labels: str) -> float:
    """The sample's value; 0 when absent (a label set a replica never counted)."""
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


def _metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (every replica's)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_two_replicas_share_a_request_rate_exactly(replicas):
    n = 4  # a request every 15 s refills: the burst below is far shorter
    name, key, line = _key(requests_per_minute=n)
    a, b = replicas(line)
    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _post((a, b)[i % 2].base_url, key), range(12)))
    elapsed = time.monotonic() - start
    assert elapsed < 10
    assert sorted(r.status_code for r in answers) == [200] * n + [429] * (12 - n)
    refill_s = 60 / n
    for r in answers:
        if r.status_code == 429:
            error = r.json()["error"]
            assert (
                error["code"] == "rate_limit_exceeded" and error["param"] == "requests_per_minute"
            )
            assert "requests_per_minute" in error["message"] and name in error["message"]
            assert key not in r.text
            # Truthful: the next token is due within one refill, and not before elapsed allows.
            retry_after = int(r.headers["Retry-After"])
            assert refill_s - elapsed - 1 <= retry_after <= refill_s
    # Either replica's /metrics serves both replicas' series (labelled by replica; the other's
    # from its last report, within a report interval): they add up to the same split.
    for gw in (a, b):
        deadline = time.monotonic() + 5
        while True:
            text = httpx.get(gw.base_url + "/metrics").text
            admitted = _metric_sum(text, "llmserve:api_key_requests_total", key_name=name)
            rejected = _metric_sum(
                text, "llmserve:api_key_rejected_total", key_name=name, limit="requests_per_minute"
            )
            if (admitted, rejected) == (n, 12 - n) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert (admitted, rejected) == (n, 12 - n)
        assert key not in text


def test_retry_after_of_the_token_bucket_is_enough_to_get_through(replicas):
    # 600 tokens a minute = 10 a second. The fake backend's prompts are 7 tokens once tokenized
    # (NUM_PROMPT_TOKENS) and it generates max_tokens: a request reserving 2 ("hello": 5 bytes / 4,
    # rounded up) + 291 uses 7 + 291 = 298, all of its reservation and more.
    _, key, line = _key(tokens_per_minute=600)
    a, b = replicas(line)
    assert _post(a.base_url, key, max_tokens=291).status_code == 200
    assert _post(b.base_url, key, max_tokens=291).status_code == 200
    # 600 - 2 x 298 = 4 left; this one reserves 2 + 20 = 22: 18 short, at 10 a second 1.8 s
    # (less what refilled while the two ran).
    r = _post(a.base_url, key, max_tokens=20)
    assert r.status_code == 429 and r.json()["error"]["param"] == "tokens_per_minute"
    retry_after = int(r.headers["Retry-After"])
    assert 1 <= retry_after <= 2
    time.sleep(retry_after)
    assert _post(b.base_url, key, max_tokens=20).status_code == 200
    # More than the bucket ever holds: no wait would help, so not a 429.
    r = _post(a.base_url, key, prompt="x" * 4000)
    assert r.status_code == 400 and "tokens_per_minute" in r.json()["error"]["message"]


def test_tokens_reserved_and_not_used_are_given_back(replicas, redis_server):
    # 600 tokens a minute; a request reserves 4 (prompt: 16 bytes / 4) + 500 = 504 tokens.
    name, key, line = _key(tokens_per_minute=600)
    a, b = replicas(line)
    # It generates one token, then fails: charged its 7 prompt tokens (NUM_PROMPT_TOKENS, as the
    # stream reported them) + 1, so 496 go back into the bucket.
    r = _post(a.base_url, key, prompt="fail_after_first", max_tokens=500, stream=True)
    assert r.status_code == 200 and "executor died" in r.text
    # Without the refund the bucket would hold 96 (+ 10 a second) and this one wait ~40 s: 429.
    ok = _post(b.base_url, key, prompt="hello", max_tokens=500)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 500

    # One gateway's /metrics serves both replicas' series (the other's within a report interval).
    def refunded() -> float:
        text = httpx.get(a.base_url + "/metrics").text
        return _metric_sum(text, "llmserve:api_key_tokens_refunded_total", key_name=name)

    # The first request's 496; the second reserved 2 + 500 and used 7 + 500: nothing back.
    wait_until(lambda: refunded() == 496)
    client = connect_redis(redis_server.url, 5.0)
    level = float(asyncio.run(_hget(client, f"llmserve:gw:{{{name}}}:buckets", "tl")))
    assert level < 200  # the second request's 500 generated tokens stay spent


async def _hget(client, key: str, field: str):
    try:
        return await client.hget(key, field)
    finally:
        await client.aclose()


def _open_stream(base_url: str, key: str, stack: ExitStack) -> httpx.Response:
    """A streaming request that holds its slot until closed (the backend's 'slow' script)."""
    client = stack.enter_context(httpx.Client(timeout=20))
    body = {"model": FAKE_MODEL, "prompt": "slow", "max_tokens": 2000, "stream": True}
    r = stack.enter_context(
        client.stream(
            "POST",
            base_url + "/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
        )
    )
    assert r.status_code == 200
    lines = r.iter_lines()
    next(lines)  # streaming: the slot is held
    # Kept referenced: a collected iterator would close the connection (httpcore), ending it.
    stack.callback(lambda: lines)
    return r


def test_the_concurrency_cap_is_shared_and_a_dead_replicas_slots_expire(replicas):
    _, key, line = _key(max_concurrent=2)
    a, b = replicas(line)
    with ExitStack() as held:
        first = ExitStack()
        held.enter_context(first)
        _open_stream(a.base_url, key, first)
        _open_stream(b.base_url, key, held)
        for gw in (a, b):
            r = _post(gw.base_url, key)
            assert r.status_code == 429 and r.json()["error"]["param"] == "max_concurrent"
            assert 1 <= int(r.headers["Retry-After"]) <= LEASE_TTL_S + 1
        # Held past the lease's ttl: renewed, still counted.
        time.sleep(LEASE_TTL_S * 1.5)
        assert _post(a.base_url, key).status_code == 429
        # A request that ends gives its slot back at once.
        first.close()
        wait_until(lambda: _post(b.base_url, key).status_code == 200, timeout=5)
        # b dies holding a slot (no release, no renewal): the slot expires after the lease's ttl.
        _open_stream(a.base_url, key, held)
        assert _post(a.base_url, key).status_code == 429
        os.kill(b.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: _post(a.base_url, key).status_code == 200, timeout=LEASE_TTL_S + 3)
        assert time.monotonic() - killed_at <= LEASE_TTL_S + 1.5


def test_the_gateways_redis_user_runs_the_limits_and_nothing_else():
    creds = StackCredentials.generate()
    server = start_redis(acl=creds.redis_acl())
    try:

        async def main() -> None:
            auth = RedisAuth(REDIS_GATEWAY_USER, creds.redis_gateway_password)
            limiter = Limiter(connect_redis(server.url, 2.0, auth), GatewayMetrics(), lease_ttl_s=5)
            key = ApiKey(
                name="a", key="sk", requests_per_minute=1, tokens_per_minute=100, max_concurrent=1
            )
            lease = await limiter.admit(key, 1)
            assert lease.lease_id is not None and lease.num_reserved_tokens == 1
            await limiter.renew()
            await limiter.release(lease, 0)  # the slot, and the 1 token unused
            assert limiter.metrics.api_key_tokens_refunded.labels("a")._value.get() == 1
            with pytest.raises(APIError) as e:
                await limiter.admit(key, 1)
            assert e.value.status == 429 and e.value.param == "requests_per_minute"
            assert limiter.metrics.api_key_limiter_unavailable._value.get() == 0
            with pytest.raises(Exception, match=r"(?i)no permissions"):
                await limiter.client.set("{llmserve:pi}:executors", "x")
            with pytest.raises(Exception, match=r"(?i)no permissions"):
                await limiter.client.flushall()
            await limiter.close()

        asyncio.run(main())
    finally:
        server.stop()


def test_redis_unreachable_fails_open_with_one_log_line_and_a_metric(caplog):
    async def main() -> None:
        port = free_port()  # nothing listens there
        limiter = Limiter(connect_redis(f"redis://127.0.0.1:{port}/0", 0.5), GatewayMetrics())
        key = ApiKey(name="a", key="sk", requests_per_minute=1)
        with caplog.at_level(logging.WARNING, logger="llmserve.gateway.limits"):
            for _ in range(5):
                lease = await limiter.admit(key, 1)  # never an error: admitted unchecked
                assert lease.lease_id is None
        assert limiter.metrics.api_key_limiter_unavailable._value.get() == 5
        lines = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(lines) == 1
        await limiter.close()

    asyncio.run(main())
