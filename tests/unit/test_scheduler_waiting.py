"""The scheduler's waiting queues: order within a model, models apart, removal."""

from __future__ import annotations

import pytest

from services.scheduler.executors import InFlight
from services.scheduler.waiting import WaitingQueues
from shared.wire.messages import ExecuteRequest
from shared.wire.sampling_params import SamplingParams


def entry(rid: str, order: int, *, model: str = "m", priority: int = 0, attempt: int = 0):
    request = ExecuteRequest(
        request_id=rid,
        model=model,
        prompt_token_ids=[1],
        block_hashes=[],
        params=SamplingParams(max_tokens=1),
        priority=priority,
        attempt=attempt,
    )
    return InFlight(request, 1, None, None, order)


def drain(queues: WaitingQueues, model: str) -> list[str]:
    taken = []
    while queues.head(model) is not None:
        taken.append(queues.pop(model).request.request_id)
    return taken


def test_retries_first_then_priority_then_arrival():
    queues = WaitingQueues()
    for e in (
        entry("late", 3),
        entry("early", 1),
        entry("urgent", 4, priority=-1),
        entry("retried", 5, attempt=1),
        entry("middle", 2),
    ):
        queues.push(e)
    assert len(queues) == 5 and "middle" in queues
    assert drain(queues, "m") == ["retried", "urgent", "early", "middle", "late"]
    assert len(queues) == 0 and queues.models() == []


def test_models_wait_apart():
    queues = WaitingQueues()
    queues.push(entry("a1", 1, model="a"))
    queues.push(entry("b1", 2, model="b"))
    queues.push(entry("a2", 3, model="a"))
    assert sorted(queues.models()) == ["a", "b"]
    assert drain(queues, "b") == ["b1"]
    assert queues.models() == ["a"]
    assert drain(queues, "a") == ["a1", "a2"]


def test_removed_requests_are_skipped_and_counted_out():
    queues = WaitingQueues()
    for i, rid in enumerate(("x", "y", "z")):
        queues.push(entry(rid, i))
    removed = queues.remove("x")
    assert removed is not None and removed.request.request_id == "x"
    assert queues.remove("x") is None  # gone already
    assert "x" not in queues and len(queues) == 2
    assert [e.request.request_id for e in queues.entries()] == ["y", "z"]
    head = queues.head("m")
    assert head is not None and head.request.request_id == "y"
    queues.remove("z")
    assert drain(queues, "m") == ["y"]


def test_pop_without_a_waiting_request_is_a_bug():
    queues = WaitingQueues()
    queues.push(entry("x", 0))
    queues.remove("x")
    with pytest.raises(AssertionError, match="no request waits for m"):
        queues.pop("m")


def test_clear_forgets_everything():
    queues = WaitingQueues()
    queues.push(entry("x", 0))
    queues.clear()
    assert len(queues) == 0 and queues.request_ids() == [] and queues.head("m") is None
