"""Fixtures for the tests that need servers (a pytest plugin: tests/conftest.py loads it for every
layer): a real nats-server and redis-server (never mocks), and a ``stack`` factory that starts the
whole stack as separate processes through the launcher ``llmserve up`` uses.

    def test_x(nats_url): ...                   # session-scoped nats-server on a free port
    def test_y(redis_url): ...                  # session-scoped redis-server on a free port
    def test_z(stack):
        s = stack(num_kv_blocks=64, max_queue_len=4, api_key="k", request_timeout_s=30)
        s.base_url                              # "http://127.0.0.1:<port>" (None without a gateway)
        s.services["executor-0"].kill()         # ServiceProcess handles: pid, alive(), log_tail()
        s.nats_url, s.redis_url                 # the stack's own servers (isolated per stack)
        Bus.connect(s.nats_url, "t", auth=s.admin_auth)  # its bus is closed: a test connects as
                                                # the stack's admin user (s.credentials: all)

Each stack gets its own nats-server and redis-server so heartbeats of one test's executors never
reach another test's scheduler; every stack is stopped at the end of its test (no process leaks).
A stack's servers are closed as ``llmserve up`` closes them (services/cli/credentials.py); the
session servers of ``nats_url`` / ``redis_url`` are open, for tests of one service at a time.
Async tests: write ``def test_...(): asyncio.run(main())`` (no asyncio pytest plugin is needed).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from services.cli.launcher import Stack, StackConfig, launch
from services.cli.servers import ServerProcess, start_nats, start_redis


@pytest.fixture(scope="session")
def nats_server() -> Iterator[ServerProcess]:
    server = start_nats()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[ServerProcess]:
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server: ServerProcess) -> str:
    return nats_server.url


@pytest.fixture
def redis_url(redis_server: ServerProcess) -> str:
    return redis_server.url


@pytest.fixture
def stack(tmp_path) -> Iterator[Callable[..., Stack]]:
    """Factory: ``stack(**StackConfig and EngineConfig fields)`` starts a stack (port 0 = free port,
    small defaults for tests) and waits until it serves. Children's logs go to
    ``tmp_path/logs/<name>.log``; a service that dies during start-up fails the test with its log
    tail."""
    started: list[Stack] = []

    def factory(**overrides: Any) -> Stack:
        log_dir = tmp_path / f"logs-{len(started)}"
        log_dir.mkdir()
        defaults: dict[str, Any] = dict(
            port=0,
            num_kv_blocks=128,
            max_num_seqs=8,
            num_threads=1,
            dtype="float32",
            heartbeat_timeout_s=3.0,
            ready_timeout_s=180.0,
            log_dir=str(log_dir),
        )
        s = launch(StackConfig.of(**{**defaults, **overrides}))
        started.append(s)
        return s

    yield factory
    for s in started:
        s.stop(grace_s=5.0)


@pytest.fixture
def pid_alive() -> Callable[[int], bool]:
    """``pid_alive(pid)``: True if the process exists and is not a zombie."""
    return _pid_alive


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
