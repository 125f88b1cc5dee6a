"""The services on closed servers, as ``llmserve up`` closes them (services/cli/credentials.py):
Redis answers NOAUTH to a client without the password and NOPERM to the index's user outside its
keys; the prefix index works with its user and fails at start, naming the server and the user,
with a wrong password; a service process given a wrong NATS password exits at once with a clear
message, and takes its password from a file as well as from the environment; the launcher hands
each service its own credentials, by environment alone, also from ``llmserve credentials DIR`` for
servers it did not start."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from services.cli.commands import up
from services.cli.credentials import REDIS_INDEX_USER, StackCredentials
from services.cli.launcher import Stack, StackConfig, launch
from services.cli.main import main as cli_main
from services.cli.servers import ServerProcess, start_nats, start_redis
from services.connections import RedisAuth
from services.prefix_index.config import DEFAULT_KEY_PREFIX, PrefixIndexConfig
from services.prefix_index.service import running
from services.prefix_index.store import IndexAccessDenied, PrefixStore, connect_redis
from shared.wire import messages, subjects
from shared.wire.bus import Bus
from shared.wire.bus_auth import BusAuth
from shared.wire.kv_events import BlockStored, KVEventBatch, KVEventsMessage
from shared.wire.permissions import SERVICE_KINDS


@pytest.fixture(scope="module")
def credentials() -> StackCredentials:
    return StackCredentials.generate()


@pytest.fixture(scope="module")
def closed_redis(credentials) -> Iterator[ServerProcess]:
    server = start_redis(acl=credentials.redis_acl())
    yield server
    server.stop()


@pytest.fixture(scope="module")
def closed_nats(credentials) -> Iterator[ServerProcess]:
    server = start_nats(extra_config=credentials.nats_authorization())
    yield server
    server.stop()


def redis_says(server: ServerProcess, commands: bytes) -> bytes:
    """Every reply to ``commands`` (read until the server has been quiet for a moment)."""
    with socket.create_connection((server.host, server.port), timeout=5) as s:
        s.sendall(commands)
        data = s.recv(65536)
        s.settimeout(0.1)
        with contextlib.suppress(TimeoutError):
            while chunk := s.recv(65536):
                data += chunk
        return data


def test_redis_refuses_a_client_without_the_password(closed_redis, credentials):
    for command in (b"PING\r\n", b"KEYS *\r\n", b"GET {llmserve:pi}:executors\r\n"):
        assert redis_says(closed_redis, command).startswith(b"-NOAUTH"), command
    assert redis_says(closed_redis, b"AUTH default nothing\r\n").startswith(b"-WRONGPASS")
    login = f"AUTH {REDIS_INDEX_USER} {credentials.redis_password}\r\n".encode()
    # The index's own user: its keys, and nothing else (neither other keys nor the server's admin).
    assert redis_says(closed_redis, login + b"GET {llmserve:pi}:x\r\n") == b"+OK\r\n$-1\r\n"
    for command in (
        b"GET other\r\n",
        b"CONFIG GET *\r\n",
        b"FLUSHALL\r\n",
        b"KEYS *\r\n",
        b"SUBSCRIBE c\r\n",
    ):
        assert redis_says(closed_redis, login + command).startswith(b"+OK\r\n-NOPERM"), command


def test_the_index_works_with_its_user_and_fails_at_start_with_a_wrong_password(
    closed_redis, closed_nats, credentials
):
    good = RedisAuth(REDIS_INDEX_USER, credentials.redis_password)

    async def main() -> None:
        store = PrefixStore(
            connect_redis(closed_redis.url, 5.0, good), DEFAULT_KEY_PREFIX, tombstone_ttl_s=60
        )
        batch = KVEventsMessage(
            executor_id="executor-0",
            epoch="e1",
            model="m",
            batch=KVEventBatch(
                seq=1,
                events=[
                    BlockStored(
                        block_hashes=[11, 12],
                        parent_block_hash=None,
                        token_ids=list(range(32)),
                        block_size=16,
                    )
                ],
            ),
        )
        assert (await store.apply(batch)).result == "applied"
        assert await store.match("m", [11, 12, 13]) == {"executor-0": 2}
        await store.close()

        config = PrefixIndexConfig(
            nats_url=closed_nats.url,
            redis_url=closed_redis.url,
            bus_auth=credentials.nats_auth("prefix_index"),
            redis_auth=RedisAuth(REDIS_INDEX_USER, "not-the-password-5521"),
        )
        t0 = time.monotonic()
        with pytest.raises(IndexAccessDenied) as err:
            async with running(config):
                pass
        assert time.monotonic() - t0 < 5
        message = str(err.value)
        assert closed_redis.url in message and f"user {REDIS_INDEX_USER!r}" in message
        assert "not-the-password-5521" not in message

    asyncio.run(main())


def _run_scheduler(nats: ServerProcess, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "REDIS_"))}
    return subprocess.Popen(
        [sys.executable, "-m", "services.scheduler", *args],
        env={**base, "NATS_URL": nats.url, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_service_with_a_wrong_password_exits_at_once_naming_server_and_user(closed_nats):
    process = _run_scheduler(
        closed_nats, {"NATS_USER": "scheduler", "NATS_PASSWORD": "not-the-password-9043"}
    )
    try:
        out, _ = process.communicate(timeout=20)  # the connect deadline is 30 s: no waiting it out
    finally:
        process.kill()
    assert process.returncode != 0
    assert f"NATS at {closed_nats.url} refused user 'scheduler'" in out, out[-2000:]
    assert "not-the-password-9043" not in out


def test_a_service_takes_its_password_from_a_file(closed_nats, credentials, tmp_path):
    secret = tmp_path / "nats-password"
    secret.write_text(credentials.nats_passwords["scheduler"] + "\n")
    secret.chmod(0o600)
    process = _run_scheduler(
        closed_nats, {"NATS_USER": "scheduler"}, "--nats-password-file", str(secret)
    )

    async def status() -> messages.SchedulerStatus:
        async with await Bus.connect(closed_nats.url, "t", auth=credentials.admin) as bus:
            deadline = time.monotonic() + 30
            while True:
                try:
                    data = await bus.request(
                        subjects.SCHEDULER_STATUS,
                        messages.SCHEDULER_STATUS_REQUEST.encode(messages.SchedulerStatusRequest()),
                        timeout=1,
                    )
                    return messages.SCHEDULER_STATUS.decode(data)
                except Exception:
                    assert process.poll() is None, process.communicate()[0]
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)

    try:
        assert asyncio.run(status()).executors == []
    finally:
        process.terminate()
        process.communicate(timeout=20)


def test_the_launcher_gives_each_service_its_own_credentials_by_environment(monkeypatch):
    """Every kind gets its own NATS user, only the prefix index a Redis password, only the gateway
    the API key; nothing secret, and no URL, on any command line; inherited credentials for other
    servers are not passed on."""
    started: list[tuple[str, list[str], dict[str, str]]] = []

    def record(self: Stack, name: str, module: str, args: list[str], env: dict[str, str]) -> None:
        started.append((name, args, env))

    monkeypatch.setattr(Stack, "start_service", record)
    monkeypatch.setenv("NATS_PASSWORD", "inherited-4410")
    monkeypatch.setenv("REDIS_PASSWORD", "inherited-4411")
    monkeypatch.setenv("LLMSERVE_API_KEY", "inherited-4412")
    stack = launch(StackConfig(api_key="the-key-3307", num_prefix_indexes=1), wait=False)
    try:
        assert stack.credentials is not None
        secrets = [*stack.credentials.secrets(), "the-key-3307"]
        assert {name.split("-")[0] for name, _, _ in started} == set(SERVICE_KINDS)
        for name, args, env in started:
            kind = name.split("-")[0]
            assert not any(s in arg for s in secrets for arg in args), name
            assert not any(url in arg for url in (stack.nats_url, stack.redis_url) for arg in args)
            assert env["NATS_USER"] == kind
            assert env["NATS_PASSWORD"] == stack.credentials.nats_passwords[kind]
            # The prefix index and the gateway (per-key limits) each have their own Redis user.
            assert ("REDIS_PASSWORD" in env) == (kind in ("prefix_index", "gateway"))
            if kind in ("prefix_index", "gateway"):
                assert env["REDIS_PASSWORD"] == stack.credentials.redis_env(kind)["REDIS_PASSWORD"]
            assert ("LLMSERVE_API_KEY" in env) == (kind == "gateway")
            assert not any(v.startswith("inherited-") for v in env.values()), name
        [gateway_env] = [env for name, _, env in started if name == "gateway"]
        assert gateway_env["LLMSERVE_API_KEY"] == "the-key-3307"
    finally:
        stack.stop()


def test_credentials_for_servers_run_by_someone_else(tmp_path, monkeypatch):
    """``llmserve credentials DIR`` writes private files that a nats-server includes and a
    redis-server loads as its ACL file; ``llmserve up --credentials DIR`` with those servers' URLs
    hands each service its kind's users, and they get in."""
    directory = tmp_path / "creds"
    assert cli_main(["credentials", str(directory)]) == 0
    assert directory.stat().st_mode & 0o777 == 0o700
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in directory.iterdir())
    assert cli_main(["credentials", str(directory)]) == 2  # never overwritten
    credentials = StackCredentials.load(str(directory))
    # nats-server includes relative to its config file, which lives in a temp dir of tempdir.
    include = os.path.join(
        "..", os.path.relpath(directory / "nats-users.conf", tempfile.gettempdir())
    )
    nats = start_nats(extra_config=f"include {include!r}")
    redis = start_redis(acl=f"aclfile {directory / 'redis-users.acl'}")
    started: list[tuple[str, dict[str, str]]] = []

    def record(self: Stack, name: str, module: str, args: list[str], env: dict[str, str]) -> None:
        started.append((name, env))

    monkeypatch.setattr(Stack, "start_service", record)
    monkeypatch.setenv("LLMSERVE_CREDENTIALS_DIR", str(directory))
    monkeypatch.setenv("NATS_URL", nats.url)
    monkeypatch.setenv("REDIS_URL", redis.url)
    parser = up.add_parser(argparse.ArgumentParser().add_subparsers())
    stack = launch(up.stack_config(parser.parse_args([])), wait=False)
    try:
        assert stack.servers == [] and stack.credentials == credentials
        envs = dict(started)

        async def main() -> None:
            scheduler = envs["scheduler-0"]
            auth = BusAuth(user=scheduler["NATS_USER"], password=scheduler["NATS_PASSWORD"])
            async with await Bus.connect(nats.url, "scheduler", auth=auth) as bus:
                await bus.subscribe(subjects.SCHEDULER_STATUS, lambda msg: msg.respond(b"up"))
                await bus.flush()
                async with await Bus.connect(nats.url, "op", auth=stack.admin_auth) as admin:
                    assert await admin.request(subjects.SCHEDULER_STATUS, b"", 5) == b"up"
            index = envs["prefix_index-0"]
            auth_redis = RedisAuth(index["REDIS_USERNAME"], index["REDIS_PASSWORD"])
            store = PrefixStore(
                connect_redis(redis.url, 5.0, auth_redis), DEFAULT_KEY_PREFIX, tombstone_ttl_s=60
            )
            assert await store.stats() == (0, 0)
            await store.close()

        asyncio.run(main())
    finally:
        stack.stop()
        nats.stop()
        redis.stop()
