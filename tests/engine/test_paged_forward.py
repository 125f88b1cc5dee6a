"""The paged forward pass: batching, chunking and block placement must not change the numbers.

Every check compares against the same sequence run alone as one prefill from an empty cache
(fp32, real SmolLM2-135M weights). Tolerance: measured max |logit diff| below; ~5x headroom.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers.greedy import blocks_needed, make_runner, shuffled_block_table
from shared.engine.model_runner import ModelRunner, ScheduledChunk

# Measured max |logit diff| vs the sequence alone: mixed batch <= 3.7e-5, chunked prefill <= 4.7e-5
# (chunk size 1: every token through the decode path). ~4x headroom.
ATOL = 2e-4


def random_ids(n: int, seed: int, vocab: int = 49152) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def alone(model, ids: list[int]) -> torch.Tensor:
    """Last-position logits of ``ids`` prefilled in one chunk from an empty cache (the
    reference)."""
    runner = make_runner(model, blocks_needed(len(ids)) + 1)
    table = list(range(1, blocks_needed(len(ids)) + 1))
    return runner.execute([ScheduledChunk(ids, 0, table)])[0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


class Allocator:
    """Hands out distinct shuffled non-zero block ids from one cache."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        assert len(taken) == n, "test cache too small"
        return taken


@pytest.fixture(scope="module")
def model(runtime_fp32):
    return runtime_fp32


def test_mixed_batch_matches_each_sequence_alone(model):
    """One execute() holding fresh prefills, continued chunked prefills (num_computed > 0, over
    already-cached blocks, aligned and not) and single-token decodes of other sequences, in a
    scrambled order, equals each sequence run alone. Every block, block 0 included, starts full of
    garbage, as a reused block does (blocks are not zeroed on reuse): nothing past a sequence's
    length, and nothing in the padding block, may leak into the result."""
    runner = make_runner(model, num_blocks=64)
    gen = torch.Generator().manual_seed(0)
    runner.kv_cache.storage.copy_(torch.randn(runner.kv_cache.storage.shape, generator=gen) * 10)
    block0 = runner.kv_cache.storage[:, :, 0].clone()
    alloc = Allocator(runner.kv_cache.num_blocks, seed=1)

    # name: (all tokens known after this step, tokens already cached before it, need_logits)
    plan = {
        "fresh_prefill": (random_ids(37, 1), 0, True),
        "continue_unaligned": (random_ids(45, 2), 20, True),  # 20: mid-block
        "continue_aligned": (random_ids(50, 3), 32, True),  # 32: a block boundary
        "continue_no_logits": (random_ids(70, 4), 9, False),  # a middle chunk: prompt goes on to 70
        "decode_short": (random_ids(18, 5), 17, True),
        "decode_block_edge": (random_ids(33, 6), 32, True),  # the new token opens a fresh block
        "decode_long": (random_ids(81, 7), 80, True),
    }
    chunk_end = {"continue_no_logits": 40}
    tables = {name: alloc.take(blocks_needed(len(ids))) for name, (ids, _, _) in plan.items()}
    # Earlier steps: cache the context of every sequence that has one, each in its own step.
    for name, (ids, num_computed, _) in plan.items():
        if num_computed:
            runner.execute([ScheduledChunk(ids[:num_computed], 0, tables[name], need_logits=False)])

    order = [
        "decode_long",
        "continue_unaligned",
        "fresh_prefill",
        "decode_short",
        "continue_no_logits",
        "continue_aligned",
        "decode_block_edge",
    ]
    chunks = [
        ScheduledChunk(
            plan[n][0][plan[n][1] : chunk_end.get(n, len(plan[n][0]))],
            plan[n][1],
            tables[n],
            need_logits=plan[n][2],
        )
        for n in order
    ]
    assert sum(len(c.token_ids) == 1 for c in chunks) == 3 and len(chunks) == 7
    logits = runner.execute(chunks)
    with_logits = [n for n in order if plan[n][2]]
    assert (
        logits.shape == (len(with_logits), model.config.vocab_size)
        and logits.dtype == torch.float32
    )

    diffs = {}
    for row, name in zip(logits, with_logits, strict=True):
        expected = alone(model, plan[name][0])
        diffs[name] = max_diff(row, expected)
        assert int(row.argmax()) == int(expected.argmax()), name
    print("mixed batch vs alone:", {k: f"{v:.2g}" for k, v in diffs.items()})
    assert max(diffs.values()) <= ATOL, diffs

    # The chunk without logits still wrote its K/V: finishing that prompt gives the right answer.
    ids = plan["continue_no_logits"][0]
    finished = runner.execute([ScheduledChunk(ids[40:], 40, tables["continue_no_logits"])])[0]
    assert max_diff(finished, alone(model, ids)) <= ATOL
    # Block 0 is padding: padded block-table entries point at it, but nothing is written there.
    assert torch.equal(runner.kv_cache.storage[:, :, 0], block0)


def test_block_placement_does_not_matter(model):
    """Contiguous, reversed and scattered block tables give bit-identical results (the cache is read
    back through the table: a chunked prefill and decodes, not just a first chunk)."""
    ids = random_ids(60, 11)
    n = blocks_needed(len(ids) + 3)

    def run(table: list[int], num_blocks: int) -> torch.Tensor:
        runner = make_runner(model, num_blocks)
        runner.execute([ScheduledChunk(ids[:25], 0, table, need_logits=False)])
        out = [runner.execute([ScheduledChunk(ids[25:], 25, table)])[0]]
        for pos, tok in enumerate([5, 6, 7], start=len(ids)):
            out.append(runner.execute([ScheduledChunk([tok], pos, table)])[0])
        return torch.stack(out)

    contiguous = run(list(range(1, n + 1)), n + 1)
    reversed_ = run(list(range(n, 0, -1)), n + 1)
    scattered = run(shuffled_block_table(n, 40, random.Random(3)), 40)
    assert torch.equal(contiguous, reversed_)
    assert torch.equal(contiguous, scattered)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 33])
def test_chunked_prefill_equals_one_shot(model, chunk_size):
    """Chunks of any size, aligned to blocks or not, leave the same K/V in the cache and give the
    same last-position logits as one prefill."""
    ids = random_ids(50, 21)
    n = blocks_needed(len(ids))
    one_shot = make_runner(model, n + 1)
    one_shot_table = list(range(1, n + 1))
    expected = one_shot.execute([ScheduledChunk(ids, 0, one_shot_table)])[0]

    runner = make_runner(model, 3 * n)
    table = shuffled_block_table(n, 3 * n, random.Random(chunk_size))
    for start in range(0, len(ids), chunk_size):
        end = min(start + chunk_size, len(ids))
        out = runner.execute(
            [ScheduledChunk(ids[start:end], start, table, need_logits=end == len(ids))]
        )
    diff = max_diff(out[0], expected)
    print(f"chunk {chunk_size}: max |logit diff| {diff:.2g}")
    assert diff <= ATOL
    assert int(out[0].argmax()) == int(expected.argmax())

    # Same K/V, token by token, in every layer (read through each run's own block table).
    def cached(r: ModelRunner, tbl: list[int]) -> torch.Tensor:
        s = r.kv_cache.storage  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        return s[:, :, torch.tensor(tbl)].flatten(2, 3)[:, :, : len(ids)]

    kv_diff = max_diff(cached(runner, table), cached(one_shot, one_shot_table))
    assert kv_diff <= ATOL, kv_diff
    assert not runner.kv_cache.storage[:, :, 0].any(), "block 0 (padding) was written"
    unused = sorted(set(range(1, 3 * n)) - set(table))
    assert not runner.kv_cache.storage[:, :, unused].any(), "a block outside the table was written"


@pytest.mark.parametrize("last_chunk", [1, 2, 17])
def test_prompt_chunks_give_bit_identical_logits_in_bf16(runtime_bf16, last_chunk):
    """A prompt's tokens all go through the prefill kernel, however they are chunked: a last chunk
    of one token (a budget split, or a prefix-cache hit on everything before it) is not routed to
    the decode kernel, whose rounding differs. So a prompt gives the same logits, to the bit, in
    one chunk or two, next to decodes of another sequence or alone (bf16, the default dtype)."""
    ids = random_ids(70, seed=9)
    alloc = Allocator(16, seed=3)
    one_table, two_table, other_table = alloc.take(5), alloc.take(5), alloc.take(3)
    runner = make_runner(runtime_bf16, 16)
    whole = runner.execute([ScheduledChunk(ids, 0, one_table)])[0]
    head = len(ids) - last_chunk
    other = random_ids(33, seed=10)
    runner.execute(
        [
            ScheduledChunk(ids[:head], 0, two_table, need_logits=False),
            ScheduledChunk(other[:32], 0, other_table),
        ]
    )
    split = runner.execute(
        [
            ScheduledChunk([other[32]], 32, other_table, decode_from=32),
            ScheduledChunk(ids[head:], head, two_table, decode_from=len(ids)),
        ]
    )[1]
    assert torch.equal(split, whole)


@pytest.mark.parametrize("first_chunk", [48, 55, 30])
def test_recomputed_sampled_tokens_give_bit_identical_logits_in_bf16(runtime_bf16, first_chunk):
    """A preempted sequence recomputes its prompt and its sampled tokens, in one chunk or a few.
    With ``decode_from`` at the prompt's end each sampled token attends through the decode kernel on
    its own, as on its first pass, so the recomputed logits equal, to the bit, those of the decode
    steps that first produced them (bf16, where the two kernels' rounding differs). ``first_chunk``:
    where a token budget splits the recompute: among the sampled tokens (48; 55, leaving one) or
    inside the prompt (30)."""
    prompt, sampled = random_ids(40, seed=21), random_ids(16, seed=22)
    alloc = Allocator(24, seed=5)
    first_table, again_table, other_table = alloc.take(4), alloc.take(4), alloc.take(4)
    runner = make_runner(runtime_bf16, 24)
    other = random_ids(60, seed=23)
    runner.execute(
        [
            ScheduledChunk(prompt, 0, first_table, decode_from=len(prompt)),
            ScheduledChunk(other[:40], 0, other_table, decode_from=40),
        ]
    )
    for i, token in enumerate(sampled):  # decode steps next to another sequence's
        position = len(prompt) + i
        first_pass = runner.execute(
            [
                ScheduledChunk([token], position, first_table, decode_from=len(prompt)),
                ScheduledChunk([other[position]], position, other_table, decode_from=40),
            ]
        )[0]
    ids = prompt + sampled
    runner.execute(
        [
            ScheduledChunk(
                ids[:first_chunk], 0, again_table, need_logits=False, decode_from=len(prompt)
            )
        ]
    )
    recomputed = runner.execute(
        [ScheduledChunk(ids[first_chunk:], first_chunk, again_table, decode_from=len(prompt))]
    )[0]
    assert torch.equal(recomputed, first_pass)


def test_an_empty_chunk_is_refused(model):
    runner = make_runner(model, 4)
    with pytest.raises(ValueError, match="at least one new token"):
        runner.execute([ScheduledChunk([], 0, [1])])
