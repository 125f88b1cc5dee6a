"""bench_stack_vs_engine's workload on the engine side (loadtests/bench_stack_vs_engine.py): each
round draws its own prompts, the engine runs with the stack executor's served defaults, and every
run computes all of its prompts whatever an earlier run left in the prefix cache."""

from __future__ import annotations

import os

import pytest

from services.cli.launcher import EXECUTOR_OPENMP_ENV
from services.executor.config import SERVED_ENGINE_DEFAULTS

INPUT_LEN, OUTPUT_LEN, NUM_PROMPTS = 40, 2, 3  # 40 tokens: two whole 16-token blocks to cache


@pytest.fixture(scope="module")
def sve():
    # Its import gives this process the executors' OpenMP policy; processes that later tests start
    # must not inherit it from here.
    unset = [name for name in EXECUTOR_OPENMP_ENV if name not in os.environ]
    from loadtests import bench_stack_vs_engine

    for name in unset:
        os.environ.pop(name, None)
    return bench_stack_vs_engine


@pytest.fixture(scope="module")
def args(sve):
    return sve.parse_args(
        [
            *("--num-prompts", str(NUM_PROMPTS), "--concurrency", "2"),
            *("--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN)),
        ]
    )


def test_each_round_draws_its_own_prompts(sve, args):
    first, again, second = (sve.round_prompts(args, s) for s in (0, 0, 1))
    assert first == again
    assert len(first) == len(second) == NUM_PROMPTS + 1  # the warm-up's first
    assert all(len(p) == INPUT_LEN for p in first + second)
    assert not set(map(tuple, first)) & set(map(tuple, second))


def test_every_run_computes_all_its_prompts(sve, args):
    engine = sve.make_engine(args)
    assert engine.config.memory_budget == SERVED_ENGINE_DEFAULTS.memory_budget
    prompts = sve.round_prompts(args, 0)
    # Each request (the warm-up's too) feeds its prompt and each output token but the last.
    expected = (NUM_PROMPTS + 1) * (INPUT_LEN + OUTPUT_LEN - 1)
    computed = []
    for _ in range(2):  # the same prompts twice: the second run finds them cached, and drops them
        before = engine.stats().num_computed_tokens
        summary = sve.run_engine(args, prompts, engine)
        computed.append(engine.stats().num_computed_tokens - before)
        assert summary["num_completed"] == NUM_PROMPTS
    assert computed == [expected, expected]
