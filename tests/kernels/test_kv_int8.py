"""The int8 KV cache (kv_cache_dtype="int8"): the row format, the kernels that write and read it
against the torch reference, the model and the engine on it (batch invariance, prefix caching,
preemption), SmolLM2's quality on it, and the memory it saves."""

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
from helpers.levels import best_ops
from helpers.paged import BLOCK_SIZES, SHAPES, scattered_tables
from shared.engine.kv_cache import KVCache, dequantize_kv, quantize_kv
from shared.engine.memory import kv_bytes_per_token
from shared.engine.models.known_configs import KNOWN_CONFIGS
from shared.engine.models.teacher_forcing import perplexity

DTYPES = [torch.float32, torch.bfloat16]


def test_quantize_kv_scales_each_row_by_its_largest_element():
    x = torch.tensor([[[0.5, -1.0, 0.25, 127.0], [0.0, 0.0, 0.0, 0.0], [-2.0, 1.0, 0.0, 0.0]]])
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (1, 3, 8)
    assert rows[..., :4].tolist() == [
        [[0, -1, 0, 127], [0, 0, 0, 0], [-127, 64, 0, 0]]
    ]  # 63.5 -> 64 (half to even)
    scales = rows[..., 4:].contiguous().view(torch.float32).flatten()
    assert torch.equal(scales, torch.tensor([127.0, 0.0, 2.0]) / 127)
    assert torch.equal(
        dequantize_kv(rows, torch.float32)[0, 2], torch.tensor([-2.0, 2 * 64 / 127, 0.0, 0.0])
    )


def test_dequantized_rows_are_within_half_a_step():
    x = (
        torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0))
        * torch.logspace(-3, 3, 50)[:, None, None]
    )
    back = dequantize_kv(quantize_kv(x), torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 * (1 + 1e-5)).all()
    assert torch.equal(
        quantize_kv(x.bfloat16())[..., :64].abs().amax(-1),
        torch.full((50, 3), 127, dtype=torch.int8),
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_cache_quantizes_bit_for_bit_like_the_reference(ops, dtype):
    heads, kv_heads, d = 6, 2, 64
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    qkv[2, heads * d : (heads + 1) * d] = 0  # an all-zero K row: scale 0
    positions, slots = torch.tensor([0, 3, 4, 17, 30]), torch.tensor([5, 6, 7, 20, 33])
    freqs = torch.outer(
        torch.arange(64).float(), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    )
    k_cache = torch.zeros(9, 4, kv_heads, d + 4, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    ops.rope_and_cache(
        qkv, positions, freqs.cos(), freqs.sin(), k_cache, v_cache, slots, heads, kv_heads, d
    )
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(5, kv_heads, d)  # rotated in place
    v = qkv[:, (heads + kv_heads) * d :].view(5, kv_heads, d)
    flat_k, flat_v = k_cache.view(-1, kv_heads, d + 4), v_cache.view(-1, kv_heads, d + 4)
    assert torch.equal(flat_k[slots], quantize_kv(k)) and torch.equal(flat_v[slots], quantize_kv(v))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def _int8_caches(num_blocks, block_size, kv_heads, d, dtype, g):
    return [
        quantize_kv(torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype))
        for _ in range(2)
    ]


def _gathered(cache, table, n, kv_heads, group, dtype):
    """[heads, n, d] of one sequence, dequantized to ``dtype`` then fp32, KV heads repeated per
    group."""
    rows = cache[torch.tensor(table)].reshape(-1, kv_heads, cache.shape[-1])[:n]
    return dequantize_kv(rows, dtype).float().transpose(0, 1).repeat_interleave(group, 0)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_reads_int8_blocks(ops, dtype, heads, kv_heads, d, block_size):
    """Against SDPA over the dequantized cache. The kernel multiplies integer keys by the query held
    in int16 and applies the row scales to whole scores and weights: fp32 outputs within 1e-4
    (measured up to 5e-5), bf16 within a bf16 rounding."""
    g = torch.Generator().manual_seed(3)
    seq_lens = [1, 16, 17, 100, 1000]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 4
    k_cache, v_cache = _int8_caches(num_blocks, block_size, kv_heads, d, dtype, g)
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
        # Alone, the 1,000-token sequence has its keys split into parts, merged afterwards.
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
def test_prefill_attention_reads_int8_blocks(ops, dtype, heads, kv_heads, d, block_size):
    """A fresh prompt, a chunk over 37 cached tokens and a one-token chunk, against causal SDPA over
    the cache dequantized to the model dtype (what the kernel reads)."""
    g = torch.Generator().manual_seed(6)
    k_cache, v_cache = _int8_caches(30, block_size, kv_heads, d, dtype, g)
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


def test_kernels_refuse_malformed_int8_caches(ops):
    q, lens, table = torch.zeros(1, 64), torch.tensor([3]), torch.tensor([[1]])
    no_scale = torch.zeros(4, 16, 1, 64, dtype=torch.int8)
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
    int8 = torch.zeros(4, 16, 1, 68, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="caches must be alike"):
        ops.decode_attention(q, int8, torch.zeros(4, 16, 1, 68), table, lens, 1, 1.0)
    with pytest.raises(
        RuntimeError, match=r"cache dtype must be int8, uint8 \(fp8\) or the dtype of q"
    ):
        int16 = torch.zeros(4, 16, 1, 64, dtype=torch.int16)
        ops.prefill_attention(q, int16, int16, table, torch.tensor([0, 1]), lens, 1, 1.0)


# ---- the model on an int8 cache ------------------------------------------------------------------


def test_fused_forward_on_int8_cache_matches_the_torch_path(runtime_fp32, runtime_bf16):
    """The kernels (quantizing writes, int8 attention) against the torch reference (quantize_kv on
    write, dequantize on read) in mixed prefill + decode batches
    (assert_quantized_cache_paths_close). Measured mean/max |logit diff| over the pooled batches in
    fp32: fused vs torch 0.048/0.47, int8 vs fp32 cache 0.082/0.49; over 16 batches, sets of six
    read 0.39-0.62 of quantizing's mean and 0.40-0.96 of its largest."""
    best_ops()
    assert_quantized_cache_paths_close(runtime_fp32, runtime_bf16, "int8")


def test_int8_cache_stays_close_to_bf16(runtime_fp32, runtime_bf16, smollm2_tokenizer):
    """Teacher-forced over ~1,000 tokens of the engine's docstrings, against fp32 with an fp32
    cache. Measured: top-1 agreement bf16 97.9%, bf16 with int8 KV 97.1%; perplexity 11.74 / 11.76
    (+0.1%) (bench_quality over 1,500 tokens: 98.1% / 97.1%, 11.54 / 11.55)."""
    from loadtests.workloads import corpus_text

    ids = smollm2_tokenizer.encode(corpus_text())[:1000]
    ref = all_position_logits(runtime_fp32, ids)
    plain = all_position_logits(runtime_bf16, ids)
    int8 = all_position_logits(runtime_bf16, ids, kv_cache_dtype="int8")
    agree_plain = (plain.argmax(-1) == ref.argmax(-1)).float().mean().item()
    agree_int8 = (int8.argmax(-1) == ref.argmax(-1)).float().mean().item()
    ppl_plain, ppl_int8 = perplexity(plain, ids), perplexity(int8, ids)
    print(
        f"top-1 agreement bf16 {agree_plain:.3f}, int8 KV {agree_int8:.3f}; "
        f"perplexity {ppl_plain:.3f} / {ppl_int8:.3f}"
    )
    assert agree_int8 >= 0.95
    assert ppl_int8 <= 1.02 * ppl_plain


# ---- the engine on an int8 cache -----------------------------------------------------------------


@pytest.fixture(scope="module")
def llm_int8(smollm2_path):
    from shared.engine.config import EngineConfig
    from shared.engine.llm import LLM

    config = EngineConfig(
        model=smollm2_path,
        kv_cache_dtype="int8",
        memory_budget="512MiB",
        max_num_batched_tokens=256,
    )
    return LLM(config, progress=False)


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


def test_int8_cache_engine_is_batch_invariant(llm_int8):
    """Each row is quantized on its own and attention reads each sequence on its own: concurrent
    greedy requests equal each alone, to the token."""
    assert _greedy(llm_int8, PROMPTS) == [_greedy(llm_int8, [p])[0] for p in PROMPTS]
    stats = llm_int8.engine.stats()
    assert (
        stats.num_running == stats.num_waiting == 0
        and stats.num_free_blocks == stats.num_total_blocks
    )


def test_int8_cache_prefix_hit_gives_the_same_tokens(llm_int8):
    """A prompt reads its own tokens back from the int8 cache as well as a cached prefix's, so a
    prefix-cache hit changes nothing: only the uncached tail is computed, the output is
    identical."""
    engine = llm_int8.engine
    prefix = engine.tokenizer.encode(" ".join(f"item {i}: {i * i}" for i in range(60)))[:256]
    first, second = (
        prefix + engine.tokenizer.encode(" The last item"),
        prefix + engine.tokenizer.encode(" Sum them"),
    )
    engine.block_manager.reset_prefix_cache()
    _greedy(llm_int8, [first], 8)
    before = engine.stats()
    cached = _greedy(llm_int8, [second], 8)[0]
    after = engine.stats()
    assert after.prefix_cache_hits_tokens - before.prefix_cache_hits_tokens == 256
    assert after.num_computed_tokens - before.num_computed_tokens == (len(second) - 256) + (8 - 1)
    assert engine.block_manager.reset_prefix_cache()
    assert _greedy(llm_int8, [second], 8)[0] == cached


def test_int8_cache_survives_preemption(llm_int8, smollm2_path):
    """Four requests growing to ~48 tokens (3 blocks each) in 8 usable blocks: some are preempted
    and recomputed into the int8 cache, and every output still equals the large pool's."""
    from shared.engine.config import EngineConfig
    from shared.engine.llm import LLM

    expected = _greedy(llm_int8, PROMPTS, 40)
    small = LLM(
        EngineConfig(model=smollm2_path, kv_cache_dtype="int8", num_kv_blocks=9, max_num_seqs=4),
        progress=False,
    )
    assert _greedy(small, PROMPTS, 40) == expected
    stats = small.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == stats.num_total_blocks


def test_int8_cache_holds_nearly_twice_the_tokens(llm_int8, smollm2_path):
    """Per token: 2 x 30 layers x 3 KV heads x (64 int8 + a 4-byte scale) = 12,240 B against
    23,040 B in bf16. The same budget, less the same weights and activations, leaves the same
    remainder R for both pools, and each takes floor(R / its block bytes) blocks."""
    from shared.engine.config import EngineConfig
    from shared.engine.llm import LLM

    config = KNOWN_CONFIGS["smollm2-135m"]
    assert kv_bytes_per_token(config, "int8") == 2 * 30 * 3 * 68 == 12240
    assert kv_bytes_per_token(config, "bfloat16") == 23040
    cache = llm_int8.engine.kv_cache
    assert cache.storage.dtype == torch.int8
    assert cache.num_bytes == cache.num_blocks * 16 * 12240
    bf16 = LLM(
        EngineConfig(model=smollm2_path, memory_budget="512MiB", max_num_batched_tokens=256),
        progress=False,
    )
    n8, b8 = cache.num_blocks, 16 * 12240
    n16, b16 = bf16.engine.kv_cache.num_blocks, 16 * 23040
    assert bf16.engine.kv_cache.num_bytes == n16 * b16
    assert max(n8 * b8, n16 * b16) < min((n8 + 1) * b8, (n16 + 1) * b16)  # one R explains both
    assert n8 > 1.85 * n16


def test_kv_cache_dtype_is_checked_and_reaches_the_executor(monkeypatch):
    from services.executor.__main__ import parse_config
    from shared.engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        KVCache(KNOWN_CONFIGS["smollm2-135m"], 4, 16, torch.bfloat16, kv_cache_dtype="int4")
    assert parse_config([]).engine.kv_cache_dtype == "auto"
    assert parse_config(["--kv-cache-dtype", "int8"]).engine.kv_cache_dtype == "int8"
    monkeypatch.setenv("LLMSERVE_KV_CACHE_DTYPE", "int8")
    assert parse_config([]).engine.kv_cache_dtype == "int8"


def test_torch_path_int8_runner_never_writes_block_zero(runtime_bf16):
    """The padding block stays zero on the torch path too (quantized writes go only to real
    slots)."""
    from shared.engine.model_runner import ScheduledChunk

    with torch_path(runtime_bf16):
        runner = make_runner(runtime_bf16, 8, kv_cache_dtype="int8")
        runner.execute([ScheduledChunk(list(range(10, 40)), 0, [3, 5])])
    storage = runner.kv_cache.storage
    assert not storage[:, :, 0].any() and storage[:, :, 3].any() and storage[:, :, 5, :14].any()
