"""``llmserve up`` with every service scaled: two gateways (consecutive ports), two tokenizers, two
schedulers and two executors serve 64 concurrent streams, every one of them token for token the
greedy reference; ``--observability`` starts the local Prometheus where installed (scraping both
gateways) or says it is not; SIGINT then leaves nothing behind: no process, no temp dir, no port
held."""

from __future__ import annotations

import asyncio
import glob
import os
import re
import signal
import socket
import tempfile
import time

import httpx
import pytest
from e2e_harness import Reference, finish_reason, parse_sse, stream_text
from test_up import MODEL, _read_until, _start_up, children_of, wait_all_dead

from services.cli.observability import find_prometheus
from services.cli.reaper import STACK_DIR_PREFIX

NUM_STREAMS = 64
MAX_TOKENS = 12
PROMPTS = (
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
)


async def _stream(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[str, float, float]:
    """One streamed completion: its SSE body, when it was sent and when it ended."""
    sent = time.monotonic()
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        raw = (await r.aread()).decode()
    return raw, sent, time.monotonic()


async def _all_streams(urls: list[str]) -> list[tuple[str, float, float]]:
    limits = httpx.Limits(max_connections=NUM_STREAMS, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        return await asyncio.gather(
            *(
                _stream(client, urls[i % len(urls)], PROMPTS[i % len(PROMPTS)])
                for i in range(NUM_STREAMS)
            )
        )


def _port_free(port: int) -> bool:
    """Nothing listens on it: a server could bind it again now (with SO_REUSEADDR, as servers do:
    the connections it closed may linger in TIME_WAIT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.timeout(900)
def test_scaled_up_serves_64_streams_exactly_and_sigint_leaves_nothing(tmp_path, pid_alive):
    reference = Reference()
    expected = {p: reference.greedy(MAX_TOKENS, prompt=p, ignore_eos=True) for p in PROMPTS}
    up, lines = _start_up(
        tmp_path,
        *("--gateways", "2", "--tokenizers", "2", "--schedulers", "2", "--executors", "2"),
        *("--max-num-seqs", "16", "--num-kv-blocks", "160", "--observability"),
    )
    stack_dirs = os.path.join(tempfile.gettempdir(), f"{STACK_DIR_PREFIX}{up.pid}-*")
    try:
        _read_until(up, lines, r"ready at (http://\S+)", tmp_path, 600)
        urls = [
            _read_until(up, lines, rf"gateway {i}: (http://\S+)", tmp_path, 5).group(1)
            for i in range(2)
        ]
        ports = [int(u.rsplit(":", 1)[1]) for u in urls]  # free ones: _start_up gives --port 0
        children = children_of(up.pid)
        # nats, redis, the reaper, 2 of each service kind, one index (+ prometheus if installed)
        assert len(children) >= 11, children

        results = asyncio.run(_all_streams(urls))
        assert len(results) == NUM_STREAMS
        # All 64 were open at once: the last was sent before the first ended.
        assert max(sent for _, sent, _ in results) < min(done for *_, done in results)
        for i, (raw, _, _) in enumerate(results):
            chunks, done = parse_sse(raw)
            want = expected[PROMPTS[i % len(PROMPTS)]]
            assert done, raw[-300:]
            assert stream_text(chunks, chat=False) == want.text, (i, raw[-300:])
            assert finish_reason(chunks) == "length" == want.finish_reason

        for url in urls:  # each gateway is addressable on its own port
            assert httpx.get(url + "/health", timeout=10).status_code == 200
        stderr = (tmp_path / "up.stderr").read_text()
        servers = [int(p) for p in re.findall(r"(?:nats|redis)://127\.0\.0\.1:(\d+)", stderr)]
        assert len(servers) == 2, stderr[-2000:]
        if find_prometheus() is not None:
            prom = re.search(r"Prometheus at (http://\S+)", stderr)
            assert prom, stderr[-2000:]
            ports.append(int(prom.group(1).rsplit(":", 1)[1]))

            def scraped() -> set[str]:
                r = httpx.get(prom.group(1) + "/api/v1/targets", timeout=5).json()
                return {t["scrapeUrl"] for t in r["data"]["activeTargets"] if t["health"] == "up"}

            deadline = time.monotonic() + 30
            while scraped() != {u + "/metrics" for u in urls} and time.monotonic() < deadline:
                time.sleep(1)
            assert scraped() == {u + "/metrics" for u in urls}
        else:
            assert "Prometheus is not installed" in stderr

        up.send_signal(signal.SIGINT)
        assert up.wait(120) == 0
        assert wait_all_dead(children, pid_alive, 10.0) == []
        assert glob.glob(stack_dirs) == []
        assert [p for p in ports + servers if not _port_free(p)] == []
    finally:
        if up.poll() is None:
            up.kill()
        up.wait()
