"""The mock engine: one token per running choice a step, each step as long as it was told, requests
beyond max_num_seqs waiting in order, and the counters a real engine's stats carry."""

from __future__ import annotations

import time

import pytest

from shared.engine.mock import MOCK_TOKEN_ID, MOCK_TOKEN_TEXT, MockEngine
from shared.wire.sampling_params import SamplingParams


def engine(**kw) -> MockEngine:
    return MockEngine(**{"model_name": "m", "step_ms": 1.0, "max_num_seqs": 2, **kw})


def test_tokens_per_step_waiting_order_and_finish():
    e = engine()
    e.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2))
    e.add_request("b", [5] * 17, SamplingParams(max_tokens=3, n=2))
    e.add_request("c", [5], SamplingParams(max_tokens=1))
    assert (e.stats().num_running, e.stats().num_waiting) == (0, 3)

    first = e.step()
    assert e.take_first_scheduled() == ["a", "b"]
    assert [(o.request_id, len(o.deltas), o.finished) for o in first] == [
        ("a", 1, False),
        ("b", 2, False),
    ]
    d = first[1].deltas[1]
    assert (d.index, d.token_ids, d.text, d.finish_reason) == (1, [MOCK_TOKEN_ID], " tok", None)
    assert MOCK_TOKEN_TEXT == " tok"
    stats = e.stats()
    assert (stats.num_running, stats.num_waiting, stats.last_step_num_tokens) == (2, 1, 3)
    # Blocks: a holds 4 tokens (1 block), b's two choices 18 tokens each (2 blocks each).
    assert stats.num_total_blocks - stats.num_free_blocks == 1 + 2 * 2
    assert stats.num_prompt_tokens == 3 + 17 + 1

    second = e.step()  # a ends; c waits until the step after
    assert [(o.request_id, o.finished) for o in second] == [("a", True), ("b", False)]
    assert second[0].deltas[0].finish_reason == "length"
    assert e.take_first_scheduled() == []
    third = e.step()
    assert e.take_first_scheduled() == ["c"]
    assert [(o.request_id, o.finished) for o in third] == [("b", True), ("c", True)]
    assert not e.has_unfinished()
    stats = e.stats()
    assert stats.num_generated_tokens == 2 + 3 * 2 + 1
    assert (stats.num_steps, stats.num_free_blocks) == (3, stats.num_total_blocks)


def test_step_takes_its_time_and_abort_and_limits():
    e = engine(step_ms=30.0, max_model_len=10)
    e.add_request("a", [1] * 8, SamplingParams(max_tokens=None))  # room for 2 tokens
    e.add_request("b", [1], SamplingParams(max_tokens=100))
    t0 = time.perf_counter()
    e.step()
    assert time.perf_counter() - t0 >= 0.030
    assert e.stats().step_seconds_total >= 0.030
    assert [o.finished for o in e.step()] == [True, False]
    assert e.abort("b") and not e.abort("b") and not e.has_unfinished()
    e.add_request("w1", [1], SamplingParams(max_tokens=5))
    e.add_request("w2", [1], SamplingParams(max_tokens=5))
    e.add_request("w3", [1], SamplingParams(max_tokens=5))
    e.step()
    assert e.abort("w3") and e.stats().num_waiting == 0  # a waiting one
    assert e.take_kv_events() is None and e.kv_cache_snapshot() == (0, [])
    with pytest.raises(ValueError, match="empty"):
        e.add_request("x", [], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len 10"):
        e.add_request("x", [1] * 10, SamplingParams())
    with pytest.raises(ValueError, match="step_ms"):
        engine(step_ms=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine(max_num_seqs=0)
