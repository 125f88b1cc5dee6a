import math

import pytest
import torch

from shared.engine.sampler import (
    SamplingBatch,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
    pad_token_ids,
    sample,
)
from shared.wire.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def build(params, device, vocab, prompts=None, outputs=None, gens=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params, prompts or [[]] * n, outputs or [[]] * n, gens or [None] * n, vocab, device
    )


def logits_for(probs: list[float], device) -> torch.Tensor:
    return torch.tensor(probs, device=device).log().unsqueeze(0)


def test_greedy_is_argmax_and_builds_no_tensors(device):
    logits = torch.randn(6, 100, device=device)
    batch = build([SamplingParams(temperature=0.0)] * 6, device, 100)
    assert batch.all_greedy and batch.temperatures is None and batch.penalties is None
    out = sample(logits, batch)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6
    assert (
        sample(logits.bfloat16(), batch).sampled_token_ids == logits.bfloat16().argmax(-1).tolist()
    )


def test_greedy_rows_in_a_mixed_batch_are_argmax(device):
    torch.manual_seed(0)
    logits = torch.randn(4, 50, device=device)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3),
    ]
    out = sample(logits, build(params, device, 50)).sampled_token_ids
    argmax = logits.argmax(-1).tolist()
    assert out[0] == argmax[0] and out[2] == argmax[2]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(top_k=1, temperature=5.0)],
)
def test_top_k_1_and_tiny_top_p_equal_greedy(params, device):
    torch.manual_seed(1)
    logits = torch.randn(16, 200, device=device)
    gens = [make_generator(i, device) for i in range(8)] + [None] * 8
    out = sample(logits, build([params] * 16, device, 200, gens=gens))
    assert out.sampled_token_ids == logits.argmax(-1).tolist()


def test_input_logits_are_not_modified(device):
    logits = torch.randn(3, 30, device=device)
    before = logits.clone()
    params = [SamplingParams(top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.5, logprobs=2)] * 3
    sample(logits, build(params, device, 30, prompts=[[1, 2]] * 3, outputs=[[3]] * 3))
    assert torch.equal(logits, before)


def test_top_p_keeps_the_smallest_nucleus(device):
    logits = logits_for([0.5, 0.3, 0.15, 0.05], device)
    out = apply_top_k_top_p(logits, None, torch.tensor([0.7], device=device))
    assert torch.isfinite(out[0, :2]).all() and torch.isinf(out[0, 2:]).all()
    assert torch.equal(out[0, :2], logits[0, :2])


def test_top_k_masks_all_but_k(device):
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5], [0.1, 3.0, -1.0, 2.0, 0.5]], device=device)
    out = apply_top_k_top_p(logits, torch.tensor([2, 5], device=device), None)
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, False]
    assert torch.equal(out[1], logits[1])


def test_min_p_masks_below_scaled_max(device):
    logits = logits_for([0.5, 0.3, 0.15, 0.05], device)
    out = apply_min_p(logits, torch.tensor([0.4], device=device))  # threshold 0.4 * 0.5 = 0.2
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.equal(apply_min_p(logits, torch.tensor([0.0], device=device)), logits)


def empirical(logits_row: torch.Tensor, params: SamplingParams, draws: int, device) -> torch.Tensor:
    vocab = logits_row.shape[-1]
    torch.manual_seed(1234)
    logits = logits_row.reshape(1, vocab).expand(draws, vocab).contiguous()
    ids = sample(logits, build([params] * draws, device, vocab)).sampled_token_ids
    return torch.bincount(torch.tensor(ids), minlength=vocab).double() / draws


def test_temperature_sampling_matches_softmax(device):
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3], device=device)
    freq = empirical(logits, SamplingParams(temperature=0.7), 40_000, device)
    expected = (logits.double().cpu() / 0.7).softmax(-1)
    assert torch.allclose(freq, expected, atol=0.01), (freq, expected)


def test_seeded_draws_match_softmax(device):
    logits = torch.tensor([[1.0, 0.0, -0.5, 2.0, 0.3]], device=device)
    batch = build([SamplingParams(seed=5)], device, 5, gens=[make_generator(5, device)])
    ids = [sample(logits, batch).sampled_token_ids[0] for _ in range(20_000)]
    freq = torch.bincount(torch.tensor(ids), minlength=5).double() / len(ids)
    assert torch.allclose(freq, logits[0].double().cpu().softmax(-1), atol=0.015)


def test_min_p_and_top_k_sampling_renormalise(device):
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05], device=device).log()
    freq = empirical(logits, SamplingParams(min_p=0.4), 20_000, device)
    assert freq[2] == 0 and freq[3] == 0
    assert abs(freq[0].item() - 0.5 / 0.8) < 0.015
    freq = empirical(logits, SamplingParams(top_k=3), 20_000, device)
    assert freq[3] == 0 and abs(freq[2].item() - 0.15 / 0.95) < 0.015


def test_penalties_against_hand_computed_logits(device):
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]] * 2, device=device)
    pad = 6
    prompt = pad_token_ids([[0, 1], [0, 1]], pad, device)
    output = pad_token_ids([[2, 2, 3], []], pad, device)
    f = lambda *v: torch.tensor(v, device=device)  # noqa: E731
    out = apply_penalties(logits, prompt, output, f(2.0, 1.0), f(0.5, 0.0), f(0.25, 0.0))
    # row 0: seen {0,1,2,3}: 2/2, -1*2, 0.5/2 - 2*0.25 - 0.5, -0.5*2 - 0.25 - 0.5; 4, 5 untouched.
    expected = torch.tensor(
        [[1.0, -2.0, -0.75, -1.75, 3.0, 1.0], [2.0, -1.0, 0.5, -0.5, 3.0, 1.0]], device=device
    )
    assert torch.allclose(out, expected)


def test_penalties_change_greedy_choice_through_the_batch(device):
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0]] * 3, device=device)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0, frequency_penalty=2.0),
        SamplingParams(temperature=0.0),
    ]
    batch = build(params, device, 4, prompts=[[0], [0], [0]], outputs=[[1], [0], [0]])
    # only rows with a repetition penalty carry prompt ids; rows with no penalty carry nothing
    assert batch.penalties is not None
    assert batch.penalties.prompt_token_ids.tolist() == [[0], [4], [4]]
    assert batch.penalties.output_token_ids.tolist() == [[1], [0], [4]]
    assert sample(logits, batch).sampled_token_ids == [2, 1, 0]


def seeded_run(
    device,
    target: SamplingParams,
    vocab: int,
    steps: int,
    row: int,
    others: list[SamplingParams],
    other_seeds: list[int | None],
    global_seed: int,
) -> list[int]:
    """Tokens of one seeded request placed at `row` among `others`, over `steps` decode steps."""
    params = others[:row] + [target] + others[row:]
    seeds = other_seeds[:row] + [1234] + other_seeds[row:]
    gens = [make_generator(s, device) for s in seeds]
    data_gen = torch.Generator().manual_seed(99)  # same target logits in every run
    torch.manual_seed(global_seed)
    tokens = []
    for _ in range(steps):
        target_logits = torch.randn(vocab, generator=data_gen)
        logits = torch.randn(len(params), vocab)
        logits[row] = target_logits
        batch = build(params, device, vocab, gens=gens)
        tokens.append(sample(logits.to(device), batch).sampled_token_ids[row])
    return tokens


@pytest.mark.parametrize(
    "target",
    [SamplingParams(seed=1234), SamplingParams(seed=1234, temperature=0.9, top_k=40, top_p=0.95)],
)
def test_seeded_request_is_independent_of_batch_and_row(target, device):
    vocab, steps = 64, 12
    alone = seeded_run(device, target, vocab, steps, 0, [], [], global_seed=0)
    others = [
        SamplingParams(),
        SamplingParams(seed=7),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.5, min_p=0.1, repetition_penalty=1.3),
    ]
    row0 = seeded_run(device, target, vocab, steps, 0, others, [None, 7, None, None], global_seed=1)
    row3 = seeded_run(device, target, vocab, steps, 3, others, [None, 7, 3, 11], global_seed=2)
    assert alone == row0 == row3
    assert len(set(alone)) > 1  # it really sampled


def test_unseeded_rows_follow_the_global_rng(device):
    logits = torch.zeros(8, 1000, device=device)
    batch = build([SamplingParams()] * 8, device, 1000)
    torch.manual_seed(3)
    a = sample(logits, batch).sampled_token_ids
    torch.manual_seed(3)
    assert sample(logits, batch).sampled_token_ids == a
    assert sample(logits, batch).sampled_token_ids != a


def test_logprobs_come_from_raw_logits(device):
    torch.manual_seed(4)
    logits = torch.randn(4, 40, device=device)
    params = [
        SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5),
        SamplingParams(logprobs=0, temperature=0.0),
        SamplingParams(),
        SamplingParams(logprobs=20, top_k=10, presence_penalty=1.0),
    ]
    batch = build(params, device, 40, prompts=[[1, 2, 3]] * 4, outputs=[[4, 5]] * 4)
    out = sample(logits, batch)
    raw = torch.log_softmax(logits.float(), -1).cpu()
    assert out.logprobs[2] is None
    for i, n in [(0, 5), (1, 0), (3, 20)]:
        lp = out.logprobs[i]
        assert lp is not None
        tok = out.sampled_token_ids[i]
        assert lp.token_id == tok
        assert math.isclose(lp.logprob, raw[i, tok].item(), rel_tol=1e-6, abs_tol=1e-6)
        assert lp.rank == int((raw[i] > raw[i, tok]).sum()) + 1
        assert len(lp.top) == n
        vals, ids = raw[i].sort(descending=True)
        assert [t for t, _ in lp.top] == ids[:n].tolist()
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), vals[:n])
    assert out.logprobs[1] is not None and out.logprobs[1].rank == 1  # greedy picks the top token


def test_shape_mismatch_is_rejected(device):
    batch = build([SamplingParams()] * 2, device, 10)
    with pytest.raises(ValueError, match="vocab_size"):
        sample(torch.zeros(2, 11, device=device), batch)


def test_make_generator():
    assert make_generator(None, "cpu") is None
    a, b = make_generator(42, "cpu"), make_generator(42, "cpu")
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
