"""The prefix index under faults, over a real nats-server and redis-server: an index process
SIGKILLed mid-run and started again catches up from the stream; Redis going down and coming back
(hung, then killed) loses no batch, and matches meanwhile fail fast."""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from helpers.kv_executor import KVExecutorModel, dump_keys, index_of, publish
from helpers.prefix_index import (
    MODEL,
    counted,
    index_config,
    index_equals,
    match,
    redis_client,
    status,
    until,
)
from services.cli.servers import detach_child, find_redis_server, free_port, start_nats
from services.prefix_index.service import running
from shared.wire.block_hash import hash_prompt_blocks
from shared.wire.bus import Bus

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def own_nats_url() -> Iterator[str]:
    """A nats-server of this test's own: the KV events stream and its consumers start empty."""
    server = start_nats()
    yield server.url
    server.stop()


class PersistentRedis:
    """A redis-server whose append-only file is fsynced at every write: killed and started again
    on the same port and directory, it comes back with everything it acknowledged."""

    def __init__(self, workdir: pathlib.Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 15.0) -> None:
        argv = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        argv += ["--dir", str(self.workdir), "--protected-mode", "no"]
        with open(self.workdir / "redis.log", "ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=detach_child
            )
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if client.ping():
                    return
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError((self.workdir / "redis.log").read_text()[-2000:])
            time.sleep(0.05)

    def freeze(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a hung server)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def persistent_redis(tmp_path) -> Iterator[PersistentRedis]:
    server = PersistentRedis(tmp_path)
    server.start()
    yield server
    server.kill()


def test_redis_down_fails_matches_fast_and_loses_no_batch(own_nats_url, persistent_redis, caplog):
    caplog.set_level(logging.INFO, logger="llmserve.prefix_index")

    async def main() -> None:
        config = index_config(
            own_nats_url, persistent_redis.url, redis_timeout_s=0.5, match_timeout_s=0.25
        )
        a, b = KVExecutorModel("ex-a", MODEL), KVExecutorModel("ex-b", MODEL)
        tokens = list(range(64))
        hashes = hash_prompt_blocks(tokens, a.block_size)
        num_batches = 0
        async with (
            await Bus.connect(own_nats_url, "test") as bus,
            running(config) as service,
            redis_client(config) as client,
        ):
            for ex, num_tokens in ((a, 32), (b, 16)):
                await publish(bus, ex.store_prompt(tokens[:num_tokens]))
                num_batches += 1
            await index_equals(client, config.key_prefix, [a, b])

            # Hung: the first match waits out its timeout; the next ones are answered at once
            # without asking Redis, until it is back.
            persistent_redis.freeze()
            started = time.monotonic()
            reply = await match(bus, hashes)
            assert reply.error and not reply.num_blocks
            assert time.monotonic() - started < 1.0
            for _ in range(3):
                started = time.monotonic()
                assert (await match(bus, hashes)).error
                assert time.monotonic() - started < config.match_timeout_s / 2
            assert not (await status(bus)).redis_ok
            persistent_redis.kill()  # and then gone altogether
            started = time.monotonic()
            assert (await match(bus, hashes)).error
            assert time.monotonic() - started < config.match_timeout_s / 2

            # Batches keep coming while Redis is down: none is lost, none is resynced (no
            # snapshot answers here: a resync would purge).
            for step in range(5):
                for ex in (a, b):
                    await publish(bus, ex.store_prompt(tokens[: 8 * (step + 5)]))
                    num_batches += 1
                await publish(bus, b.batch([b.removed(sorted(b.held)[:1])]))
                num_batches += 1
            await asyncio.sleep(1.0)

            persistent_redis.start()
            await index_equals(client, config.key_prefix, [a, b])
            await counted(service, "num_batches_applied", num_batches)
            reply = await match(bus, hashes)
            assert reply.error is None and reply.num_blocks["ex-a"] == len(hashes)
            s = await status(bus)
            assert s.redis_ok and s.num_resyncs == 0 and s.num_purges == 0
            for ex in (a, b):
                record = await client.hgetall("{" + config.key_prefix + "}:x:" + ex.executor_id)
                assert record["seq"] == str(ex.seq)

        messages = [r.getMessage() for r in caplog.records]
        assert sum("redis is unavailable" in m for m in messages) == 1, messages
        assert sum("redis is back" in m for m in messages) == 1, messages

    asyncio.run(main())


def _spawn_index(config: Any, log_path: pathlib.Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "services.prefix_index"]
    argv += ["--nats-url", config.nats_url, "--redis-url", config.redis_url]
    argv += ["--key-prefix", config.key_prefix, "--consumer", config.consumer]
    argv += ["--ack-wait", str(config.ack_wait_s), "--executor-timeout", "60"]
    # A batch redelivered after the ack wait fills any gap long before it would resync.
    argv += ["--snapshot-timeout", "1", "--resync-after", "1000"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=detach_child
        )


async def _wait_ready(process: subprocess.Popen[bytes], log_path: pathlib.Path) -> None:
    async def ready() -> bool:
        assert process.poll() is None, log_path.read_text()[-3000:]
        return "prefix index ready" in log_path.read_text()

    await until(ready, timeout_s=60.0, what="the index process to start")


def _normalized(dump: dict[str, Any], key_prefix: str) -> dict[str, Any]:
    return {key.replace("{" + key_prefix + "}", "{P}", 1): value for key, value in dump.items()}


@pytest.mark.timeout(180)
def test_a_killed_index_catches_up_from_the_stream(own_nats_url, redis_url, tmp_path):
    async def main() -> None:
        killed = index_config(own_nats_url, redis_url, ack_wait_s=2.0)
        steady = index_config(own_nats_url, redis_url)  # another consumer, another key prefix
        executors = [KVExecutorModel(f"ex-{i}", MODEL) for i in range(3)]
        rng = random.Random(20261201)
        prefixes = [[rng.randrange(50_000) for _ in range(4 * k)] for k in (2, 4, 6)]
        log_path = tmp_path / "prefix_index.log"
        async with (
            await Bus.connect(own_nats_url, "test") as bus,
            running(steady),
            redis_client(steady) as client,
        ):
            # No executor answers snapshot requests: a resync would purge, so the indexes can only
            # end equal to the executors by applying every batch from the stream.
            process = _spawn_index(killed, log_path)
            try:
                await _wait_ready(process, log_path)
                num_steps = 300
                for step in range(num_steps):
                    ex = rng.choice(executors)
                    await publish(bus, ex.random_step(rng, prefixes))
                    await asyncio.sleep(0.01)
                    if step == num_steps // 3:
                        process.kill()  # SIGKILL, mid-stream
                        process.wait()
                    elif step == 2 * num_steps // 3:
                        # It missed what came since: the stream must bring it back.
                        missed = index_of(
                            await dump_keys(client, killed.key_prefix), killed.key_prefix
                        )
                        assert missed != {ex.executor_id: ex.held for ex in executors if ex.held}
                        process = _spawn_index(killed, log_path)
                        await _wait_ready(process, log_path)
                expected = await index_equals(client, steady.key_prefix, executors)
                assert await index_equals(client, killed.key_prefix, executors) == expected

                async def same() -> bool:
                    a = _normalized(await dump_keys(client, killed.key_prefix), killed.key_prefix)
                    b = _normalized(await dump_keys(client, steady.key_prefix), steady.key_prefix)
                    return a == b

                await until(same, what="both indexes to be equal, records included")
                # SIGTERM drains and exits cleanly.
                process.send_signal(signal.SIGTERM)
                assert process.wait(30) == 0, log_path.read_text()[-3000:]
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()

    asyncio.run(main())
