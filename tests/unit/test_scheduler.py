"""Scheduler policy, tested synchronously against the real block manager (no model)."""

from __future__ import annotations

from shared.engine.block_manager import BlockManager
from shared.engine.scheduler import Scheduler
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
