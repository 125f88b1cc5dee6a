"""``llmserve up`` and the launcher start ``--prefix-indexes N`` index replicas with the stack's
NATS and Redis, and stop them last, after the executors whose final events they apply."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import pytest

from services.cli import launcher
from services.cli.commands import up
from services.cli.launcher import ServiceProcess, Stack, StackConfig
from shared.engine.config import ENGINE_SETTINGS


@pytest.fixture(autouse=True)
def no_model_env(monkeypatch):
    for s in ENGINE_SETTINGS:
        monkeypatch.delenv(s.env, raising=False)


def up_config(*argv: str) -> StackConfig:
    parser = up.add_parser(argparse.ArgumentParser().add_subparsers())
    return up.stack_config(parser.parse_args(list(argv)))


def test_up_starts_one_index_by_default_and_takes_a_count():
    assert up_config().num_prefix_indexes == 1
    assert up_config("--prefix-indexes", "3").num_prefix_indexes == 3
    assert up_config("--prefix-indexes", "0").num_prefix_indexes == 0
    with pytest.raises(ValueError, match="num_prefix_indexes"):
        StackConfig(num_prefix_indexes=-1)


def test_launch_starts_the_replicas_with_the_stacks_servers(monkeypatch):
    started: list[tuple[str, str, list[str], dict[str, str]]] = []

    def record(self: Stack, name: str, module: str, args: list[str], env: dict[str, str]) -> Any:
        started.append((name, module, args, env))

    monkeypatch.setattr(Stack, "start_service", record)
    config = StackConfig(
        num_prefix_indexes=2, nats_url="nats://127.0.0.1:1", redis_url="redis://127.0.0.1:2/0"
    )
    launcher.launch(config, wait=False)
    indexes = [s for s in started if s[1] == "services.prefix_index"]
    assert [name for name, *_ in indexes] == ["prefix_index-0", "prefix_index-1"]
    for name, _, args, env in indexes:
        # The URLs come by environment only: one from outside may hold a password, and argv is
        # public (ps).
        assert not any("127.0.0.1" in arg for arg in args)
        assert args[args.index("--name") + 1] == name
        assert (env["NATS_URL"], env["REDIS_URL"]) == (
            "nats://127.0.0.1:1",
            "redis://127.0.0.1:2/0",
        )


_ON_SIGTERM = """
import signal, sys, time
def stop(*_):
    with open(sys.argv[1], "a") as f:
        f.write(sys.argv[2] + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("up", flush=True)
time.sleep(60)
"""


def test_the_indexes_stop_after_the_executors(tmp_path):
    order_file = tmp_path / "order"
    stack = Stack(StackConfig(log_dir=str(tmp_path)), "nats://x", "redis://x", "http://x")
    names = ["prefix_index-0", "executor-0", "gateway", "scheduler-0", "tokenizer-0"]
    for name in names:
        argv = [sys.executable, "-c", _ON_SIGTERM, str(order_file), name]
        svc = ServiceProcess(name, argv, str(tmp_path / f"{name}.log"))
        svc.spawn()
        stack.services[name] = svc
    for name in names:  # each has its SIGTERM handler in place before it is asked to stop
        while "up" not in (tmp_path / f"{name}.log").read_text():
            assert stack.services[name].alive()
            time.sleep(0.01)
    stack.stop(grace_s=10.0)
    assert order_file.read_text().split() == [
        "gateway",
        "tokenizer-0",
        "scheduler-0",
        "executor-0",
        "prefix_index-0",
    ]
