"""Engine behaviour on the real SmolLM2 (fp32, so batched and solo runs agree to the token)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from helpers.prompts import PROMPTS
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine, PromptTooLongError
from shared.engine.llm import LLM
from shared.wire.sampling_params import SamplingParams

GREEDY: dict[str, Any] = dict(temperature=0.0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # long_prefill_token_threshold = the step budget: a prompt prefills in one step when it fits
    # (test_chunked_prefill_matches_single_shot's reference); long prefills have their own tests
    # (test_prefill_fairness.py).
    return LLM(
        EngineConfig(
            dtype="float32",
            num_kv_blocks=512,
            max_num_seqs=32,
            max_num_batched_tokens=256,
            long_prefill_token_threshold=256,
        ),
        progress=False,
    )


def test_prefix_caching_off_from_the_command_line_reaches_the_engine():
    config = EngineConfig.from_argv(
        ["--dtype", "float32", "--num-kv-blocks", "16", "--no-enable-prefix-caching"]
    )
    llm = LLM(config, progress=False)
    assert llm.engine.block_manager.enable_prefix_caching is False
    prompt = PROMPTS[0] * 4
    llm.generate([prompt], SamplingParams(max_tokens=2))
    assert llm.generate([prompt], SamplingParams(max_tokens=2))[0].num_cached_tokens == 0


def _tokens(results):
    return [r.outputs[0].token_ids for r in results]


def assert_no_leak(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_sixteen_concurrent_greedy_requests_match_solo_runs(llm):
    params = [SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True, **GREEDY) for i in range(16)]
    batched = _tokens(llm.generate(PROMPTS, params))
    solo = [_tokens(llm.generate(p, sp))[0] for p, sp in zip(PROMPTS, params, strict=True)]
    assert batched == solo
    assert [len(t) for t in batched] == [8 + 3 * i for i in range(16)]
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_pool_forces_preemption_without_changing_output(llm, dtype):
    """In bf16 too: the resumed sequences recompute their sampled tokens through the decode kernel,
    so their logits are bit-identical to the first pass (see ScheduledChunk.decode_from)."""
    params = SamplingParams(max_tokens=48, ignore_eos=True, **GREEDY)
    prompts = PROMPTS[:8]
    large = llm if dtype == "float32" else LLM(EngineConfig(dtype=dtype), progress=False)
    expected = _tokens(large.generate(prompts, params))
    # 8 sequences each growing to ~60 tokens (4 blocks) cannot all fit in 15 usable blocks.
    small = LLM(EngineConfig(dtype=dtype, num_kv_blocks=16, max_num_seqs=8), progress=False)
    got = _tokens(small.generate(prompts, params))
    assert got == expected
    assert small.engine.stats().num_preemptions > 0
    assert_no_leak(small.engine)


def test_shared_prefix_computes_only_uncached_tokens(llm):
    engine = llm.engine
    tok = engine.tokenizer
    words = (
        "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
        "sigma tau upsilon phi chi psi omega "
    ).split()
    prefix: list[int] = []
    i = 0
    while len(prefix) < 512:
        prefix += tok.encode(" " + words[i % len(words)] + str(i % 7))
        i += 1
    prefix = prefix[:512]
    first = prefix + tok.encode(" Summarise the list above.")
    second = prefix + tok.encode(" Which word comes after sigma?")
    params = SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)
    engine.block_manager.reset_prefix_cache()
    llm.generate(first, params)
    before = engine.stats()
    started_s = time.perf_counter()
    out_cached = _tokens(llm.generate(second, params))[0]
    wall_s = time.perf_counter() - started_s
    after = engine.stats()
    assert after.prefix_cache_hits_tokens - before.prefix_cache_hits_tokens == 512
    # The uncached prompt tail, then one token per generated token except the last (never fed back).
    assert after.num_computed_tokens - before.num_computed_tokens == (len(second) - 512) + (12 - 1)
    # 12 steps (one per token), each timed: the step seconds grow, never by more than the wall.
    assert after.num_steps - before.num_steps == 12
    assert 0 < after.step_seconds_total - before.step_seconds_total < wall_s
    assert engine.block_manager.reset_prefix_cache()
    out_uncached = _tokens(llm.generate(second, params))[0]
    assert out_cached == out_uncached
    assert_no_leak(engine)


def test_chunked_prefill_matches_single_shot(llm):
    prompt = " ".join(PROMPTS) * 3
    params = SamplingParams(max_tokens=16, ignore_eos=True, **GREEDY)
    expected = _tokens(llm.generate(prompt, params))
    chunked = LLM(
        EngineConfig(
            dtype="float32",
            num_kv_blocks=128,
            max_num_batched_tokens=32,
            enable_prefix_caching=False,
        ),
        progress=False,
    )
    assert _tokens(chunked.generate(prompt, params)) == expected


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = _tokens(llm.generate(PROMPTS[2], seeded))[0]
    others = [SamplingParams(max_tokens=10 + i, temperature=1.0, ignore_eos=True) for i in range(5)]
    mixed = llm.generate(PROMPTS[:5] + [PROMPTS[2]], others + [seeded])
    assert mixed[-1].outputs[0].token_ids == alone
    again = llm.generate([PROMPTS[7], PROMPTS[2]], [others[0], seeded])
    assert again[1].outputs[0].token_ids == alone


def test_stop_string_across_tokens_is_removed(llm):
    base = llm.generate("The capital of France is", SamplingParams(max_tokens=20, **GREEDY))[
        0
    ].outputs[0]
    text = base.text
    # A stop string straddling a token boundary: the end of one token and the start of the next.
    stop = text[3:9]
    out = llm.generate(
        "The capital of France is", SamplingParams(max_tokens=20, stop=[stop], **GREEDY)
    )[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    kept = llm.generate(
        "The capital of France is",
        SamplingParams(max_tokens=20, stop=[stop], include_stop_str_in_output=True, **GREEDY),
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    base = llm.generate(
        "1, 1, 2, 3, 5, 8,", SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)
    )[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    stop_id = base.token_ids[4]
    out = llm.generate(
        "1, 1, 2, 3, 5, 8,", SamplingParams(max_tokens=12, stop_token_ids=[stop_id], **GREEDY)
    )[0].outputs[0]
    first = base.token_ids.index(stop_id)
    assert out.token_ids == base.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_logprobs_follow_openai_semantics(llm):
    out = llm.generate(
        "The capital of France is", SamplingParams(max_tokens=6, logprobs=3, **GREEDY)
    )[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for tid, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tid
        assert len(lp.top) == 3
        assert [p for _, p in lp.top] == sorted((p for _, p in lp.top), reverse=True)
        # Greedy picks the most likely token: rank 1, equal to the best alternative.
        assert lp.rank == 1 and lp.top[0] == (tid, lp.logprob) and lp.logprob <= 0.0
        # Named where the output is decoded: each token alone, as the API shows it.
        name = lambda t: llm.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
        assert lp.token == name(tid) and lp.top_tokens == [name(t) for t, _ in lp.top]


def test_n_greater_than_one_shares_the_prompt(llm):
    prompt = "Tell me a story about a dragon"
    greedy = llm.generate(prompt, SamplingParams(n=3, max_tokens=10, ignore_eos=True, **GREEDY))[0]
    assert [c.index for c in greedy.outputs] == [0, 1, 2]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids == greedy.outputs[2].token_ids
    assert (
        greedy.outputs[0].token_ids
        == _tokens(llm.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY)))[
            0
        ]
    )
    sampled = llm.generate(
        prompt, SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    )[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    assert all(len(c.token_ids) == 16 for c in sampled.outputs)
    assert_no_leak(llm.engine)


def test_each_choice_reports_its_finish_once(llm):
    """With n > 1 the choices finish at different steps; a finished one must go quiet while the
    others run (the streaming API sends finish_reason once per choice)."""
    engine = llm.engine
    engine.add_request(
        "staggered",
        "Write a long list of fruits:",
        SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=11, stop=[","]),
    )
    deltas: dict[int, list] = {0: [], 1: [], 2: []}
    finished_at: dict[int, int] = {}
    step = 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            for d in out.deltas:
                deltas[d.index].append(d)
                if d.finish_reason is not None:
                    assert d.index not in finished_at, f"choice {d.index} finished twice"
                    finished_at[d.index] = step
    assert sorted(finished_at) == [0, 1, 2]
    assert len(set(finished_at.values())) > 1, "the choices should finish at different steps"
    for ds in deltas.values():
        assert ds[-1].finish_reason is not None and all(d.finish_reason is None for d in ds[:-1])
    assert_no_leak(engine)


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    engine.add_request(
        "to-abort", "A long story begins here and", SamplingParams(max_tokens=50, **GREEDY)
    )
    engine.step()
    engine.step()
    assert engine.stats().num_free_blocks < engine.stats().num_total_blocks
    assert engine.abort("to-abort") is True
    assert engine.abort("to-abort") is False
    assert_no_leak(engine)


def test_bad_requests_are_rejected_clearly(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e1", [], SamplingParams())
    with pytest.raises(PromptTooLongError, match="maximum context length is 8192"):
        engine.add_request("e2", [100] * 8192, SamplingParams(max_tokens=1))
    with pytest.raises(PromptTooLongError, match="max_tokens"):
        engine.add_request("e3", [100] * 10, SamplingParams(max_tokens=8190))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("e4", [1, 2, 10**9], SamplingParams())
    engine.add_request("dup", "hi", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "hi", SamplingParams(max_tokens=1))
    engine.abort("dup")
    for bad in (
        dict(max_tokens=0),
        dict(max_tokens=-3),
        dict(max_tokens=1.5),
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(n=0),
        dict(foo=1),
    ):
        with pytest.raises(ValueError):
            SamplingParams.from_dict(bad)
    assert_no_leak(engine)


def test_tokenizer_block_hashes_are_the_engines_and_each_block_is_hashed_once(llm, monkeypatch):
    """The hashes the tokenizer ships are the ones the engine registers, so the engine takes them as
    they are; with them it hashes only the blocks its output fills, each once."""
    from services.tokenizer.prompts import PromptLimits, tokenize_request
    from shared.engine import block_manager, sequence
    from shared.wire.messages import GenerateRequest

    engine = llm.engine
    bs = engine.config.block_size
    params = SamplingParams(max_tokens=2 * bs + 3, ignore_eos=True, **GREEDY)
    text = "The history of the printing press, told as a list of dates and places: " * 3
    tokenized = tokenize_request(
        GenerateRequest(request_id="t", model="m", params=params, prompt=text),
        engine.tokenizer,
        PromptLimits(max_model_len=engine.max_model_len, block_size=bs),
    )
    ids, hashes = tokenized.prompt_token_ids, tokenized.block_hashes
    assert len(hashes) == len(ids) // bs >= 3

    calls: list[int] = []
    for module in (block_manager, sequence):

        def counting_hash_block(p, t, real=module.hash_block):
            calls.append(1)
            return real(p, t)

        monkeypatch.setattr(module, "hash_block", counting_hash_block)

    def run(request_id: str, given: list[int] | None) -> tuple[list[int], list[int]]:
        engine.block_manager.reset_prefix_cache()
        calls.clear()
        engine.add_request(request_id, ids, params, block_hashes=given)
        seq = engine.requests[request_id].sequences[0]
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.deltas[0].token_ids
        registered = list(seq.block_hashes)
        assert all(engine.block_manager.cached_block_id(h) is not None for h in registered)
        return tokens, registered

    computed_tokens, computed = run("own-hashes", None)
    assert computed[: len(hashes)] == hashes  # the engine's own hashes: the tokenizer's
    num_full_blocks = (
        len(ids) + len(computed_tokens) - 1
    ) // bs  # the last token is never computed
    assert len(calls) == num_full_blocks == len(computed)  # every block hashed once
    given_tokens, given = run("given-hashes", hashes)
    assert given == computed and given_tokens == computed_tokens
    assert len(calls) == num_full_blocks - len(hashes)  # only the blocks output filled
    with pytest.raises(ValueError, match="block_hashes has 2 hashes, but the prompt's"):
        engine.add_request("bad-hashes", ids, params, block_hashes=hashes[:2])
    assert_no_leak(engine)


def test_per_request_state_stays_bounded_over_many_requests(llm):
    """A long-running engine holds nothing per finished request: the KV events are drained every
    step (at most the last step's batch is kept for the publisher), and the request, scheduler and
    block tables empty out. Short prompts on shared prefixes, so the prefix cache stores and
    evicts."""
    engine = llm.engine
    bm = engine.block_manager
    tok = engine.tokenizer
    prefixes = [
        tok.encode(
            f"Request log {i}: the server answered the client with status code and "
            f"a short body, then closed the connection"
        )
        for i in range(4)
    ]
    assert all(len(p) > bm.block_size for p in prefixes)
    params = SamplingParams(max_tokens=2, ignore_eos=True, **GREEDY)
    num_batches = 0
    for i in range(96):
        engine.add_request(f"bounded-{i}", prefixes[i % 4] + tok.encode(f" {i}"), params)
        if i % 16 == 15:  # several in flight at once
            while engine.has_unfinished():
                engine.step()
                assert bm.num_pending_events == 0
                num_batches += engine.take_kv_events() is not None
    assert num_batches > 0 and engine.take_kv_events() is None
    assert not engine.requests and not bm._seqs and not bm.take_pending_copies()
    assert_no_leak(engine)
