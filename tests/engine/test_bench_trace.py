"""The mixed-trace benchmark's KV accounting (loadtests/engine_mix.run_trace, behind the report's
paged-KV and batching sections) on the real engine with a tiny random Llama: one sample per
forward pass, with the live tokens and reserved slots counted exactly."""

from __future__ import annotations

import pytest

from helpers.tiny_llama import save_tiny_llama
from loadtests.engine_mix import run_trace
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.wire.sampling_params import SamplingParams

PROMPT_LEN, MAX_TOKENS, BLOCK = 10, 3, 16


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-trace"), seed=3)
    config = EngineConfig(
        model=path, dtype="float32", num_threads=1, num_kv_blocks=32, block_size=BLOCK
    )
    return LLM(config, progress=False)


def test_every_forward_pass_is_sampled_with_exact_counts(llm):
    prompts = [[5 + i] * PROMPT_LEN for i in range(2)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)] * 2
    limit = PROMPT_LEN + MAX_TOKENS
    result = run_trace(
        llm,
        prompts,
        params,
        label="continuous",
        static_batch=None,
        contiguous_limits={"prompt+max_tokens": [limit, limit]},
    )
    kv = result["kv"]
    # One prefill step, then one decode step per further token: each one forward, one sample.
    assert result["num_steps"] == kv["num_steps"] == MAX_TOKENS
    # The last step holds both prompts and the two tokens fed back: 2 x (10 + 2) live tokens,
    # in one 16-token block each, against 13 slots each reserved contiguously.
    assert kv["peak_live_tokens"] == 2 * (PROMPT_LEN + MAX_TOKENS - 1)
    assert kv["paged"]["peak_reserved_slots"] == 2 * BLOCK
    assert kv["contiguous"]["prompt+max_tokens"]["peak_reserved_slots"] == 2 * limit
    assert result["num_output_tokens"] == 2 * MAX_TOKENS
