"""Scheduler policy, tested synchronously against the real block manager (no model)."""

from __future__ import annotations

import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.scheduler import LongPrefill, Scheduler
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


# ---- long prefills (LongPrefill): a forward of their own, one at a time ------------------------


def long_scheduler(*, threshold: int = 6, budget: int = 16, num_blocks: int = 128) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, 4, enable_prefix_caching=False),
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        long_prefill=LongPrefill(threshold),
    )


def step_with_layered(sched: Scheduler) -> dict[str, int]:
    """``run_step``, and a long-prefill chunk granted this step shows as ``"layered:<id>"`` (its
    forward stays in flight until ``end_layered``)."""
    out = sched.schedule()
    batch = {seq.request.request_id: n for seq, n in out.scheduled}
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(7)
    if out.layered is not None:
        seq, n = out.layered
        batch[f"layered:{seq.request.request_id}"] = n
    return batch


def end_layered(sched: Scheduler, n: int) -> None:
    seq = sched.layered
    assert seq is not None
    sched.end_layered(seq, n)
    if seq.num_computed_tokens == len(seq.token_ids):
        seq.token_ids.append(7)


def test_without_a_threshold_a_long_prompt_holds_every_step_until_it_is_done():
    """The head-of-line blocking long prefills remove: a short prompt waits out the long one."""
    sched = Scheduler(BlockManager(128, 4), max_num_batched_tokens=16, max_num_seqs=8)
    sched.add(make_seq("long", 100))
    run_step(sched)
    sched.add(make_seq("short", 3, order=1, first_token=500))
    steps = [run_step(sched) for _ in range(6)]
    assert steps[:5] == [{"long": 16}] * 5
    assert steps[5] == {"long": 4, "short": 3}  # only once the long prompt's 100 tokens are done


def test_a_long_prompt_prefills_in_chunks_of_its_own_and_a_short_one_runs_meanwhile():
    sched = long_scheduler()
    long = make_seq("long", 100)
    sched.add(long)
    # Chunks of the threshold (6), outside the batch.
    assert step_with_layered(sched) == {"layered:long": 6}
    assert sched.layered is long and sched.in_flight and long.num_computed_tokens == 0
    sched.add(make_seq("short", 3, order=1, first_token=500))
    # The long chunk is in flight: the next batches are the short request's alone.
    assert step_with_layered(sched) == {"short": 3}
    assert step_with_layered(sched) == {"short": 1}
    end_layered(sched, 6)
    assert long.num_computed_tokens == 6 and sched.layered is long and not sched.in_flight
    assert step_with_layered(sched) == {"short": 1, "layered:long": 6}


def test_the_tail_of_a_long_prefill_stays_layered_and_then_it_decodes_in_the_batch():
    sched = long_scheduler()
    long = make_seq("long", 15)
    sched.add(long)
    for n in (6, 6, 3):  # 3 tokens left is not long, but the prefill under way is
        assert step_with_layered(sched) == {"layered:long": n}
        end_layered(sched, n)
    assert sched.layered is None and long.num_uncomputed == 1
    assert step_with_layered(sched) == {"long": 1}


def test_a_prompt_under_the_threshold_shares_the_batch_and_a_long_one_goes_in_smaller_chunks():
    """The threshold says which prompts are long, ``chunk_tokens`` how much of one each layered
    forward takes: two prompts of 10 (under 12) prefill together in the batch, one of 30 in
    chunks of 4; a chunk never exceeds the threshold."""
    sched = Scheduler(
        BlockManager(128, 4, enable_prefix_caching=False),
        max_num_batched_tokens=32,
        max_num_seqs=8,
        long_prefill=LongPrefill(12, chunk_tokens=4),
    )
    for i, (rid, n) in enumerate([("long", 30), ("a", 10), ("b", 10)]):
        sched.add(make_seq(rid, n, order=i, first_token=100 * i))
    assert step_with_layered(sched) == {"layered:long": 4, "a": 10, "b": 10}
    end_layered(sched, 4)
    assert step_with_layered(sched) == {"a": 1, "b": 1, "layered:long": 4}
    assert LongPrefill(12, chunk_tokens=40).chunk(100) == 12


def test_one_long_prefill_at_a_time_and_shorter_prompts_pass_a_waiting_long_one():
    sched = long_scheduler()
    for i, (rid, n) in enumerate([("long-a", 10), ("long-b", 30), ("short", 5)]):
        sched.add(make_seq(rid, n, order=i, first_token=100 * i))
    assert step_with_layered(sched) == {"layered:long-a": 6, "short": 5}
    assert [s.request.request_id for s in sched.waiting] == ["long-b"]
    assert step_with_layered(sched) == {"short": 1}  # long-b waits for long-a's prefill
    end_layered(sched, 6)
    assert step_with_layered(sched) == {"short": 1, "layered:long-a": 4}
    end_layered(sched, 4)  # long-a's prompt is done: it samples, and decodes in the batch
    assert step_with_layered(sched) == {"short": 1, "long-a": 1, "layered:long-b": 6}


def test_preempting_the_in_flight_long_prefill_drops_its_chunk_and_frees_its_blocks():
    # 5 usable blocks of 4 tokens. "a" (3 tokens, short) takes 1; "long" (20) gets 10 tokens in
    # flight (3 blocks); a's decodes take the last block (positions 4-7), then need another: long,
    # the youngest, is preempted with its chunk still in flight.
    sched = long_scheduler(threshold=10, num_blocks=6)
    a, long = make_seq("a", 3), make_seq("long", 20, order=1, first_token=40)
    sched.add(a)
    sched.add(long)
    assert step_with_layered(sched) == {"a": 3, "layered:long": 10}
    for _ in range(5):  # positions 3 to 7
        assert step_with_layered(sched) == {"a": 1}
    assert sched.bm.num_free_blocks == 0 and sched.layered is long
    out = sched.schedule()  # position 8: a needs a block
    assert out.preempted == [long] and out.layered is None
    assert sched.layered is None and not sched.in_flight
    assert long.status is SequenceStatus.WAITING and long.num_computed_tokens == 0
    assert long.seq_id not in sched.bm and sched.bm.num_free_blocks == 2
    sched.remove(a)
    assert sched.bm.num_free_blocks == 5
    # It starts over from its first chunk.
    assert step_with_layered(sched) == {"layered:long": 10}


def test_removing_the_in_flight_sequence_clears_it():
    sched = long_scheduler()
    long = make_seq("long", 40)
    sched.add(long)
    assert step_with_layered(sched) == {"layered:long": 6}
    sched.remove(long)
    assert sched.layered is None and not sched.in_flight and sched.bm.num_free_blocks == 127
    assert step_with_layered(sched) == {}


def test_long_prefill_threshold_must_be_positive():
    with pytest.raises(ValueError, match="must be positive"):
        LongPrefill(0)
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        LongPrefill(8, chunk_tokens=0)
