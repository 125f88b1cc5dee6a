"""Head-of-line blocking under a long prompt, on the real engine (a tiny random Llama with a long
context, so thousands of prompt tokens take a moment): a short request added while a long prompt
prefills gets its first token within a bounded number of steps, and the interleaving leaves the long
request's greedy tokens exactly as they are alone. Steps are counted, not timed."""

from __future__ import annotations

import random

import pytest

from helpers.tiny_llama import TINY_VOCAB, save_tiny_llama
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.wire.sampling_params import SamplingParams

LONG_LEN = 3000
SHORT_LEN = 5
BUDGET = 256  # max_num_batched_tokens
THRESHOLD = 64  # long_prefill_token_threshold
STEPS_BEFORE_SHORT = 3  # the long prompt is 3 chunks in when the short one arrives


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    # head_dim 64: the CPU kernels' attention, as SmolLM2 runs it.
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-long"), seed=5, context=4096, hidden_size=256, num_heads=4
    )


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, TINY_VOCAB) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def engine(model_path: str, dtype: str, **limits) -> Engine:
    config = EngineConfig(
        model=model_path,
        dtype=dtype,
        num_threads=1,
        max_num_batched_tokens=BUDGET,
        memory_budget="256MiB",
        enable_prefix_caching=False,  # every run computes the long prompt, nothing is served
        **limits,
    )
    return Engine(config, progress=False)


def run_long_with_short(eng: Engine) -> tuple[int, list[int], list[int]]:
    """(steps from adding the short request to its first token, the short's tokens, the long's)."""
    tokens: dict[str, list[int]] = {"long": [], "short": []}

    def step() -> None:
        for out in eng.step():
            for delta in out.deltas:
                tokens[out.request_id] += delta.token_ids

    eng.add_request("long", prompt(LONG_LEN, 1), greedy(6))
    for _ in range(STEPS_BEFORE_SHORT):
        step()
    assert not tokens["long"], "the long prompt is still prefilling"
    eng.add_request("short", prompt(SHORT_LEN, 2), greedy(3))
    steps = 0
    while not tokens["short"]:
        step()
        steps += 1
    while eng.has_unfinished():
        step()
    return steps, tokens["short"], tokens["long"]


def alone(eng: Engine, request_id: str, ids: list[int], max_tokens: int) -> list[int]:
    eng.add_request(request_id, ids, greedy(max_tokens))
    out: list[int] = []
    while eng.has_unfinished():
        for o in eng.step():
            out += [t for d in o.deltas for t in d.token_ids]
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_short_request_is_not_stuck_behind_a_long_prefill(model_path, dtype):
    eng = engine(
        model_path, dtype, long_prefill_token_threshold=THRESHOLD, max_long_partial_prefills=1
    )
    solo_long = alone(eng, "long-solo", prompt(LONG_LEN, 1), 6)
    solo_short = alone(eng, "short-solo", prompt(SHORT_LEN, 2), 3)

    steps, short, long = run_long_with_short(eng)
    # The very next step carries the short prompt beside the long prompt's capped chunk.
    assert steps == 1
    assert eng.stats().last_step_num_tokens <= BUDGET
    # Interleaving changes nothing in either output (greedy, exact).
    assert long == solo_long and len(long) == 6
    assert short == solo_short


def test_without_the_cap_the_short_request_waits_for_the_whole_long_prefill(model_path):
    """The finding reproduced: a threshold as large as the step budget is the old scheduler, where
    the long prompt takes every step until its prefill ends."""
    eng = engine(model_path, "bfloat16", long_prefill_token_threshold=BUDGET)
    steps, _, _ = run_long_with_short(eng)
    remaining_chunks = -(-(LONG_LEN - STEPS_BEFORE_SHORT * BUDGET) // BUDGET)
    assert steps == remaining_chunks  # 9 steps here, each a full chunk of the long prompt
