"""Speculative decoding in the engine: the output is the output decoding without it gives (greedy
and seeded: token for token; unseeded: in distribution), under batching, chunked prefill,
preemption and prefix caching, and it leaves no state between steps."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest

from helpers.tiny_llama import TINY_VOCAB, save_tiny_llama
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.llm import LLM
from shared.engine.speculative.speculator import Speculator
from shared.wire.outputs import EngineStats
from shared.wire.sampling_params import SamplingParams

CONTEXT = 1024


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    # head_dim 64: attention runs on the CPU kernels where they are built.
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-spec"), seed=7, context=CONTEXT, hidden_size=256
    )


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, TINY_VOCAB) for _ in range(n)]


def repetitive_prompt(n: int, period: int, seed: int) -> list[int]:
    unit = random_prompt(period, seed)
    return (unit * (n // period + 1))[:n]


# Several lengths (chunked under the 64-token budget), a shared 48-token prefix (prefix cache
# hits), and repetition for the n-gram lookup to find.
SHARED = random_prompt(48, 100)
PROMPTS = [
    repetitive_prompt(150, 7, 1),
    random_prompt(90, 2),
    SHARED + random_prompt(20, 3),
    SHARED + repetitive_prompt(40, 5, 4),
    repetitive_prompt(30, 3, 5),
    random_prompt(12, 6),
]


def llm(model_path: str, **settings) -> LLM:
    config: dict[str, Any] = dict(
        model=model_path,
        dtype="bfloat16",
        num_threads=1,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=64,
        memory_budget="64MiB",
        speculative_max_num_seqs=64,
    )
    return LLM(EngineConfig(**(config | settings)), progress=False)


def generate(model: LLM, params: SamplingParams | list[SamplingParams], prompts=PROMPTS):
    results = model.generate(prompts, params)
    return [[(o.token_ids, o.logprobs) for o in r.outputs] for r in results]


GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("num_tokens", [2, 5, 8])
def test_greedy_output_is_unchanged_under_batching(model_path, method, num_tokens):
    reference = generate(llm(model_path), GREEDY)
    spec = llm(model_path, speculative=method, num_speculative_tokens=num_tokens)
    assert generate(spec, GREEDY) == reference
    stats = spec.engine.stats()
    assert stats.spec_num_draft_tokens > 0
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert stats.prefix_cache_hits_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_output_is_unchanged_under_preemption(model_path, method):
    # 14 blocks of 16 tokens cannot hold the six sequences at once: some are preempted and
    # recomputed, with and without speculation.
    settings = dict(num_kv_blocks=15)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [p[:40] for p in PROMPTS]
    plain = llm(model_path, **settings)
    reference = generate(plain, params, prompts)
    spec = llm(model_path, speculative=method, num_speculative_tokens=4, **settings)
    assert generate(spec, params, prompts) == reference
    assert plain.engine.stats().num_preemptions > 0
    assert spec.engine.stats().num_preemptions > 0
    assert spec.engine.stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampling_is_unchanged(model_path, method):
    # Every token is drawn from its own position's distribution with the sequence's own generator,
    # penalties over the tokens before it and logprobs of its row: all of it equal.
    params = [
        SamplingParams(
            temperature=0.7,
            top_k=20,
            top_p=0.9,
            seed=11 + i,
            max_tokens=32,
            ignore_eos=True,
            repetition_penalty=1.1,
            frequency_penalty=0.2,
            logprobs=2,
            n=2,
        )
        for i in range(len(PROMPTS))
    ]
    reference = generate(llm(model_path), params)
    spec = llm(model_path, speculative=method, num_speculative_tokens=4)
    assert generate(spec, params) == reference
    assert spec.engine.stats().spec_num_draft_tokens > 0


def _joint_counts(model: LLM, prompt: list[int], num_samples: int) -> Counter:
    params = SamplingParams(temperature=0.5, top_k=3, max_tokens=4, ignore_eos=True)
    results = model.generate([prompt] * num_samples, params)
    return Counter(tuple(r.outputs[0].token_ids) for r in results)


def _chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's statistic for two samples from one distribution, and its degrees of freedom."""
    n_a, n_b = sum(a.values()), sum(b.values())
    stat = 0.0
    for key in set(a) | set(b):
        total = a[key] + b[key]
        for count, n in ((a[key], n_a), (b[key], n_b)):
            expected = total * n / (n_a + n_b)
            stat += (count - expected) ** 2 / expected
    return stat, len(set(a) | set(b)) - 1


def _chi_square_999(df: int) -> float:
    """Chi-square's 0.999 quantile (Wilson-Hilferty; within 1% from 10 degrees of freedom)."""
    z = 3.090  # the standard normal's 0.999 quantile
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


class _ModeProposer:
    """Proposes, after each output prefix, the continuation seen most often after it in a sample:
    a strong draft (as a good draft model is), so most proposals are accepted."""

    def __init__(self, sample: Counter) -> None:
        after: dict[tuple[int, ...], Counter] = {}
        for tokens, count in sample.items():
            for i in range(len(tokens)):
                after.setdefault(tokens[:i], Counter())[tokens[i]] += count
        self.mode = {prefix: c.most_common(1)[0][0] for prefix, c in after.items()}

    def plan(self, seq, max_tokens: int) -> int:
        return max_tokens

    def propose(self, seqs) -> None:
        for seq in seqs:
            prefix = tuple(seq.output_token_ids)
            seq.draft_token_ids = []
            while len(seq.draft_token_ids) < seq.num_lookahead and prefix in self.mode:
                seq.draft_token_ids.append(self.mode[prefix])
                prefix += (self.mode[prefix],)


def test_unseeded_sampling_keeps_the_distribution(model_path, monkeypatch):
    """Four tokens sampled 1,500 times with and without speculation (proposals from a strong
    draft, most of them accepted): the joint distributions agree by a chi-square test, and the
    same test tells a verifier that keeps every proposal from the real one."""
    import torch

    torch.manual_seed(0)  # the unseeded draws: the test is deterministic
    prompt = repetitive_prompt(40, 4, 9)
    n = 1500
    plain = _joint_counts(llm(model_path, max_num_seqs=256), prompt, n)

    def speculative_sample() -> tuple[Counter, EngineStats]:
        model = llm(
            model_path,
            max_num_seqs=256,
            speculative="ngram",
            num_speculative_tokens=3,
            speculative_max_num_seqs=256,
        )
        assert model.engine.speculator is not None
        model.engine.speculator.proposer = _ModeProposer(plain)
        return _joint_counts(model, prompt, n), model.engine.stats()

    counts, stats = speculative_sample()
    assert stats.spec_num_accepted_tokens > 0.3 * stats.spec_num_draft_tokens > 0
    stat, df = _chi_square(plain, counts)
    assert stat < _chi_square_999(df), (stat, df)

    def keep_every_proposal(self, logits, drafted, sample):
        for seq, row in drafted:
            for i, token in enumerate(seq.draft_token_ids):
                if seq.finish_reason is not None:
                    break
                seq.token_ids[-1] = token  # the proposal replaces what was sampled
                seq.num_computed_tokens += 1
                sample([seq], [row + i + 1])

    monkeypatch.setattr(Speculator, "verify", keep_every_proposal)
    stat, df = _chi_square(plain, speculative_sample()[0])
    assert stat > _chi_square_999(df), (stat, df)


def _step_all(engine: Engine) -> None:
    """Step to the end, checking the between-steps state after each step."""
    bm = engine.block_manager
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running + engine.scheduler.waiting:
            assert seq.draft_token_ids == [] and seq.num_lookahead == 0
            in_flight = seq is engine.scheduler.layered and engine.scheduler.in_flight
            if seq.seq_id in bm and not in_flight:  # (a long prefill's chunk holds its slots)
                assert bm.num_reserved_tokens(seq.seq_id) == seq.num_computed_tokens


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_between_steps_no_proposal_or_slot_is_left(model_path, method):
    engine = llm(model_path, speculative=method, num_speculative_tokens=6).engine
    free = engine.block_manager.num_free_blocks
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    _step_all(engine)
    assert engine.stats().spec_num_accepted_tokens > 0
    assert engine.block_manager.num_free_blocks == free


def test_opted_out_requests_and_large_batches_do_not_speculate(model_path):
    engine = llm(
        model_path, speculative="draft", num_speculative_tokens=3, speculative_max_num_seqs=2
    ).engine
    opted_out = SamplingParams(temperature=0.0, max_tokens=20, speculative=False)
    engine.add_request("a", PROMPTS[0], opted_out)
    engine.add_request("b", PROMPTS[1], opted_out)
    _step_all(engine)
    assert engine.stats().spec_num_drafts == 0
    # Three short prompts prefill in one step, then decode together (above the cutoff of two)
    # until they all finish in the same step.
    for i in range(3):
        engine.add_request(f"c{i}", random_prompt(10, 20 + i), GREEDY)
    _step_all(engine)
    assert engine.stats().spec_num_drafts == 0
    engine.add_request("d", PROMPTS[2], GREEDY)
    _step_all(engine)
    assert engine.stats().spec_num_drafts > 0


def test_settings_from_the_command_line_and_bad_values(model_path):
    config = EngineConfig.from_argv(
        [
            "--speculative",
            "draft",
            "--num-speculative-tokens",
            "3",
            "--speculative-draft-layers",
            "1",
            "--speculative-max-num-seqs",
            "2",
        ]
    )
    assert (config.speculative, config.num_speculative_tokens) == ("draft", 3)
    assert (config.speculative_draft_layers, config.speculative_max_num_seqs) == (1, 2)
    with pytest.raises(ValueError, match="speculative must be None or one of"):
        EngineConfig(speculative="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens must be > 0"):
        EngineConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="the model has 2, so choose 1 to 2"):
        llm(model_path, speculative="draft", speculative_draft_layers=3)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_default_model_greedy_output_is_unchanged(method):
    """SmolLM2 in bf16 on the reference prompts: the same tokens with and without speculation
    (the reference: the same engine's requests opted out)."""
    prompts = [
        "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
        "The capital of France is",
    ]
    model = LLM(
        progress=False,
        speculative=method,
        num_speculative_tokens=4,
        num_threads=2,
        memory_budget="1GiB",
    )

    def tokens(speculative: bool) -> list[list[int]]:
        params = SamplingParams(
            temperature=0.0, max_tokens=40, ignore_eos=True, speculative=speculative
        )
        return [r.outputs[0].token_ids for r in model.generate(prompts, params)]

    reference = tokens(False)
    assert model.engine.stats().spec_num_drafts == 0
    assert tokens(True) == reference
    assert model.engine.stats().spec_num_draft_tokens > 0
    assert model.engine.stats().spec_num_accepted_tokens > 0
