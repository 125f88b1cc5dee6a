"""Long prefills on the real engine (a tiny random Llama with a long context and head_dim 64, so
the CPU kernels' attention runs as it does for SmolLM2): a long prompt's chunks run in a forward
of their own, a slice at a time between the batches of everything else. Steps are counted, not
timed (``prefill_slice_ms=0``: one layer per slice); the outputs are compared exactly (greedy), and
the block pool is checked for leaks after aborts and preemptions mid-forward."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.tiny_llama import TINY_VOCAB, save_tiny_llama
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.model_runner import ScheduledChunk
from shared.wire.sampling_params import SamplingParams

LONG_LEN = 3000
SHORT_LEN = 5
BUDGET = 256  # max_num_batched_tokens
THRESHOLD = 64  # long_prefill_token_threshold: a long prompt's chunks are 64 tokens


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-long"), seed=5, context=4096, hidden_size=256, num_heads=4
    )


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, TINY_VOCAB) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def engine(model_path: str, dtype: str = "float32", **settings) -> Engine:
    settings = dict(long_prefill_token_threshold=THRESHOLD, prefill_slice_ms=0) | settings
    config = EngineConfig(
        model=model_path,
        dtype=dtype,
        num_threads=1,
        max_num_batched_tokens=BUDGET,
        memory_budget="256MiB",
        enable_prefix_caching=False,  # every run computes the long prompt, nothing is served
        **settings,
    )
    return Engine(config, progress=False)


class Driver:
    """Steps an engine and collects each request's tokens."""

    def __init__(self, eng: Engine) -> None:
        self.eng = eng
        self.tokens: dict[str, list[int]] = {}

    def add(self, request_id: str, ids: list[int], max_tokens: int) -> None:
        self.tokens[request_id] = []
        self.eng.add_request(request_id, ids, greedy(max_tokens))

    def step(self) -> None:
        for out in self.eng.step():
            for delta in out.deltas:
                self.tokens[out.request_id] += delta.token_ids

    def finish(self) -> None:
        while self.eng.has_unfinished():
            self.step()


def alone(eng: Engine, ids: list[int], max_tokens: int) -> list[int]:
    d = Driver(eng)
    d.add("alone", ids, max_tokens)
    d.finish()
    return d.tokens["alone"]


def assert_no_leak(eng: Engine) -> None:
    bm = eng.block_manager
    assert not eng.has_unfinished() and eng._layered is None and eng.scheduler.layered is None
    assert bm.num_free_blocks == bm.num_blocks - 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_short_request_runs_in_the_next_step_and_both_outputs_are_exact(model_path, dtype):
    eng = engine(model_path, dtype)
    solo_long = alone(eng, prompt(LONG_LEN, 1), 6)
    solo_short = alone(eng, prompt(SHORT_LEN, 2), 3)
    d = Driver(eng)
    d.add("long", prompt(LONG_LEN, 1), 6)
    for _ in range(7):  # a few chunks in, one in flight (2 layers: a chunk is 2 slices)
        d.step()
    assert eng._layered is not None and not d.tokens["long"]
    d.add("short", prompt(SHORT_LEN, 2), 3)
    d.step()
    assert d.tokens["short"] == solo_short[:1]  # its first token, one step after it arrived
    d.finish()
    assert d.tokens["long"] == solo_long and d.tokens["short"] == solo_short
    assert_no_leak(eng)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_layered_long_prefill_gives_the_tokens_of_a_plain_one(model_path, dtype):
    """The same prompt prefilled in the step's batch (a threshold above its length: the old path,
    chunks of the budget) and in layered chunks of its own: the same greedy tokens."""
    ids = prompt(LONG_LEN, 3)
    layered = alone(engine(model_path, dtype), ids, 8)
    plain = alone(engine(model_path, dtype, long_prefill_token_threshold=4096), ids, 8)
    assert layered == plain and len(layered) == 8


def test_a_forward_advanced_between_other_forwards_is_bit_identical(model_path):
    """The runner's layered forward, with another forward run between two of its layers, against
    the same chunk run whole: the same logits, bit for bit."""
    eng = engine(model_path)
    runner = eng.runner
    long_chunk = ScheduledChunk(prompt(300, 4), 0, list(range(1, 20)))  # 19 blocks of 16
    short_chunk = ScheduledChunk(prompt(SHORT_LEN, 5), 0, [30])
    whole = runner.execute([long_chunk])
    forward = runner.start([long_chunk])
    assert not forward.advance(until=0.0)  # one layer of two
    short_logits = runner.execute([short_chunk])
    assert forward.advance() and torch.equal(forward.logits(), whole)
    assert torch.equal(short_logits, runner.execute([short_chunk]))


def test_aborting_a_long_prompt_mid_forward_frees_everything(model_path):
    eng = engine(model_path)
    d = Driver(eng)
    d.add("long", prompt(LONG_LEN, 1), 4)
    d.add("short", prompt(SHORT_LEN, 2), 40)
    for _ in range(5):  # the long prompt's second chunk is in flight
        d.step()
    assert eng._layered is not None and eng._layered.seq.request.request_id == "long"
    assert eng._layered.seq.num_computed_tokens > 0
    assert eng.abort("long")
    assert eng._layered is None and eng.scheduler.layered is None
    d.finish()
    assert d.tokens["short"] == alone(eng, prompt(SHORT_LEN, 2), 40)
    assert_no_leak(eng)


def test_a_long_prompt_preempted_mid_forward_recomputes_to_the_same_tokens(model_path):
    """39 usable blocks of 16. "short" (11 tokens) decodes; "long" (600 tokens: 3 chunks of 200)
    takes 38 blocks by its third chunk, and in the middle of that chunk's forward the short one's
    17th token needs a second block: the long one, the youngest, is preempted mid-forward, and
    recomputes later."""
    eng = engine(
        model_path,
        num_kv_blocks=40,
        long_prefill_token_threshold=200,
        long_prefill_chunk_tokens=200,
    )
    short_ids, long_ids = prompt(11, 6), prompt(600, 7)
    solo_short, solo_long = alone(eng, short_ids, 20), alone(eng, long_ids, 20)
    d = Driver(eng)
    d.add("short", short_ids, 20)
    d.step()
    d.add("long", long_ids, 20)
    preempted_mid_forward = 0
    while eng.has_unfinished():
        in_flight = eng._layered is not None
        before = eng.scheduler.num_preemptions
        d.step()
        preempted_mid_forward += in_flight and eng.scheduler.num_preemptions > before
    assert preempted_mid_forward >= 1
    assert d.tokens["short"] == solo_short and d.tokens["long"] == solo_long
    assert_no_leak(eng)


def test_without_long_prefills_the_short_request_waits_for_the_whole_long_prefill(model_path):
    """The finding reproduced: a threshold above the prompt's length is the old scheduler, where
    the long prompt takes every step until its prefill ends."""
    eng = engine(model_path, long_prefill_token_threshold=4096)
    d = Driver(eng)
    d.add("long", prompt(LONG_LEN, 1), 2)
    for _ in range(3):
        d.step()
    d.add("short", prompt(SHORT_LEN, 2), 2)
    steps = 0
    while not d.tokens["short"]:
        d.step()
        steps += 1
    assert steps == -(-(LONG_LEN - 3 * BUDGET) // BUDGET)  # 9: every chunk left of the long one
