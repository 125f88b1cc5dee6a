"""The decode floor bench_disagg measures (loadtests/decode_floor.py): streams stepping in one
engine alone, pinned to given cores, timed over the given contexts only."""

from __future__ import annotations

import os

import pytest

from loadtests.decode_floor import decode_floor


def test_decode_floor_times_the_steps_inside_the_contexts_and_restores_the_process():
    affinity = os.sched_getaffinity(0)
    cpu = min(affinity)
    prompts = [[1000 + i] * 8 for i in range(2)]
    floor = decode_floor(prompts, (cpu,), (12, 16))
    assert floor["cpus"] == [cpu] and floor["contexts"] == [12, 16]
    assert floor["step_ms"]["count"] == 4  # the steps that start at contexts 12, 13, 14 and 15
    assert 0 < floor["step_ms"]["min"] <= floor["step_ms"]["p50"] <= floor["step_ms"]["p99"]
    assert os.sched_getaffinity(0) == affinity  # the caller gets its cores back


def test_decode_floor_refuses_contexts_inside_the_prompts_and_uneven_prompts():
    with pytest.raises(ValueError, match="past the prompts"):
        decode_floor([[1000] * 8], (0,), (8, 16))
    with pytest.raises(ValueError, match="one length"):
        decode_floor([[1000] * 8, [1000] * 9], (0,), (12, 16))
