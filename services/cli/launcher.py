"""Start the whole stack as separate processes: nats-server, redis-server, then every service
(``python -m services.<name>``), wait until it serves, and stop it all again.

Used by ``llmserve up`` and by the test fixture ``stack``, so tests run exactly what users run.

Process invariants:
- every child runs in its own session (own process group): a terminal Ctrl-C reaches only the
  launcher, which then stops the children in order (gateway first, servers last) so they can drain;
- on Linux every child also gets PR_SET_PDEATHSIG=SIGTERM, so a launcher killed with SIGKILL does
  not leave orphans behind;
- ``Stack.stop()`` sends SIGTERM to each child's process group, waits ``grace_s``, then SIGKILLs the
  group; after it returns no child process is alive.
- ``Stack.supervise()`` restarts whatever exited on its own: nats-server and redis-server first
  (same port, config and data dir, so JetStream's store survives; polled, so reaped: never a
  zombie), then the services. The services reconnect by themselves.
- The servers' dirs live in one stack dir (``reaper.make_stack_dir``) that ``stop()`` removes; a
  reaper process removes it if the launcher dies without stopping (SIGKILL included), and the next
  launch sweeps any a dead launcher and its reaper left.

Security invariants: the servers it starts are closed (``credentials.py``: a NATS user per service
kind with its subject permissions, the prefix index's Redis user); each service gets its own kind's
credentials, and the API key (the gateway alone), by environment; no secret and no URL is on any
child's command line (``ps`` shows argv to every user; a URL from outside may hold a password).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from services.cli.credentials import StackCredentials
from services.cli.reaper import DirReaper, make_stack_dir, sweep_orphaned_dirs
from services.cli.servers import (
    ServerProcess,
    ServerStartError,
    detach_child,
    read_log_tail,
    start_nats,
    start_redis,
)
from services.cli.stack_config import (
    StackConfig,
    executor_args,
    gateway_model_args,
    gateway_name,
    gateway_ports,
    num_executors_total,
    scheduler_args,
    served_model_name,
    served_models,
    tokenizer_args,
)
from services.connections import NATS_ENV, REDIS_ENV
from services.gateway.config import ENV_API_KEY
from services.runtime import service_name
from shared.engine.config import ENGINE_SETTINGS
from shared.wire.bus_auth import BusAuth

# How an executor's OpenMP threads wait between parallel regions (~10 per layer per step). Every
# service shares the machine's cores with the executors, so libgomp's default (spin 300k iterations,
# then sleep) starves them, and PASSIVE (sleep at once) pays a futex wake per region. A short
# bounded spin serves best with the whole stack on one host (measured in loadtests/RESULTS.md).
EXECUTOR_OPENMP_ENV = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "3000"}


def set_executor_openmp_policy(env: MutableMapping[str, str]) -> None:
    """Give ``env`` the executors' OpenMP wait policy unless it already chooses one."""
    if not any(name in env for name in EXECUTOR_OPENMP_ENV):
        env.update(EXECUTOR_OPENMP_ENV)


__all__ = [
    "ServiceProcess",
    "Stack",
    "StackConfig",
    "StackStartError",
    "executor_args",
    "gateway_name",
    "gateway_ports",
    "launch",
    "served_model_name",
    "served_models",
    "tokenizer_args",
]


class StackStartError(RuntimeError):
    """A service exited or did not become ready; the message holds its log tail."""


_TAIL_LINES = 40  # a service's last output lines kept for the message when it dies


@dataclass
class ServiceProcess:
    name: str  # e.g. "executor-0"
    argv: list[str]
    log_path: str | None
    env: dict[str, str] = field(repr=False, default_factory=dict)
    num_restarts: int = 0
    # Without a log file the output is relayed to our stderr and its last lines kept here.
    tail: collections.deque[str] = field(
        repr=False, default_factory=lambda: collections.deque(maxlen=_TAIL_LINES)
    )
    process: subprocess.Popen[bytes] = field(init=False, repr=False)

    def spawn(self) -> None:
        self.process = _spawn(self.argv, self.env, self.log_path, self.tail)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, max_chars: int = 4000) -> str:
        """The service's last output (what it printed before dying, when it dies)."""
        if self.log_path is None:
            return "".join(self.tail)[-max_chars:]
        return read_log_tail(self.log_path, max_chars)

    def signal_group(self, sig: int) -> None:
        # The child leads its own group; its own children (if any) go with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL at once (tests use it to simulate a crash)."""
        self.signal_group(signal.SIGKILL)
        self.process.wait()


@dataclass
class Stack:
    config: StackConfig
    nats_url: str
    redis_url: str
    base_url: str  # the (first) gateway's
    services: dict[str, ServiceProcess] = field(default_factory=dict)
    servers: list[ServerProcess] = field(default_factory=list)
    # The users of the servers this stack started or was given (None: neither).
    credentials: StackCredentials | None = field(default=None, repr=False)
    data_dir: str | None = None  # the servers' dirs are in it; removed by stop()
    reaper: DirReaper | None = None  # removes data_dir should we die without stop()
    _stopped: bool = False
    # One supervise pass at a time, and none once stop() began (it holds the lock to set
    # _stopped).
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _supervisor: threading.Thread | None = field(default=None, repr=False)
    _stop_done: threading.Event = field(default_factory=threading.Event, repr=False)
    # Every gateway's, base_url first (``num_gateways`` of them, on consecutive ports).
    base_urls: list[str] = field(default_factory=list)
    # The local Prometheus and trace backend (``observability``): started after the NATS and
    # Redis servers, stopped after them; each one's name -> its URL.
    observability: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base_urls:
            self.base_urls = [self.base_url]

    @property
    def admin_auth(self) -> BusAuth:
        """For operators and tests, never a service: the admin NATS user (every subject) of the
        stack's credentials; anonymous on a server from outside that they do not cover.
        ``Bus.connect(stack.nats_url, "me", auth=stack.admin_auth)``."""
        if self.credentials is None or not _covers(self.config, "nats"):
            return BusAuth()
        return self.credentials.admin

    def pids(self) -> list[int]:
        return [s.pid for s in self.services.values()] + [s.pid for s in self.servers]

    def start_service(
        self, name: str, module: str, args: list[str], env: dict[str, str]
    ) -> ServiceProcess:
        argv = [sys.executable, "-m", module, *args]
        log_path = os.path.join(self.config.log_dir, f"{name}.log") if self.config.log_dir else None
        svc = ServiceProcess(name, argv, log_path, env)
        svc.spawn()
        self.services[name] = svc
        return svc

    def supervise(self, note: Callable[[str], None]) -> None:
        """Restart any server or service that exited on its own (``llmserve up`` calls this
        periodically). Servers first, on the same port with the same config and data dir, since
        every service needs them; each restart is reported with the process's last output. A crash
        loop is slowed by the time a restart takes (model loading, a server's readiness)."""
        with self._lock:
            if self._stopped:
                return
            for server in self.servers:
                if server.alive():
                    continue
                note(
                    f"{server.name} exited with code {server.process.returncode}; restarting it "
                    f"on port {server.port} (restart #{server.num_restarts + 1}); its last "
                    f"output:\n{server.log_tail(1500)}".rstrip()
                )
                started = time.monotonic()
                try:
                    server.restart()
                except ServerStartError as e:
                    note(f"{server.name} did not restart ({e}); trying again")
                    continue
                if self.reaper is not None:
                    self.reaper.watch(server.pid)
                note(f"{server.name} is back after {time.monotonic() - started:.2f} s")
            for svc in self.services.values():
                if svc.alive():
                    continue
                svc.num_restarts += 1
                tail = svc.log_tail(1500)
                note(
                    f"{svc.name} exited with code {svc.process.returncode}; restarting it "
                    f"(restart #{svc.num_restarts}); its last output:\n{tail}".rstrip()
                )
                svc.signal_group(signal.SIGKILL)  # leftovers of the old process group, if any
                svc.spawn()

    def supervise_in_background(
        self, note: Callable[[str], None] | None = None, interval_s: float = 0.5
    ) -> None:
        """Run ``supervise`` every ``interval_s`` in a thread of its own until ``stop()`` (tests;
        ``llmserve up`` calls it from its main loop). The thread lives until stop() is over: a
        child it restarts gets its parent-death signal when that thread ends."""
        if self._supervisor is not None:
            return

        def loop() -> None:
            while not self._stop_done.wait(interval_s):
                try:
                    self.supervise(note or (lambda msg: print(f"llmserve: {msg}", file=sys.stderr)))
                except Exception as e:  # never the end of supervision
                    print(f"llmserve: supervision failed: {e!r}", file=sys.stderr)

        self._supervisor = threading.Thread(target=loop, name="stack-supervisor", daemon=True)
        self._supervisor.start()

    def check_alive(self) -> None:
        for svc in self.services.values():
            if not svc.alive():
                raise StackStartError(
                    f"{svc.name} exited with code {svc.process.returncode}; its last output:\n"
                    f"{svc.log_tail()}"
                )

    def wait_ready(self, progress: Callable[[str], None] | None = None) -> None:
        """Until the stack is ready (``_not_ready`` says nothing is missing); at
        ``ready_timeout_s``, ``StackStartError`` naming what is not ready, with every log tail."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        last_note = 0.0
        while True:
            self.check_alive()
            missing = self._not_ready()
            if not missing:
                return
            now = time.monotonic()
            if now > deadline:
                tails = "\n".join(
                    f"--- {s.name}:\n{s.log_tail(1500)}" for s in self.services.values()
                )
                raise StackStartError(
                    f"the stack was not ready within {self.config.ready_timeout_s}s: "
                    f"{'; '.join(missing)}\n{tails}"
                )
            if progress and now - last_note > 5.0:
                last_note = now
                progress("waiting for the executors to load the model and report in...")
            time.sleep(0.2)

    def _not_ready(self) -> list[str]:
        """What keeps the stack from being ready, empty once it is: every gateway is healthy (a
        tokenizer answers, an executor is live), its scheduler has heard every executor started
        here (prefill ones included: one not yet heard would get no request) and a tokenizer knows
        each served model (/health alone is 200 once any executor is live)."""
        executor_ids = [name for name in self.services if name.startswith("executor-")]
        missing: list[str] = []
        for url in self.base_urls:
            health = _health(url)
            if health is None:
                missing.append(f"{url}/health does not answer 200")
                continue
            live = set(health.get("executor_ids", []))
            not_live = [e for e in executor_ids if e not in live]
            if not_live:
                missing.append(
                    f"{', '.join(not_live)} not live (no heartbeat heard by the scheduler of {url})"
                )
            models = health.get("models", {})
            for m in served_models(self.config):
                if models.get(m.name, {}).get("max_model_len") is None:
                    missing.append(f"no tokenizer serves {m.name} at {url}")
        return missing

    def stop(self, grace_s: float | None = None) -> None:
        """Drain and stop everything, gateway first and servers last; idempotent. After it returns,
        every process this stack started has exited and its data dir is gone. ``grace_s``
        (default: the drain timeout + 5 s) is how long each wave may take before SIGKILL."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            self._stop_processes(grace_s)
        finally:
            if self.data_dir is not None:
                shutil.rmtree(self.data_dir, ignore_errors=True)
            if self.reaper is not None:
                self.reaper.close()
            self._stop_done.set()
            if self._supervisor is not None:
                self._supervisor.join(5.0)

    def _stop_processes(self, grace_s: float | None) -> None:
        if grace_s is None:
            grace_s = self.config.drain_timeout_s + 5.0
        # The gateway stops taking requests first; then the pipeline drains behind it.
        order = ["gateway", "tokenizer", "scheduler", "executor", "prefix_index"]
        waves = [
            [s for s in self.services.values() if s.name.split("-")[0] == kind] for kind in order
        ]
        for wave in waves:
            for svc in wave:
                svc.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for svc in wave:
                try:
                    svc.process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    svc.signal_group(signal.SIGKILL)
                    svc.process.wait()
                # A child may have left a grandchild in its group: sweep the group regardless.
                svc.signal_group(signal.SIGKILL)
        for server in reversed(self.servers):
            server.stop(timeout=grace_s)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _health(base_url: str) -> dict[str, Any] | None:
    """A gateway's /health body when it answers 200, else None."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as r:
            if int(r.status) != 200:
                return None
            body = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _covers(config: StackConfig, server: str) -> bool:
    """Whether the stack's credentials hold ``server``'s ("nats", "redis") users: it starts that
    server itself, or was given them."""
    url = config.nats_url if server == "nats" else config.redis_url
    return url is None or config.credentials is not None


def _spawn(
    argv: list[str], env: dict[str, str], log_path: str | None, tail: collections.deque[str]
) -> subprocess.Popen[bytes]:
    """Start a service with its stdout and stderr in ``log_path``, or, without one, relayed line by
    line to our stderr with the last lines kept in ``tail``."""
    with contextlib.ExitStack() as stack:
        log_file = stack.enter_context(open(log_path, "ab")) if log_path else None
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file or subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=detach_child,
        )
    if log_file is None:
        tail.clear()
        threading.Thread(target=_relay, args=(process.stdout, tail), daemon=True).start()
    return process


def _relay(stream, tail: collections.deque[str]) -> None:
    """Copy a child's output to our stderr until it closes, keeping its last lines."""
    with stream:
        for raw in stream:
            line = raw.decode(errors="replace")
            tail.append(line)
            sys.stderr.write(line)
    sys.stderr.flush()


def launch(
    config: StackConfig, progress: Callable[[str], None] | None = None, wait: bool = True
) -> Stack:
    """Start servers (unless URLs are given) and every service; wait until ready unless ``wait`` is
    False. On any failure everything already started is stopped before the error propagates."""
    note = progress or (lambda _msg: None)
    servers: list[ServerProcess] = []
    stack: Stack | None = None
    credentials = config.credentials or StackCredentials.generate()
    data_dir: str | None = None
    reaper: DirReaper | None = None
    try:
        if config.nats_url is None or config.redis_url is None:
            for path in sweep_orphaned_dirs():
                note(f"removed {path}, left by a stack whose launcher was killed")
            data_dir = make_stack_dir()
            reaper = DirReaper([data_dir])
        nats_url = config.nats_url
        if nats_url is None:
            servers.append(
                start_nats(extra_config=credentials.nats_authorization(), parent_dir=data_dir)
            )
            nats_url = servers[-1].url
            note(f"nats-server on {nats_url} (a user per service)")
            if reaper is not None:  # it must see this server exit before removing its dir
                reaper.watch(servers[-1].pid)
        redis_url = config.redis_url
        if redis_url is None:
            servers.append(start_redis(acl=credentials.redis_acl(), parent_dir=data_dir))
            redis_url = servers[-1].url
            note(f"redis-server on {redis_url} (the prefix index's user only)")
            if reaper is not None:
                reaper.watch(servers[-1].pid)
        ports = gateway_ports(config)
        base_urls = [f"http://{config.host}:{p}" for p in ports]
        observed: dict[str, str] = {}
        otel_env: dict[str, str] = {}
        if config.observability:
            from services.cli.observability import start_observability

            local = start_observability(base_urls, parent_dir=data_dir, note=note)
            for server in local.servers:
                servers.append(server)
                if reaper is not None:
                    reaper.watch(server.pid)
            observed, otel_env = local.urls, local.service_env
        stack = Stack(
            config,
            nats_url,
            redis_url,
            base_urls[0],
            base_urls=base_urls,
            observability=observed,
            servers=servers,
            credentials=credentials if servers or config.credentials else None,
            data_dir=data_dir,
            reaper=reaper,
        )
        env = {
            **os.environ,
            "NATS_URL": nats_url,
            "REDIS_URL": redis_url,
            **otel_env,
            **dict(config.extra_env),
        }
        env.setdefault("PYTHONUNBUFFERED", "1")
        set_executor_openmp_policy(env)
        # The engine settings reach the children by argv alone: a variable left in their environment
        # would fill a setting the config leaves None (the model, say) differently from this config.
        for setting in ENGINE_SETTINGS:
            env.pop(setting.env, None)
        # The key reaches the gateway alone (below); the servers we start get our credentials, not
        # whatever the environment held for others.
        for name in (
            ENV_API_KEY,
            "LLMSERVE_API_KEY_FILE",
            *(NATS_ENV if _covers(config, "nats") else ()),
            *(REDIS_ENV if _covers(config, "redis") else ()),
        ):
            env.pop(name, None)

        def env_of(kind: str) -> dict[str, str]:
            # OTEL_* reach every service as they are (tracing is off unless they turn it on); each
            # service gets its own service.name whatever OTEL_SERVICE_NAME said for the stack.
            own = {"OTEL_SERVICE_NAME": service_name(kind)}
            if _covers(config, "nats"):
                own.update(credentials.nats_env(kind))
            if _covers(config, "redis"):
                own.update(credentials.redis_env(kind))
            return {**env, **own}

        for i in range(num_executors_total(config)):
            stack.start_service(
                f"executor-{i}", "services.executor", executor_args(config, i), env_of("executor")
            )
        for i in range(config.num_prefix_indexes):
            stack.start_service(
                f"prefix_index-{i}",
                "services.prefix_index",
                [
                    "--name",
                    f"prefix_index-{i}",
                    "--executor-timeout",
                    str(config.heartbeat_timeout_s),
                ],
                env_of("prefix_index"),
            )
        for i in range(config.num_schedulers):
            stack.start_service(
                f"scheduler-{i}",
                "services.scheduler",
                scheduler_args(config),
                env_of("scheduler"),
            )
        for i in range(config.num_tokenizers):
            stack.start_service(
                f"tokenizer-{i}", "services.tokenizer", tokenizer_args(config), env_of("tokenizer")
            )
        # The key goes through the environment, not argv: argv is visible to every user in `ps`.
        gateway_env = env_of("gateway")
        if config.api_key:
            gateway_env[ENV_API_KEY] = config.api_key
        for i, port in enumerate(ports):
            args = [
                "--host",
                config.host,
                "--port",
                str(port),
                "--drain-timeout",
                str(config.drain_timeout_s),
                *gateway_model_args(config),
            ]
            if config.request_timeout_s is not None:
                args += ["--request-timeout", str(config.request_timeout_s)]
            stack.start_service(gateway_name(i), "services.gateway", args, gateway_env)
        if wait:
            stack.wait_ready(progress)
        return stack
    except BaseException:
        if stack is not None:
            stack.stop(grace_s=3.0)
        else:
            for server in reversed(servers):
                server.stop()
            if data_dir is not None:
                shutil.rmtree(data_dir, ignore_errors=True)
            if reaper is not None:
                reaper.close()
        raise
