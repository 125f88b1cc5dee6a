"""The local servers, the launcher and ``llmserve up``: real processes on loopback ports.

- start_nats / start_redis: ready, clear errors, stopped.
- the ``stack`` fixture (the launcher ``llmserve up`` uses): /health, completions streaming and not,
  and an executor killed mid-stream ends the stream with an error instead of a hang.
- a closed stack: NATS and Redis refuse a client without its credentials; no password and no API
  key on any process's command line (``ps``); each service holds its own kind's credentials alone.
- ``llmserve up`` as a subprocess: ready banner, a curl example without the key, a completion,
  no secret on a command line or in what it prints, SIGINT stops every child; a SIGKILLed
  launcher leaves no orphan either (PR_SET_PDEATHSIG), nor its servers' temp dirs (the reaper).
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import pathlib
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from helpers.nats_probe import ConnectRefused, NatsProbe
from services.cli.launcher import (
    EXECUTOR_OPENMP_ENV,
    StackConfig,
    StackStartError,
    launch,
    set_executor_openmp_policy,
)
from services.cli.reaper import STACK_DIR_PREFIX, sweep_orphaned_dirs
from services.cli.servers import (
    ServerStartError,
    detach_child,
    ephemeral_port_range,
    free_port,
    start_nats,
    start_redis,
)
from shared.wire.bus import Bus, BusAuthError

MODEL = "SmolLM2-135M-Instruct"


def children_of(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (scans /proc; no psutil)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        frontier += kids
    return found


def wait_all_dead(pids, pid_alive, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


# -- servers ---------------------------------------------------------------------------------------


def test_servers_start_answer_and_stop(pid_alive):
    nats, redis = start_nats(max_payload=4 * 1024 * 1024), start_redis()
    try:
        for server, greeting, expect in ((nats, None, b"INFO"), (redis, b"PING\r\n", b"+PONG")):
            with socket.create_connection((server.host, server.port), timeout=2) as s:
                if greeting:
                    s.sendall(greeting)
                data = s.recv(4096)
                assert expect in data
        info = json.loads(
            socket.create_connection((nats.host, nats.port), timeout=2).recv(4096)[5:]
        )
        assert info["max_payload"] == 4 * 1024 * 1024
    finally:
        nats.stop()
        redis.stop()
    assert not pid_alive(nats.pid) and not pid_alive(redis.pid)
    assert not os.path.exists(nats.workdir)


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    low, _high = ephemeral_port_range()
    if low < 11000:
        pytest.skip(f"the ephemeral ports start at {low}: no room below them")
    for _ in range(20):
        port = free_port()
        assert 10000 <= port < low  # no outgoing connection can be handed it meanwhile
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_server_start_error_shows_its_log():
    nats = start_nats()
    try:
        with pytest.raises(
            ServerStartError, match=r"(?s)nats-server exited .*address already in use"
        ):
            start_nats(port=nats.port)
    finally:
        nats.stop()


# -- the stack, through the fixture ----------------------------------------------------------------


def test_a_service_dying_at_start_is_reported_with_its_last_output(tmp_path, capfd):
    """Without a log directory each service's output goes to our stderr; when one dies its last
    lines are the error's message, not a pointer to a stream full of other services' lines."""
    missing = str(tmp_path / "no-such-model.gguf")
    with pytest.raises(StackStartError) as err:
        launch(StackConfig.of(model=missing, ready_timeout_s=120))
    assert re.search(
        r"(executor|tokenizer)-0 exited with code \d+; its last output:", str(err.value)
    )
    assert "no-such-model.gguf" in str(err.value)
    assert "/health" not in capfd.readouterr().err  # no access-log line for the readiness polls


def test_stack_serves_sheds_load_and_survives_an_executor_kill(stack, pid_alive):
    # One sequence at a time and no waiting room: a second concurrent request is shed with 429.
    s = stack(
        num_kv_blocks=128,
        max_num_seqs=1,
        max_queue_len=0,
        max_queued=0,  # nor at the executor (by default it queues as many again as it runs)
        request_timeout_s=60,
        heartbeat_timeout_s=3.0,
    )
    assert s.base_url is not None
    with httpx.Client(base_url=s.base_url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        body = {
            "model": MODEL,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Say hi"}],
        }
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        # Streaming; while it runs a second request gets 429; then the executor is killed after the
        # first chunk and the stream ends with an error event instead of hanging.
        body = {
            "model": MODEL,
            "max_tokens": 2000,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "prompt": "Once upon a time",
        }
        lines = []
        t0 = time.monotonic()
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 1:
                    busy = http.post(
                        "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}
                    )
                    assert busy.status_code == 429, busy.text
                    assert float(busy.headers["retry-after"]) > 0
                    assert busy.json()["error"]["type"] == "rate_limit_error"
                    s.services["executor-0"].kill()
        text = "\n".join(lines)
        assert "error" in text and "executor-0" in text, text[-500:]
        assert time.monotonic() - t0 < 30
        assert not pid_alive(s.services["executor-0"].pid)
        # With no executor left, /health says so.
        deadline = time.monotonic() + 10
        while http.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert http.get("/health").status_code == 503
    pids = s.pids()
    s.stop()
    assert wait_all_dead(pids, pid_alive, 1.0) == []


def _cmdline(pid: int) -> str:
    """What ``ps`` shows every user of the machine: the process's argv."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def _server_passwords(pids: list[int]) -> list[str]:
    """Every password in the config files of the servers among ``pids``: each runs in its private
    temp dir (redis-server even rewrites its argv, so the file's path is not there to read)."""
    found: list[str] = []
    for pid in pids:
        try:
            cwd = pathlib.Path(os.readlink(f"/proc/{pid}/cwd"))
        except OSError:
            continue
        if not cwd.name.startswith("llmserve-"):
            continue
        for conf in cwd.glob("*.conf"):
            text = conf.read_text()
            found += re.findall(r'password: "([^"]+)"', text)  # nats-server
            found += re.findall(r" >(\S+) ", text)  # redis-server's ACL
    return found


def test_a_stack_on_a_mock_engine_serves_its_tokens(stack, monkeypatch):
    """``--mock-step-ms`` (here through its variable, as bench_stack_vs_engine sets it): the
    executor loads no model and every service around it carries real requests."""
    monkeypatch.setenv("LLMSERVE_MOCK_STEP_MS", "5")
    s = stack()
    assert s.base_url is not None
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 0}
    with httpx.Client(base_url=s.base_url, timeout=60) as http:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == " tok" * 6
        assert r.json()["usage"]["completion_tokens"] == 6
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == " tok" * 6


def test_a_stack_is_closed_to_strangers_and_shows_no_secret_in_ps(stack, pid_alive):
    """Finding 4, whole stack: a local client without the stack's credentials is refused by NATS
    and by Redis; every process's command line is free of every password and of the API key; each
    service holds its own kind's credentials alone; the stack serves as before."""
    key = "e2e-key-5c21"
    s = stack(api_key=key, num_kv_blocks=64)
    assert s.credentials is not None
    secrets = [key, *s.credentials.secrets()]
    nats, redis = (
        next(x for x in s.servers if x.name == n) for n in ("nats-server", "redis-server")
    )

    with pytest.raises(ConnectRefused, match="Authorization Violation"):
        NatsProbe(nats.host, nats.port)
    with socket.create_connection((redis.host, redis.port), timeout=5) as sock:
        sock.sendall(b"PING\r\n")
        assert sock.recv(1024).startswith(b"-NOAUTH")

    async def anonymous() -> None:
        with pytest.raises(BusAuthError, match="refused no user"):
            await Bus.connect(s.nats_url, "stranger", connect_timeout_s=10)

    asyncio.run(anonymous())

    pids = s.pids()
    pids += [c for pid in pids for c in children_of(pid)]
    assert all(_cmdline(pid) for pid in s.pids())
    for pid in pids:
        assert not any(secret in _cmdline(pid) for secret in secrets), _cmdline(pid)
    for name, svc in s.services.items():
        kind = name.split("-")[0]
        env = _environ(svc.pid)
        assert env["NATS_USER"] == kind
        held = {v for v in env.values() if v in secrets}
        mine = {s.credentials.nats_passwords[kind]}
        mine |= {s.credentials.redis_password} if kind == "prefix_index" else set()
        mine |= {key, s.credentials.redis_gateway_password} if kind == "gateway" else set()
        assert held == mine, name

    with httpx.Client(base_url=s.base_url, timeout=60) as http:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 401
        r = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
    logs = "".join(p.read_text() for p in pathlib.Path(s.config.log_dir or "").iterdir())
    assert logs and not any(secret in logs for secret in secrets)


# -- llmserve up, as a user runs it ----------------------------------------------------------------


def _start_up(
    tmp_path, *extra: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], queue.SimpleQueue[str]]:
    """``llmserve up`` on a free port (``env``: more variables); its stdout lines arrive on the
    returned queue (a reader thread, so the test never blocks on a pipe). stderr goes to a file.
    detach_child: should this test die, the launcher (and through it everything) goes too."""
    # Popen hands the child its own copy of the descriptor: ours can close at once.
    with open(tmp_path / "up.stderr", "w") as stderr:
        up = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "up",
                "--port",
                "0",
                "--num-kv-blocks",
                "64",
                "--dtype",
                "float32",
                "--num-threads",
                "1",
                "--max-num-seqs",
                "4",
                "--log-dir",
                str(tmp_path / "logs"),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            preexec_fn=detach_child,
            env={
                **{k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL")},
                **(env or {}),
            },
        )
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()

    def pump() -> None:
        assert up.stdout is not None
        for line in up.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return up, lines


def _read_until(up, lines, pattern: str, tmp_path, timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if up.poll() is not None:
                raise AssertionError(
                    f"llmserve up exited ({up.returncode}):\n{(tmp_path / 'up.stderr').read_text()}"
                ) from None
            continue
        if m := re.search(pattern, line):
            return m
    stderr = (tmp_path / "up.stderr").read_text()
    raise AssertionError(f"no {pattern!r} from llmserve up within {timeout}s:\n{stderr}")


def test_llmserve_up_serves_and_sigint_stops_everything(tmp_path, pid_alive):
    key = "sekret-7f3a91"
    up, lines = _start_up(tmp_path, env={"LLMSERVE_API_KEY": key})
    try:
        base_url = _read_until(up, lines, r"ready at (http://\S+)", tmp_path, 240).group(1)
        # The curl example names the variable, never the key.
        _read_until(up, lines, r"Authorization: Bearer \$LLMSERVE_API_KEY", tmp_path, 5)
        children = children_of(up.pid)
        assert len(children) >= 6  # nats, redis, executor, scheduler, tokenizer, gateway
        secrets = [key, *_server_passwords(children)]
        assert len(secrets) >= 8  # the key, a NATS user per kind and the admin, Redis's user
        for pid in [up.pid, *children]:
            assert not any(secret in _cmdline(pid) for secret in secrets), _cmdline(pid)
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=base_url, timeout=60) as http:
            assert http.get("/health").status_code == 200
            assert (
                http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}).status_code
                == 401
            )
            r = http.post(
                "/v1/completions",
                headers=headers,
                json={
                    "model": MODEL,
                    "prompt": "The capital of France is",
                    "max_tokens": 4,
                    "temperature": 0,
                },
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"]
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        assert wait_all_dead(children, pid_alive, 5.0) == []
        printed = [lines.get_nowait() for _ in range(lines.qsize())]
        printed.append((tmp_path / "up.stderr").read_text())
        printed += [p.read_text() for p in (tmp_path / "logs").iterdir()]
        assert not any(secret in text for secret in secrets for text in printed)
    finally:
        if up.poll() is None:
            up.kill()
        up.wait()


def test_killed_launcher_leaves_no_orphans_and_no_temp_dir(tmp_path, pid_alive):
    """SIGKILL: no child survives (PR_SET_PDEATHSIG), and the reaper removes the servers' temp
    dirs (nats-server's config and JetStream store, redis-server's dir) once they have exited."""
    up, _ = _start_up(tmp_path)
    pattern = os.path.join(tempfile.gettempdir(), f"{STACK_DIR_PREFIX}{up.pid}-*")
    try:
        deadline = time.monotonic() + 60
        children: list[int] = []
        while len(children) < 6 and time.monotonic() < deadline:  # servers + services spawned
            time.sleep(0.2)
            children = children_of(up.pid)
        assert len(children) >= 6, (tmp_path / "up.stderr").read_text()
        [stack_dir] = glob.glob(pattern)  # this run's, named after its launcher
        server_dirs = os.listdir(stack_dir)
        assert {d.split("-")[1] for d in server_dirs} == {"nats", "redis"}, server_dirs
    finally:
        up.kill()
        up.wait()
    assert (
        wait_all_dead(children, pid_alive, 45.0) == []
    )  # a service caught mid-drain may wait on nats; the reaper exits once it has cleaned up
    assert glob.glob(pattern) == [] and not os.path.exists(stack_dir)


def test_a_stack_dir_left_by_a_dead_launcher_is_swept(tmp_path):
    """Only a launcher and its reaper both SIGKILLed leave a stack dir: the next launch removes
    it, and leaves a live launcher's alone."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f"{STACK_DIR_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{STACK_DIR_PREFIX}{os.getpid()}-def"
    for d in (orphan, live):
        (d / "llmserve-nats-x").mkdir(parents=True)
    assert sweep_orphaned_dirs(str(tmp_path)) == [str(orphan)]
    assert not orphan.exists() and live.exists()


def test_executor_openmp_policy_is_a_default_not_an_override():
    env: dict[str, str] = {}
    set_executor_openmp_policy(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "3000"} == EXECUTOR_OPENMP_ENV
    for chosen in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(chosen)
        set_executor_openmp_policy(env)
        assert env == chosen  # either variable set by the user: theirs alone
