"""The fp8 KV cache (kv_cache_dtype="fp8", e4m3 with a scale per row): the row format and its error
bounds, the kernels that write and read it against the torch reference at every level, the model
and the engine on it (batch invariance on the tiny random Llama and SmolLM2, prefix caching,
preemption, the kernels off and capped at AVX2), SmolLM2's quality on it, and its bytes."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers.greedy import (
    all_position_logits,
    assert_quantized_cache_paths_close,
    make_runner,
    torch_path,
)
from helpers.levels import LEVELS, best_ops, capped_at
from helpers.paged import BLOCK_SIZES, SHAPES, scattered_tables
from helpers.tiny_llama import TINY_VOCAB, save_tiny_llama
from shared.engine.kv_cache import FP8_MAX, KVCache, dequantize_kv_fp8, quantize_kv_fp8
from shared.engine.memory import kv_bytes_per_token
from shared.engine.models.known_configs import KNOWN_CONFIGS
from shared.engine.models.teacher_forcing import perplexity

DTYPES = [torch.float32, torch.bfloat16]


def test_quantize_kv_fp8_row_layout_is_exact():
    """e4m3 bytes of x * 448 / max|x|, then the fp32 scale max|x| / 448 as 4 bytes."""
    x = torch.tensor([[[1.0, -0.5, 0.0, 4.0], [0.0, 0.0, 0.0, 0.0], [-2.0, 0.3, 0.0, 1e-9]]])
    rows = quantize_kv_fp8(x)
    assert rows.dtype == torch.uint8 and rows.shape == (1, 3, 8)
    # row 0: scale 4 / 448, values 112 = 2^6 x 1.75 (exponent 6 + 7, mantissa 6), -56, 0 and
    # 448 (0x7E: e4m3's largest finite value; 0x7F is NaN)
    assert rows[0, 0, :4].tolist() == [0x6E, 0xE6, 0x00, 0x7E]
    assert rows[0, 1, :4].tolist() == [0, 0, 0, 0]
    # row 2: -448 exactly; 0.3 * 224 = 67.2 rounds to 64 (steps of 8 in [64, 128)); 1e-9 x 224 is
    # below half the smallest subnormal (2^-9): 0
    assert rows[0, 2, :4].tolist() == [0xFE, 0x68, 0x00, 0x00]
    scales = rows[..., 4:].contiguous().view(torch.float32).flatten()
    assert torch.equal(scales, torch.tensor([4.0, 0.0, 2.0]) / 448)
    back = dequantize_kv_fp8(rows, torch.float32)[0]
    assert torch.equal(back[0], torch.tensor([1.0, -0.5, 0.0, 4.0]))
    assert torch.equal(back[1], torch.zeros(4))
    assert torch.equal(back[2], torch.tensor([-2.0, 64 * (2.0 / 448), 0.0, 0.0]))


def test_dequantized_fp8_rows_are_within_half_an_e4m3_step():
    """Relative error at most 2^-4 (3 mantissa bits, round to nearest) where the scaled element is
    an e4m3 normal (>= 2^-6); below it, at most half the subnormal step (2^-10 of the scale)."""
    x = (
        torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0))
        * torch.logspace(-3, 3, 50)[:, None, None]
    )
    back = dequantize_kv_fp8(quantize_kv_fp8(x), torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / FP8_MAX
    err = (back - x).abs()
    normal = x.abs() / scale >= 2**-6
    assert (err[normal] <= x.abs()[normal] * 2**-4 * (1 + 1e-5)).all()
    assert (err[~normal] <= (scale * 2**-10 * (1 + 1e-5)).expand_as(x)[~normal]).all()
    # every row's largest element maps to 448 (byte 0x7E / 0xFE) and survives exactly
    largest = quantize_kv_fp8(x)[..., :64].gather(-1, x.abs().argmax(-1, keepdim=True))
    assert set(largest.flatten().tolist()) <= {0x7E, 0xFE}


def test_fp8_saturates_and_never_writes_nan():
    """Values are clamped to +-448 before the cast (torch's float8 cast of an out-of-range value
    has not saturated in every version), so no byte is a NaN (0x7F / 0xFF) whatever the row's
    magnitude."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 2, 128, generator=g) * torch.logspace(-30, 30, 64)[:, None, None]
    x[0, 0, :] = 3.0e38  # a row of near-fp32-max values
    rows = quantize_kv_fp8(x)[..., :128]
    assert not ((rows & 0x7F) == 0x7F).any()
    back = dequantize_kv_fp8(quantize_kv_fp8(x), torch.float32)
    assert torch.isfinite(back).all()
    assert torch.allclose(back[0, 0], x[0, 0], rtol=2**-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_cache_writes_fp8_bit_for_bit_like_the_reference(ops, dtype):
    heads, kv_heads, d = 6, 2, 64
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    qkv[2, heads * d : (heads + 1) * d] = 0  # an all-zero K row: scale 0
    qkv[3, (heads + kv_heads) * d :] *= 1e4  # large values: the scale, not the bytes, grows
    positions, slots = torch.tensor([0, 3, 4, 17, 30]), torch.tensor([5, 6, 7, 20, 33])
    freqs = torch.outer(
        torch.arange(64).float(), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    )
    k_cache = torch.zeros(9, 4, kv_heads, d + 4, dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    ops.rope_and_cache(
        qkv, positions, freqs.cos(), freqs.sin(), k_cache, v_cache, slots, heads, kv_heads, d
    )
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(5, kv_heads, d)  # rotated in place
    v = qkv[:, (heads + kv_heads) * d :].view(5, kv_heads, d)
    flat_k, flat_v = k_cache.view(-1, kv_heads, d + 4), v_cache.view(-1, kv_heads, d + 4)
    assert torch.equal(flat_k[slots], quantize_kv_fp8(k))
    assert torch.equal(flat_v[slots], quantize_kv_fp8(v))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def _fp8_caches(num_blocks, block_size, kv_heads, d, dtype, g):
    return [
        quantize_kv_fp8(torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype))
        for _ in range(2)
    ]


def _gathered(cache, table, n, kv_heads, group, dtype):
    """[heads, n, d] of one sequence, dequantized to ``dtype`` then fp32, KV heads repeated per
    group."""
    rows = cache[torch.tensor(table)].reshape(-1, kv_heads, cache.shape[-1])[:n]
    return dequantize_kv_fp8(rows, dtype).float().transpose(0, 1).repeat_interleave(group, 0)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_reads_fp8_blocks(ops, dtype, heads, kv_heads, d, block_size):
    """Against SDPA over the dequantized cache, with the int8 cache's bounds: the kernel widens the
    e4m3 bytes exactly and sums in fp32 (fp32 within 1e-4, bf16 within a bf16 rounding)."""
    g = torch.Generator().manual_seed(3)
    seq_lens = [1, 16, 17, 100, 1000]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 4
    k_cache, v_cache = _fp8_caches(num_blocks, block_size, kv_heads, d, dtype, g)
    tables, block_tables = scattered_tables(seq_lens, num_blocks, block_size, g)
    q = torch.randn(len(seq_lens), heads * d, generator=g).to(dtype)
    out = ops.decode_attention(
        q, k_cache, v_cache, block_tables, torch.tensor(seq_lens), heads, 1 / math.sqrt(d)
    )
    tol: dict[str, Any] = (
        dict(atol=1e-4, rtol=1e-3) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    )
    for s, n in enumerate(seq_lens):
        keys = _gathered(k_cache, tables[s], n, kv_heads, heads // kv_heads, torch.float32)
        values = _gathered(v_cache, tables[s], n, kv_heads, heads // kv_heads, torch.float32)
        expected = F.scaled_dot_product_attention(
            q[s].float().view(heads, 1, d), keys, values
        ).reshape(-1)
        torch.testing.assert_close(out[s].float(), expected, **tol)
        alone = ops.decode_attention(
            q[s : s + 1],
            k_cache,
            v_cache,
            block_tables[s : s + 1],
            torch.tensor([n]),
            heads,
            1 / math.sqrt(d),
        )
        torch.testing.assert_close(alone[0].float(), expected, **tol)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_reads_fp8_blocks(ops, dtype, heads, kv_heads, d, block_size):
    """A fresh prompt, a chunk over 37 cached tokens and a one-token chunk, against causal SDPA over
    the cache dequantized to the model dtype (what the kernel reads)."""
    g = torch.Generator().manual_seed(6)
    k_cache, v_cache = _fp8_caches(30, block_size, kv_heads, d, dtype, g)
    seq_lens, q_lens = [70, 57, 5], [70, 20, 1]
    tables, block_tables = scattered_tables(seq_lens, 30, block_size, g)
    starts = torch.tensor([0, 70, 90, 91])
    q = torch.randn(91, heads * d, generator=g).to(dtype)
    out = ops.prefill_attention(
        q, k_cache, v_cache, block_tables, starts, torch.tensor(seq_lens), heads, 1 / math.sqrt(d)
    )
    for s, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        keys = _gathered(k_cache, tables[s], n, kv_heads, heads // kv_heads, dtype)
        values = _gathered(v_cache, tables[s], n, kv_heads, heads // kv_heads, dtype)
        qs = q[starts[s] : starts[s + 1]].float().view(ql, heads, d).transpose(0, 1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - ql, n)[:, None]
        expected = (
            F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask)
            .transpose(0, 1)
            .reshape(ql, -1)
        )
        torch.testing.assert_close(
            out[starts[s] : starts[s + 1]].float(),
            expected,
            atol=1e-5 if dtype == torch.float32 else 1e-2,
            rtol=1e-2,
        )


def test_kernels_refuse_malformed_fp8_caches(ops):
    q, lens, table = torch.zeros(1, 64), torch.tensor([3]), torch.tensor([[1]])
    no_scale = torch.zeros(4, 16, 1, 64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"cache rows must be \[kv_heads, head_dim \+ 4\]"):
        ops.rope_and_cache(
            torch.zeros(1, 3 * 64),
            torch.tensor([0]),
            torch.ones(4, 32),
            torch.ones(4, 32),
            no_scale,
            no_scale.clone(),
            torch.tensor([0]),
            1,
            1,
            64,
        )
    fp8, int8 = (torch.zeros(4, 16, 1, 68, dtype=t) for t in (torch.uint8, torch.int8))
    with pytest.raises(RuntimeError, match="caches must be alike"):
        ops.prefill_attention(q, fp8, int8, table, torch.tensor([0, 1]), lens, 1, 1.0)


# ---- the model on an fp8 cache -------------------------------------------------------------------


def test_fused_forward_on_fp8_cache_matches_the_torch_path(runtime_fp32, runtime_bf16):
    """The kernels (quantizing writes, fp8 attention) against the torch reference (quantize_kv_fp8
    on write, dequantize on read) in mixed prefill + decode batches
    (assert_quantized_cache_paths_close). Measured over the pooled batches in fp32: fused vs torch
    0.122/1.28, fp8 vs fp32 cache 0.253/2.53; over 16 batches, sets of six read 0.41-0.65 of
    quantizing's mean and 0.45-0.75 of its largest."""
    best_ops()
    assert_quantized_cache_paths_close(runtime_fp32, runtime_bf16, "fp8")


def test_fp8_cache_quality_against_bf16_and_int8(runtime_fp32, runtime_bf16, smollm2_tokenizer):
    """Teacher-forced over ~1,000 tokens of the engine's docstrings, against fp32 with an fp32
    cache. e4m3 keeps 3 mantissa bits where an int8 row keeps ~7 near its largest element, so
    top-1 agreement is held to a looser bound than int8's 0.95 (measured 0.951, perplexity +0.2%
    over bf16's; bench_quality has the figures over 1,500 tokens)."""
    from loadtests.workloads import corpus_text

    ids = smollm2_tokenizer.encode(corpus_text())[:1000]
    ref = all_position_logits(runtime_fp32, ids)
    plain = all_position_logits(runtime_bf16, ids)
    fp8 = all_position_logits(runtime_bf16, ids, kv_cache_dtype="fp8")
    agree_fp8 = (fp8.argmax(-1) == ref.argmax(-1)).float().mean().item()
    ppl_plain, ppl_fp8 = perplexity(plain, ids), perplexity(fp8, ids)
    print(f"top-1 agreement fp8 KV {agree_fp8:.3f}; perplexity {ppl_plain:.3f} / {ppl_fp8:.3f}")
    assert agree_fp8 >= 0.93
    assert ppl_fp8 <= 1.02 * ppl_plain


def test_torch_path_fp8_runner_never_writes_block_zero(runtime_bf16):
    from shared.engine.model_runner import ScheduledChunk

    with torch_path(runtime_bf16):
        runner = make_runner(runtime_bf16, 8, kv_cache_dtype="fp8")
        runner.execute([ScheduledChunk(list(range(10, 40)), 0, [3, 5])])
    storage = runner.kv_cache.storage
    assert storage.dtype == torch.uint8
    assert not storage[:, :, 0].any() and storage[:, :, 3].any() and storage[:, :, 5, :14].any()


# ---- the engine on an fp8 cache ------------------------------------------------------------------


def _greedy(llm, prompts, max_tokens=24):
    from shared.wire.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colours:",
]


@pytest.fixture(scope="module")
def llm_fp8(smollm2_path):
    from shared.engine.config import EngineConfig
    from shared.engine.llm import LLM

    config = EngineConfig(
        model=smollm2_path,
        kv_cache_dtype="fp8",
        memory_budget="512MiB",
        max_num_batched_tokens=256,
    )
    return LLM(config, progress=False)


def test_fp8_cache_engine_is_batch_invariant(llm_fp8):
    assert _greedy(llm_fp8, PROMPTS) == [_greedy(llm_fp8, [p])[0] for p in PROMPTS]
    stats = llm_fp8.engine.stats()
    assert (
        stats.num_running == stats.num_waiting == 0
        and stats.num_free_blocks == stats.num_total_blocks
    )


def test_fp8_cache_prefix_hit_gives_the_same_tokens(llm_fp8):
    engine = llm_fp8.engine
    prefix = engine.tokenizer.encode(" ".join(f"item {i}: {i * i}" for i in range(60)))[:256]
    first, second = (
        prefix + engine.tokenizer.encode(" The last item"),
        prefix + engine.tokenizer.encode(" Sum them"),
    )
    engine.block_manager.reset_prefix_cache()
    _greedy(llm_fp8, [first], 8)
    before = engine.stats()
    cached = _greedy(llm_fp8, [second], 8)[0]
    after = engine.stats()
    assert after.prefix_cache_hits_tokens - before.prefix_cache_hits_tokens == 256
    assert engine.block_manager.reset_prefix_cache()
    assert _greedy(llm_fp8, [second], 8)[0] == cached


def test_fp8_cache_survives_preemption(llm_fp8, smollm2_path):
    from shared.engine.config import EngineConfig
    from shared.engine.llm import LLM

    expected = _greedy(llm_fp8, PROMPTS, 40)
    small = LLM(
        EngineConfig(model=smollm2_path, kv_cache_dtype="fp8", num_kv_blocks=9, max_num_seqs=4),
        progress=False,
    )
    assert _greedy(small, PROMPTS, 40) == expected
    stats = small.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == stats.num_total_blocks


def test_fp8_cache_takes_int8_bytes(llm_fp8):
    """Per token: 2 x 30 layers x 3 KV heads x (64 e4m3 bytes + a 4-byte scale) = 12,240 B, as
    int8's; the ledger and the allocated pool agree."""
    config = KNOWN_CONFIGS["smollm2-135m"]
    assert kv_bytes_per_token(config, "fp8") == kv_bytes_per_token(config, "int8") == 12240
    cache = llm_fp8.engine.kv_cache
    assert cache.storage.dtype == torch.uint8
    assert cache.num_bytes == cache.num_blocks * 16 * 12240
    tiny = KVCache(config, 4, 16, torch.bfloat16, kv_cache_dtype="fp8")
    assert tiny.storage.shape[-1] == 68 and tiny.num_bytes == 4 * 16 * 12240


@pytest.fixture(scope="module")
def tiny64_dir(tmp_path_factory) -> str:
    """The tiny random Llama with head_dim 64: the kernels' attention runs on it."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny64"), seed=3, hidden_size=256)


@pytest.mark.parametrize("path", ["kernels", "torch", "avx2"])
def test_tiny_llama_fp8_engine_is_batch_invariant(tiny64_dir, path, monkeypatch):
    """On the kernels (the best level), with the kernels capped at AVX2 (bf16: each kernel computes
    a row the same way whatever the batch) and on the torch path (fp32: torch's padded SDPA rounds
    with the batch's longest sequence, far below a near tie in fp32 but not in bf16): concurrent
    greedy requests equal each alone, to the token, over chunked prefill."""
    import random

    from kernels.cpu import KERNELS_ENV, cpu_ops
    from shared.engine.config import EngineConfig
    from shared.engine.llm import LLM

    def run() -> None:
        llm = LLM(
            EngineConfig(
                model=tiny64_dir,
                dtype="float32" if path == "torch" else "bfloat16",
                kv_cache_dtype="fp8",
                num_kv_blocks=64,
                block_size=4,
                max_num_batched_tokens=32,
            ),
            progress=False,
        )
        backend = llm.engine.backend
        assert backend.enabled == (path != "torch"), backend.reason
        assert backend.level == {"torch": None, "avx2": "avx2"}.get(path, LEVELS[-1])
        rng = random.Random(1)
        prompts = [[0] + [rng.randrange(2, TINY_VOCAB) for _ in range(n)] for n in (5, 40, 70)]
        assert _greedy(llm, prompts) == [_greedy(llm, [p])[0] for p in prompts]

    if path == "torch":
        monkeypatch.setenv(KERNELS_ENV, "0")
        cpu_ops.cache_clear()
        try:
            run()
        finally:
            monkeypatch.undo()
            cpu_ops.cache_clear()
    elif path == "avx2":
        if "avx2" not in LEVELS:
            pytest.skip("this CPU has no AVX2 kernel level")
        with capped_at("avx2"):
            run()
    else:
        best_ops()
        run()
