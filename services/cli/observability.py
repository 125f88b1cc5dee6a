"""``llmserve up --observability``: a local Prometheus and OTLP trace backend, where installed.

- Prometheus: Debian's ``prometheus`` binary (``apt-get install prometheus``), or any on PATH. It
  scrapes every gateway's ``/metrics`` (the gateway serves the whole stack's metrics) every 5 s,
  its store in the stack's temp dir (removed with it).
- Traces: the first of ``jaeger-all-in-one`` (Jaeger 1.x), ``jaeger`` (Jaeger 2.x, its built-in
  all-in-one config) or ``phoenix`` (Arize Phoenix, ``pip install arize-phoenix``) found on PATH.
  Every service then gets the standard OpenTelemetry variables (``OTEL_EXPORTER_OTLP_ENDPOINT``,
  ``OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf``) pointing at its OTLP/HTTP receiver.

What is missing is said, with how to install it; nothing here is fatal to the stack but a backend
that is installed and fails to start (``ServerStartError`` with its log).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from services.cli.servers import LOOPBACK, ServerProcess, _start, free_port

__all__ = ["LocalObservability", "find_prometheus", "find_trace_backend", "start_observability"]

PROMETHEUS_PORT = 9090
JAEGER_UI_PORT = 16686
OTLP_HTTP_PORT = 4318
PHOENIX_PORT = 6006
SCRAPE_INTERVAL_S = 5

_HTTP_PROBE = b"GET / HTTP/1.0\r\nHost: localhost\r\n\r\n"


@dataclass
class LocalObservability:
    servers: list[ServerProcess] = field(default_factory=list)
    urls: dict[str, str] = field(default_factory=dict)  # "prometheus" / "traces" -> its UI
    service_env: dict[str, str] = field(default_factory=dict)  # OTEL_* for every service


def find_prometheus() -> str | None:
    return shutil.which("prometheus")


def find_trace_backend() -> tuple[str, str] | None:
    """(kind, path) of the first trace backend on PATH: "jaeger1", "jaeger2" or "phoenix"."""
    for kind, name in (
        ("jaeger1", "jaeger-all-in-one"),
        ("jaeger2", "jaeger"),
        ("phoenix", "phoenix"),
    ):
        path = shutil.which(name)
        if path:
            return kind, path
    return None


def _port_or_free(preferred: int, host: str = LOOPBACK) -> int:
    """``preferred`` (the tool's usual port, what a user expects) if it is free, else a free one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, preferred))
        except OSError:
            return free_port(host)
    return preferred


def prometheus_config(gateway_urls: list[str]) -> str:
    targets = ", ".join(f'"{urlsplit(u).netloc}"' for u in gateway_urls)
    return (
        "global:\n"
        f"  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
        "scrape_configs:\n"
        "  - job_name: llmserve\n"
        "    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: [{targets}]\n"
    )


def start_prometheus(
    binary: str, gateway_urls: list[str], parent_dir: str | None = None
) -> ServerProcess:
    port = _port_or_free(PROMETHEUS_PORT)
    workdir = tempfile.mkdtemp(prefix="llmserve-prometheus-", dir=parent_dir)
    conf = os.path.join(workdir, "prometheus.yml")
    with open(conf, "w") as f:
        f.write(prometheus_config(gateway_urls))
    argv = [
        binary,
        f"--config.file={conf}",
        f"--storage.tsdb.path={os.path.join(workdir, 'data')}",
        f"--web.listen-address={LOOPBACK}:{port}",
    ]
    return _start(
        "prometheus",
        argv,
        workdir,
        os.path.join(workdir, "prometheus.log"),
        LOOPBACK,
        port,
        f"http://{LOOPBACK}:{port}",
        b"GET /-/ready HTTP/1.0\r\n\r\n",
        b" 200 ",
        "Server is ready to receive web requests.",
        30.0,
    )


def start_trace_backend(
    kind: str, binary: str, parent_dir: str | None = None
) -> tuple[ServerProcess, str]:
    """The backend and its OTLP/HTTP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``)."""
    workdir = tempfile.mkdtemp(prefix=f"llmserve-{kind}-", dir=parent_dir)
    log = os.path.join(workdir, f"{kind}.log")
    if kind == "phoenix":
        # Phoenix serves its UI and OTLP/HTTP on one port; its data dir is the stack's.
        ui_port = _port_or_free(PHOENIX_PORT)
        argv = [
            "env",
            f"PHOENIX_HOST={LOOPBACK}",
            f"PHOENIX_PORT={ui_port}",
            f"PHOENIX_GRPC_PORT={free_port()}",
            f"PHOENIX_WORKING_DIR={workdir}",
            binary,
            "serve",
        ]
        otlp = f"http://{LOOPBACK}:{ui_port}"
    else:
        # Jaeger's usual ports: the UI on 16686, OTLP/HTTP on 4318 (and gRPC on 4317).
        ui_port = JAEGER_UI_PORT
        argv = [binary]
        otlp = f"http://{LOOPBACK}:{OTLP_HTTP_PORT}"
    server = _start(
        kind,
        argv,
        workdir,
        log,
        LOOPBACK,
        ui_port,
        f"http://{LOOPBACK}:{ui_port}",
        _HTTP_PROBE,
        b"HTTP/1.",
        "",
        60.0,
    )
    return server, otlp


def start_observability(
    gateway_urls: list[str],
    parent_dir: str | None = None,
    note: Callable[[str], None] = lambda _msg: None,
) -> LocalObservability:
    """Start what is installed; say what is not. On a failure, what was started is stopped."""
    local = LocalObservability()
    try:
        prometheus = find_prometheus()
        if prometheus is None:
            note(
                "observability: Prometheus is not installed (apt-get install prometheus, or put "
                "a prometheus binary on PATH): no metrics store; each gateway's /metrics still "
                "serves the stack's metrics"
            )
        else:
            server = start_prometheus(prometheus, gateway_urls, parent_dir)
            local.servers.append(server)
            local.urls["prometheus"] = server.url
            note(
                f"observability: Prometheus at {server.url} scrapes {len(gateway_urls)} gateway(s)"
            )
        backend = find_trace_backend()
        if backend is None:
            note(
                "observability: no trace backend is installed (jaeger-all-in-one or jaeger from "
                "Jaeger's release, or pip install arize-phoenix): traces are not exported"
            )
        else:
            kind, binary = backend
            server, otlp = start_trace_backend(kind, binary, parent_dir)
            local.servers.append(server)
            local.urls["traces"] = server.url
            local.service_env = {
                "OTEL_EXPORTER_OTLP_ENDPOINT": otlp,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            }
            note(f"observability: traces ({kind}) at {server.url}, OTLP/HTTP at {otlp}")
    except BaseException:
        for server in reversed(local.servers):
            server.stop()
        raise
    return local
