"""The launcher's readiness: a stack is ready once every executor it started (prefill ones
included) is live as the gateway's /health reports it, not at the first one; at its timeout the
error names the executors not heard from."""

from __future__ import annotations

from typing import Any

import pytest

from services.cli import launcher
from services.cli.launcher import ServiceProcess, Stack, StackConfig, StackStartError

URL = "http://127.0.0.1:1"
MODEL = "SmolLM2-135M-Instruct"


class Running:
    """A child process that stays alive (``ServiceProcess.alive`` polls it)."""

    returncode = None

    def poll(self) -> None:
        return None


def stack_of(config: StackConfig, names: list[str]) -> Stack:
    stack = Stack(config, "nats://127.0.0.1:2", "redis://127.0.0.1:3/0", URL)
    for name in names:
        svc = ServiceProcess(name, [], None)
        svc.process = Running()  # type: ignore[assignment]
        stack.services[name] = svc
    return stack


def health(*executor_ids: str, max_model_len: int | None = 8192) -> dict[str, Any]:
    return {
        "status": "ok",
        "executor_ids": list(executor_ids),
        "models": {MODEL: {"num_executors": 1, "max_model_len": max_model_len}},
    }


DISAGG = StackConfig(
    num_executors=0, num_prefill=1, num_decode=1, model_name=MODEL, ready_timeout_s=0.5
)
NAMES = ["executor-0", "executor-1", "scheduler-0", "tokenizer-0", "gateway"]


def test_ready_once_every_started_executor_is_live(monkeypatch):
    stack = stack_of(DISAGG, NAMES)
    answers = {URL: health("executor-1")}  # the decode executor alone: /health is already 200
    monkeypatch.setattr(launcher, "_health", lambda url: answers.get(url))
    assert stack._not_ready() == [
        f"executor-0 not live (no heartbeat heard by the scheduler of {URL})"
    ]
    answers[URL] = health("executor-0", "executor-1")
    assert stack._not_ready() == []
    answers[URL] = health("executor-0", "executor-1", max_model_len=None)
    assert stack._not_ready() == [f"no tokenizer serves {MODEL} at {URL}"]
    del answers[URL]
    assert stack._not_ready() == [f"{URL}/health does not answer 200"]


def test_the_timeout_names_the_executors_not_live(monkeypatch):
    stack = stack_of(DISAGG, NAMES)
    monkeypatch.setattr(launcher, "_health", lambda url: health("executor-1"))
    with pytest.raises(StackStartError, match=r"within 0.5s: executor-0 not live"):
        stack.wait_ready()
