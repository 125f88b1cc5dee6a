"""Scheduler policy, tested synchronously against the real block manager (no model)."""

from __future__ import annotations

import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.scheduler import PrefillLimits, Scheduler
from shared.engine.sequence import Request, Sequence, SequenceStatus
from shared.wire.sampling_params import SamplingParams


def make_seq(
    rid: str, prompt_len: int, *, priority: int = 0, order: int = 0, first_token: int = 0
) -> Sequence:
    ids = [first_token + i for i in range(prompt_len)]
    req = Request(
        request_id=rid,
        prompt_token_ids=ids,
        params=SamplingParams(),
        priority=priority,
        arrival_order=order,
        max_tokens=100,
    )
    seq = Sequence(request=req, index=0, token_ids=list(ids))
    req.sequences.append(seq)
    return seq


def run_step(sched: Scheduler) -> dict[str, int]:
    """Schedule, then play the model: tokens become computed, finished chunks sample token 7."""
    out = sched.schedule()
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        sched.bm.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(7)
    return {seq.request.request_id: n for seq, n in out.scheduled}


def test_long_prompt_is_chunked_and_never_starves_running_decodes():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=16, max_num_seqs=8)
    short = make_seq("short", 3)
    sched.add(short)
    assert run_step(sched) == {"short": 3}
    long = make_seq("long", 50, order=1, first_token=100)
    sched.add(long)
    steps = [run_step(sched) for _ in range(4)]
    # The decode gets its token every step; the prompt takes what remains of the budget.
    assert steps == [
        {"short": 1, "long": 15},
        {"short": 1, "long": 15},
        {"short": 1, "long": 15},
        {"short": 1, "long": 5},
    ]
    assert long.num_computed_tokens == 50 and len(long.token_ids) == 51
    assert run_step(sched) == {"short": 1, "long": 1}


def test_max_num_seqs_caps_running_sequences():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=100, max_num_seqs=2)
    for i in range(3):
        sched.add(make_seq(f"r{i}", 4, order=i, first_token=10 * i))
    assert set(run_step(sched)) == {"r0", "r1"}
    assert sched.num_running == 2 and sched.num_waiting == 1


def test_waiting_queue_is_priority_then_fcfs():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=8, max_num_seqs=8)
    sched.add(make_seq("late-normal", 4, priority=1, order=2))
    sched.add(make_seq("early-normal", 4, priority=1, order=1, first_token=50))
    sched.add(make_seq("urgent", 4, priority=0, order=3, first_token=90))
    assert list(run_step(sched)) == ["urgent", "early-normal"]


def test_out_of_blocks_preempts_the_lowest_priority_latest_sequence():
    # 6 usable blocks of 4 tokens; three 8-token prompts take all of them.
    sched = Scheduler(
        BlockManager(7, 4, enable_prefix_caching=False), max_num_batched_tokens=64, max_num_seqs=8
    )
    a, b, c = (
        make_seq("a", 8, order=0),
        make_seq("b", 8, order=1, first_token=20),
        make_seq("c", 8, order=2, first_token=40),
    )
    for s in (a, b, c):
        sched.add(s)
    assert run_step(sched) == {"a": 8, "b": 8, "c": 8}
    # Each now needs a ninth slot, i.e. a new block: only c (latest) is preempted, a and b run.
    assert run_step(sched) == {"a": 1, "b": 1}
    assert sched.num_preemptions == 1
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0
    assert len(c.token_ids) == 9  # its sampled token is kept: it is recomputed, not lost
    assert sched.bm.num_free_blocks == 0


def test_preempted_sequence_resumes_when_blocks_return():
    sched = Scheduler(
        BlockManager(7, 4, enable_prefix_caching=False), max_num_batched_tokens=64, max_num_seqs=8
    )
    a, c = make_seq("a", 8), make_seq("c", 16, order=1, first_token=40)
    sched.add(a)
    sched.add(c)
    run_step(sched)  # a: 2 blocks, c: 4 blocks — the pool is full
    run_step(sched)  # a needs a third block: c is preempted
    assert c.status is SequenceStatus.WAITING
    sched.remove(a)  # a finishes
    assert run_step(sched) == {"c": 17}  # recompute prompt + its one output token
    assert c.num_computed_tokens == 17


# ---- prefill fairness (PrefillLimits) ---------------------------------------------------------


def fair_scheduler(
    *, threshold: int = 6, max_prefills: int = 8, max_long: int = 1, budget: int = 16
) -> Scheduler:
    return Scheduler(
        BlockManager(128, 4),
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        prefill_limits=PrefillLimits(
            long_prefill_token_threshold=threshold,
            max_num_partial_prefills=max_prefills,
            max_long_partial_prefills=max_long,
        ),
    )


def test_without_limits_a_long_prompt_holds_every_step_until_it_is_done():
    """The head-of-line blocking the limits remove: a short prompt waits out the long one."""
    sched = Scheduler(BlockManager(128, 4), max_num_batched_tokens=16, max_num_seqs=8)
    sched.add(make_seq("long", 100))
    run_step(sched)
    sched.add(make_seq("short", 3, order=1, first_token=500))
    steps = [run_step(sched) for _ in range(6)]
    assert steps[:5] == [{"long": 16}] * 5
    assert steps[5] == {"long": 4, "short": 3}  # only once the long prompt's 100 tokens are done


def test_a_short_prompt_arriving_during_a_long_prefill_runs_in_the_next_step():
    sched = fair_scheduler()
    sched.add(make_seq("long", 100))
    assert run_step(sched) == {"long": 6}  # capped at the threshold, not the budget of 16
    sched.add(make_seq("short", 3, order=1, first_token=500))
    assert run_step(sched) == {"long": 6, "short": 3}
    # The short one decodes from then on, before the long prompt's chunks.
    assert list(run_step(sched).items()) == [("short", 1), ("long", 6)]


def test_a_second_long_prompt_waits_and_a_shorter_one_behind_it_passes():
    sched = fair_scheduler()
    for i, (rid, n) in enumerate([("long-a", 20), ("long-b", 30), ("short", 5)]):
        sched.add(make_seq(rid, n, order=i, first_token=100 * i))
    # One long prompt at a time (max_long_partial_prefills=1); the short one is not long.
    assert run_step(sched) == {"long-a": 6, "short": 5}
    assert run_step(sched) == {"short": 1, "long-a": 6}
    assert run_step(sched) == {"short": 1, "long-a": 6}
    # long-a has 2 left: no longer long, so long-b may start beside it.
    assert run_step(sched) == {"short": 1, "long-a": 2, "long-b": 6}
    assert [s.request.request_id for s in sched.waiting] == []


def test_long_prompts_share_steps_up_to_max_long_partial_prefills():
    sched = fair_scheduler(max_long=2)
    for i in range(3):
        sched.add(make_seq(f"long{i}", 40, order=i, first_token=100 * i))
    assert run_step(sched) == {"long0": 6, "long1": 6}
    assert sched.num_waiting == 1


def test_max_num_partial_prefills_caps_the_prompts_of_one_step():
    sched = fair_scheduler(max_prefills=2, max_long=1)
    for i in range(4):
        sched.add(make_seq(f"r{i}", 3, order=i, first_token=10 * i))
    assert run_step(sched) == {"r0": 3, "r1": 3}
    # r0 and r1 decode now; decodes are not prefills, so two more prompts start.
    assert run_step(sched) == {"r0": 1, "r1": 1, "r2": 3, "r3": 3}


def test_limits_keep_decodes_first_and_within_the_budget():
    sched = fair_scheduler(threshold=6, budget=8)
    for i in range(3):
        sched.add(make_seq(f"d{i}", 2, order=i, first_token=10 * i))
    run_step(sched)
    sched.add(make_seq("long", 50, order=3, first_token=500))
    # Three decodes first; the long prompt gets its threshold only if the budget leaves it.
    assert run_step(sched) == {"d0": 1, "d1": 1, "d2": 1, "long": 5}
    assert run_step(sched) == {"d0": 1, "d1": 1, "d2": 1, "long": 5}


def test_a_preempted_long_sequence_is_recomputed_in_capped_chunks():
    sched = Scheduler(
        BlockManager(8, 4, enable_prefix_caching=False),  # 7 usable blocks of 4 tokens
        max_num_batched_tokens=64,
        max_num_seqs=8,
        prefill_limits=PrefillLimits(long_prefill_token_threshold=8, max_long_partial_prefills=1),
    )
    a, b = make_seq("a", 8), make_seq("b", 16, order=1, first_token=40)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == {"a": 8, "b": 8}  # b is long (16 > 8): chunked
    assert run_step(sched) == {"a": 1, "b": 8}  # a 3 blocks, b 4: the pool is full
    assert run_step(sched) == {"a": 1}  # b's sampled token needs a 5th block: b is preempted
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    sched.remove(a)
    assert run_step(sched) == {"b": 8}  # its 17 tokens again, 8 at a time
    assert run_step(sched) == {"b": 8}
    assert run_step(sched) == {"b": 1}
    assert b.num_computed_tokens == 17


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(long_prefill_token_threshold=0),
        dict(max_num_partial_prefills=0),
        dict(max_long_partial_prefills=-1),
    ],
)
def test_prefill_limits_must_be_positive(kwargs):
    with pytest.raises(ValueError, match="must be positive"):
        PrefillLimits(**kwargs)
