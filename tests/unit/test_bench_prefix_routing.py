"""loadtests/bench_prefix_routing.py: the workload's think times, its working set, and what a
request's hit or miss counts as."""

from __future__ import annotations

import pytest

from loadtests.bench_prefix_routing import (
    BLOCK_SIZE,
    Turn,
    ideal_cached_tokens,
    parse_args,
    summarize,
    think_times,
    working_set_blocks,
)


def test_think_times_are_seeded_per_turn_and_within_twice_the_mean():
    args = parse_args(["--conversations", "5", "--turns", "3", "--think-time", "2"])
    think = think_times(args)
    assert think == think_times(args)  # every policy sees the same pauses
    assert [len(row) for row in think] == [2] * 5  # none after the last turn
    flat = [t for row in think for t in row]
    assert all(0 <= t <= 4 for t in flat)
    assert len(set(flat)) == len(flat)  # drawn per turn: conversations fall out of step
    assert think_times(parse_args(["--seed", "1", "--think-time", "2"])) != think_times(
        parse_args(["--think-time", "2"])
    )
    assert {t for row in think_times(parse_args(["--think-time", "0"])) for t in row} == {0.0}


def test_working_set_counts_the_system_prompt_once_and_each_history_in_whole_blocks():
    # The defaults: ceil(1000 / 16) = 63 shared blocks, then 8 x ceil(8 x (64 + 128) / 16) = 96.
    args = parse_args([])
    assert working_set_blocks(args) == 63 + 8 * 96
    # The default pool holds it once, not once on each executor: what placement decides.
    assert args.num_kv_blocks < working_set_blocks(args) <= args.executors * args.num_kv_blocks
    one = parse_args(["--conversations", "1", "--turns", "1", "--system-len", "16"])
    assert working_set_blocks(one) == 1 + (64 + 128 + BLOCK_SIZE - 1) // BLOCK_SIZE


def _turn(conversation: int, turn: int, prompt: list[int], sent_at: float, **kw) -> Turn:
    return Turn(conversation, turn, prompt, sent_at=sent_at, ok=True, **kw)


def test_a_turn_that_gets_less_than_its_ideal_counts_as_missed():
    system = list(range(2 * BLOCK_SIZE))
    first = _turn(0, 0, system + [100], 0.0, ttft_s=1.0, reply=[7] * BLOCK_SIZE)
    # Its prompt extends the first's prompt and reply: the ideal is those 3 whole blocks (the
    # final token is always computed, so a fourth block is never counted).
    second = _turn(0, 1, first.prompt + first.reply + [5] * BLOCK_SIZE, 1.0, ttft_s=0.2)
    other = _turn(1, 0, system + [200], 2.0, ttft_s=0.8)
    turns = [first, second, other]
    ideal_cached_tokens(turns, BLOCK_SIZE)
    assert [t.ideal_cached_tokens for t in turns] == [0, 3 * BLOCK_SIZE, 2 * BLOCK_SIZE]
    second.cached_tokens = 3 * BLOCK_SIZE  # all of it
    other.cached_tokens = BLOCK_SIZE  # half: missed
    summary = summarize("cache", turns, {})
    assert summary["num_missed"] == 1
    assert summary["ttft_ms"]["missed_median"] == pytest.approx(800.0)
    assert summary["ttft_ms"]["hit_median"] == pytest.approx(600.0)  # 1,000 and 200 ms
    assert summary["hit_rate_of_ideal"] == pytest.approx(4 / 5)
