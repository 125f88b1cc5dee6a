"""The pure parts of speculative decoding: n-gram lookup, the scheduler's grant of speculative
slots, and the block manager giving rejected slots back."""

from __future__ import annotations

import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.scheduler import Scheduler
from shared.engine.sequence import Request, Sequence
from shared.engine.speculative.ngram import NgramProposer
from shared.wire.sampling_params import SamplingParams


def make_seq(tokens: list[int], rid: str = "r", num_prompt: int | None = None) -> Sequence:
    prompt = tokens[: len(tokens) if num_prompt is None else num_prompt]
    req = Request(
        request_id=rid,
        prompt_token_ids=prompt,
        params=SamplingParams(),
        priority=0,
        arrival_order=0,
        max_tokens=100,
    )
    seq = Sequence(request=req, index=0, token_ids=list(tokens))
    req.sequences.append(seq)
    return seq


def propose(proposer: NgramProposer, seq: Sequence, k: int) -> list[int]:
    proposer.plan(seq, k)
    return list(seq.draft_token_ids)


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    p = NgramProposer(max_n=3, min_n=2)
    # "5 6" occurred twice before; the latest is followed by 9 1.
    assert propose(p, make_seq([5, 6, 7, 8, 5, 6, 9, 1, 2, 5, 6]), 2) == [9, 1]
    # The longest suffix wins: "2 5 6" occurred at the start, followed by 3.
    assert propose(p, make_seq([2, 5, 6, 3, 4, 5, 6, 8, 2, 5, 6]), 3) == [3, 4, 5]
    # No suffix of two tokens occurred before: nothing (one token alone is not looked up).
    assert propose(p, make_seq([1, 2, 3, 4, 1]), 4) == []
    # An occurrence that runs into the suffix is a repeating pattern: the proposal continues it.
    assert propose(p, make_seq([1, 2, 1, 2, 1, 2]), 5) == [1, 2, 1, 2, 1]
    assert propose(p, make_seq([7, 1, 2, 3, 1, 2, 3]), 4) == [1, 2, 3, 1]
    # Fewer tokens follow the occurrence than asked: the pattern repeats (period 3 here).
    assert propose(p, make_seq([4, 5, 6, 4, 5]), 5) == [6, 4, 5, 6, 4]


def test_ngram_index_grows_with_the_sequence_as_a_fresh_one_would():
    p = NgramProposer()
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8]
    seq = make_seq(tokens[:4], num_prompt=4)
    for n in range(4, len(tokens) + 1):
        seq.token_ids = tokens[:n]  # grown in place, as decoding appends
        assert propose(p, seq, 3) == propose(p, make_seq(tokens[:n]), 3), n


def test_ngram_sizes_are_checked():
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramProposer(max_n=2, min_n=3)


def test_release_tail_frees_only_blocks_past_the_kept_tokens():
    bm = BlockManager(10, 4)
    assert bm.allocate("s", list(range(6)), 6) == 0
    bm.commit("s", list(range(6)), 6)  # block 0 full and committed, block 1 half
    free = bm.num_free_blocks
    assert bm.can_grow("s", 1 + 8) and bm.allocate("s", [], 1 + 8) == 0  # 15 slots: 4 blocks
    assert bm.num_free_blocks == free - 2
    bm.release_tail("s", 8)  # two proposals accepted: 6 + 1 + 1 tokens computed
    assert bm.num_reserved_tokens("s") == 8 and len(bm.block_table("s")) == 2
    assert bm.num_free_blocks == free
    with pytest.raises(ValueError, match="from 8 reserved tokens to 9"):
        bm.release_tail("s", 9)
    with pytest.raises(ValueError, match="release blocks it committed"):
        bm.release_tail("s", 0)


def test_can_grow_counts_the_copy_of_a_shared_partial_block():
    bm = BlockManager(4, 4)  # three usable blocks
    bm.allocate("p", list(range(6)), 6)  # two blocks, the second half full
    bm.fork("p", "c")
    # One more token for the child copies its shared partial block: one block, and one is free.
    assert bm.can_grow("c", 1) and not bm.can_grow("c", 3)


def decoding(rid: str, prompt_len: int, order: int) -> Sequence:
    seq = make_seq(list(range(prompt_len)), rid)
    seq.request.arrival_order = order
    return seq


def test_scheduler_grants_lookahead_within_budget_and_free_blocks_only():
    bm = BlockManager(8, 4)  # seven usable blocks
    sched = Scheduler(bm, max_num_batched_tokens=8, max_num_seqs=4)
    a, b = decoding("a", 4, 0), decoding("b", 4, 1)
    for seq in (a, b):
        sched.add(seq)
    out = sched.schedule()  # both prompts in one step
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        seq.token_ids.append(1)  # sampled
    a.num_lookahead, b.num_lookahead = 5, 5
    out = sched.schedule()
    # a gets 1 + 5 (its budget share), b what is left of the 8 tokens: 1 + 1.
    assert [(s.request.request_id, n) for s, n in out.scheduled] == [("a", 6), ("b", 2)]
    assert (a.num_lookahead, b.num_lookahead) == (5, 1)
    assert bm.num_reserved_tokens(a.seq_id) == 4 + 6 and bm.num_reserved_tokens(b.seq_id) == 4 + 2


def test_scheduler_never_preempts_for_lookahead():
    bm = BlockManager(4, 4)  # three usable blocks
    sched = Scheduler(bm, max_num_batched_tokens=16, max_num_seqs=4)
    a, b = decoding("a", 4, 0), decoding("b", 3, 1)
    for seq in (a, b):
        sched.add(seq)
    out = sched.schedule()
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        seq.token_ids.append(1)
    # One block is free: a's next token needs it; six proposals would need two. b's next token
    # fits its own block. Nobody is preempted and a gets no lookahead.
    a.num_lookahead = 6
    out = sched.schedule()
    assert out.preempted == [] and a.num_lookahead == 0
    assert [(s.request.request_id, n) for s, n in out.scheduled] == [("a", 1), ("b", 1)]
