"""The fused CPU kernels (kernels/cpu) against the unfused torch maths they replace, op by op."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers.greedy import assert_fused_as_close, mixed_batch_logits
from helpers.paged import BLOCK_SIZES, SHAPES, scattered_tables
from kernels.cpu import cpu_ops, unavailable_reason

DTYPES = [torch.float32, torch.bfloat16]
# bf16 results may differ from the unfused ops by rounding order: one bf16 ulp of the value's scale.
TOL: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(ops, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 576, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    res = torch.randn(7, 576, generator=g).to(dtype)
    torch.testing.assert_close(
        ops.rms_norm(x, w, 1e-5, None), F.rms_norm(x, (576,), w, 1e-5), **TOL[dtype]
    )
    expected_sum = x + res
    expected = F.rms_norm(expected_sum, (576,), w, 1e-5)
    out = ops.rms_norm(x, w, 1e-5, res)
    assert torch.equal(
        res, expected_sum
    )  # residual updated in place, rounded as the plain add rounds
    torch.testing.assert_close(out, expected, **TOL[dtype])


def _rope_reference(x, pos, cos, sin):
    half = x.shape[-1] // 2
    c, s = cos[pos][:, None, :].float(), sin[pos][:, None, :].float()
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_cache_rotates_q_k_and_writes_k_v_slots(ops, dtype):
    heads, kv_heads, d, block_size, num_blocks = 6, 2, 16, 4, 9
    g = torch.Generator().manual_seed(1)
    tokens = 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    positions = torch.tensor([0, 3, 4, 17, 30])
    slots = torch.tensor([5, 6, 7, 20, 33])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(64).float(), inv)
    cos, sin = freqs.cos(), freqs.sin()
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    before = qkv.clone()
    ops.rope_and_cache(qkv, positions, cos, sin, k_cache, v_cache, slots, heads, kv_heads, d)
    qk = before[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d)
    expected_qk = _rope_reference(qk, positions, cos, sin).to(dtype).view(tokens, -1)
    torch.testing.assert_close(qkv[:, : (heads + kv_heads) * d], expected_qk, **TOL[dtype])
    assert torch.equal(
        qkv[:, (heads + kv_heads) * d :], before[:, (heads + kv_heads) * d :]
    )  # V untouched
    flat_k, flat_v = k_cache.view(-1, kv_heads * d), v_cache.view(-1, kv_heads * d)
    assert torch.equal(flat_k[slots], qkv[:, heads * d : (heads + kv_heads) * d])
    assert torch.equal(flat_v[slots], qkv[:, (heads + kv_heads) * d :])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_rope_and_cache_rejects_out_of_range_slots(ops):
    qkv = torch.randn(1, 4 * 8)
    cos = sin = torch.ones(4, 4)
    cache = torch.zeros(2, 2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_and_cache(
            qkv, torch.tensor([0]), cos, sin, cache, cache.clone(), torch.tensor([4]), 2, 1, 8
        )
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        ops.rope_and_cache(
            qkv, torch.tensor([4]), cos, sin, cache, cache.clone(), torch.tensor([0]), 2, 1, 8
        )


# Whole runs of two vectors, a part-filled last vector (100, 7), and rows split between threads
# (5 x 1000: the kernel shares rows x features out in runs of at least 4,096).
@pytest.mark.parametrize("rows,inter", [(3, 96), (2, 100), (4, 7), (5, 1000)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(ops, dtype, rows, inter):
    gu = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(2)).to(dtype)
    gate, up = gu.split(inter, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gu), F.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_is_torch_argmax_ties_and_nan_included(ops, dtype):
    g = torch.Generator().manual_seed(3)
    for rows, n in [(32, 49152), (1, 1), (3, 17), (5, 15), (2, 100003)]:
        x = torch.randn(rows, n, generator=g).to(dtype)
        assert torch.equal(ops.argmax_rows(x), x.argmax(-1)), (rows, n)
    ties = torch.randint(-2, 2, (64, 1000), generator=g).to(
        dtype
    )  # every maximum repeats: the first wins
    assert torch.equal(ops.argmax_rows(ties), ties.argmax(-1))
    x = torch.full((5, 40), float("-inf"), dtype=dtype)
    x[1, 33] = x[2, 5] = x[2, 3] = float("nan")  # NaN is the maximum, the first one
    x[3, 39], x[4, 0], x[4, 16] = 1.0, -0.0, 0.0  # -0.0 == 0.0: a tie
    assert ops.argmax_rows(x).tolist() == x.argmax(-1).tolist() == [0, 33, 3, 39, 0]


def test_argmax_rows_rejects_what_it_cannot_read(ops):
    with pytest.raises(RuntimeError, match="must be \\[rows"):
        ops.argmax_rows(torch.randn(3))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.argmax_rows(torch.randn(4, 6).t())


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_reads_paged_blocks_in_place(ops, dtype, heads, kv_heads, d, block_size):
    g = torch.Generator().manual_seed(3)
    seq_lens = [1, 16, 17, 100, 1000]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    tables, block_tables = scattered_tables(seq_lens, num_blocks, block_size, g, spare_columns=2)
    q = torch.randn(len(seq_lens), heads * d, generator=g).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = ops.decode_attention(
            q, k_cache, v_cache, block_tables, torch.tensor(seq_lens), heads, 1 / math.sqrt(d)
        )
    finally:
        torch.set_num_threads(threads)
    out = ops.decode_attention(
        q, k_cache, v_cache, block_tables, torch.tensor(seq_lens), heads, 1 / math.sqrt(d)
    )
    assert torch.equal(out, one_thread)
    tol: dict[str, Any] = dict(atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)
    for s, n in enumerate(seq_lens):
        ids = torch.tensor(tables[s])
        keys = (
            k_cache[ids]
            .reshape(-1, kv_heads, d)[:n]
            .float()
            .transpose(0, 1)
            .repeat_interleave(heads // kv_heads, 0)
        )
        values = (
            v_cache[ids]
            .reshape(-1, kv_heads, d)[:n]
            .float()
            .transpose(0, 1)
            .repeat_interleave(heads // kv_heads, 0)
        )
        expected = F.scaled_dot_product_attention(
            q[s].float().view(heads, 1, d), keys, values
        ).reshape(-1)
        torch.testing.assert_close(out[s].float(), expected, **tol)
        # A sequence's keys are split by its own length (1,000 tokens: four parts of up to 256,
        # merged afterwards), so alone it gives exactly what it gives in the batch.
        alone = ops.decode_attention(
            q[s : s + 1],
            k_cache,
            v_cache,
            block_tables[s : s + 1],
            torch.tensor([n]),
            heads,
            1 / math.sqrt(d),
        )
        assert torch.equal(alone[0], out[s])


def test_decode_attention_rejects_lengths_beyond_the_block_table(ops):
    cache = torch.zeros(4, 16, 1, 64)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        ops.decode_attention(
            torch.zeros(1, 64), cache, cache, torch.tensor([[1]]), torch.tensor([17]), 1, 1.0
        )
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.decode_attention(
            torch.zeros(1, 64), cache, cache, torch.tensor([[9]]), torch.tensor([3]), 1, 1.0
        )
    with pytest.raises(RuntimeError, match="unsupported shape"):
        ops.decode_attention(
            torch.zeros(1, 48),
            torch.zeros(4, 16, 1, 48),
            torch.zeros(4, 16, 1, 48),
            torch.tensor([[1]]),
            torch.tensor([3]),
            1,
            1.0,
        )


# Rows: decode sizes, tile remainders (passes of at most 8, or 6), groups the AVX2 form widens in
# the tile (up to 64 rows) or in a block first, more than one 48-row chunk (the dot-product form's)
# or 512-row group (the AVX2 form's); columns: a part-filled last panel of 48, fewer than one panel,
# 32 panels and more (the AVX2 form's threads then claim whole panels); inputs: more than one block
# of 256 features (the AVX2 form's), the last one short, or whole (7 rows: a pass of 3 packs its
# features right up to the next block's).
@pytest.mark.parametrize(
    "m,n,k,bias",
    [
        (1, 960, 576, False),
        (3, 577, 1536, True),
        (2, 5, 40, False),
        (4, 200, 64, True),
        (7, 96, 100, False),
        (7, 50, 512, True),
        (32, 131, 576, True),
        (101, 70, 64, True),
        (250, 1000, 1538, True),
        (13, 49, 2, False),
        (40, 1601, 576, False),
        (200, 1550, 260, True),
        (1030, 70, 300, True),
    ],
)
def test_linear_bf16_is_an_fp32_accumulated_matmul(ops, m, n, k, bias):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    expected = x.float() @ w.float().T + (b.float() if b is not None else 0)
    # Exact products, fp32 sums in another order: within a bf16 rounding of the fp32 result.
    torch.testing.assert_close(
        ops.linear_bf16(x, ops.pack_linear_bf16(w), n, b).float(), expected, atol=1e-2, rtol=8e-3
    )


@pytest.mark.parametrize(
    "m,k,n", [(40, 576, 150), (200, 1536, 150), (40, 576, 1601), (1100, 300, 70)]
)
def test_linear_bf16_gives_a_row_the_same_result_in_any_batch(ops, m, k, n):
    """Each output is the same fp32 sum, in the same order, whether its row comes alone or with
    others."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = ops.pack_linear_bf16(torch.randn(n, k, generator=g).bfloat16())
    b = torch.randn(n, generator=g).bfloat16()
    batch = ops.linear_bf16(x, w, n, b)
    for rows in (slice(0, 1), slice(3, 5), slice(7, 15), slice(m - 37, m)):
        assert torch.equal(ops.linear_bf16(x[rows].contiguous(), w, n, b), batch[rows])


def test_linear_bf16_rejects_mismatched_inputs(ops):
    w = ops.pack_linear_bf16(torch.ones(70, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="even in_features"):
        ops.pack_linear_bf16(torch.ones(8, 63, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x has 32 features, the weight 64"):
        ops.linear_bf16(torch.ones(2, 32, dtype=torch.bfloat16), w, 70, None)
    with pytest.raises(RuntimeError, match="must come from pack_linear_bf16 for 200 out_features"):
        ops.linear_bf16(torch.ones(2, 64, dtype=torch.bfloat16), w, 200, None)


def test_a_kernel_lets_other_python_threads_run(ops):
    """An op releases the GIL while its kernel runs (the executor's event loop keeps serving during
    an engine step): a thread that stamps the time every millisecond keeps stamping through the
    middle of a long linear, which it could not do if the call held the GIL."""
    x = torch.randn(2048, 2048).bfloat16()
    w = ops.pack_linear_bf16(torch.randn(2048, 2048).bfloat16())
    stamps: list[float] = []
    done = threading.Event()

    def stamp() -> None:
        while not done.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a core left for the stamping thread on a 2-core machine
    stamper = threading.Thread(target=stamp)
    stamper.start()
    try:
        t0 = time.perf_counter()
        ops.linear_bf16(x, w, 2048, None)
        t1 = time.perf_counter()
    finally:
        done.set()
        stamper.join()
        torch.set_num_threads(threads)
    quarter = (t1 - t0) / 4
    assert t1 - t0 > 0.04, "the linear was too short to tell"
    assert any(t0 + quarter < t < t1 - quarter for t in stamps)


def test_packed_linear_switches_layouts_without_loss(ops):
    """The kernels' pair layout and the fallback (oneDNN's where it runs bf16, else the dense
    weight) hold the same weight bit for bit, and give the same results up to summation order."""
    from kernels.cpu import isa
    from shared.engine.models.packed_linear import DENSE, ONEDNN, PackedLinear

    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(130, 96, generator=g).bfloat16(), torch.randn(130, generator=g).bfloat16()
    x = torch.randn(3, 5, 96, generator=g).bfloat16()
    layer = PackedLinear(w, b, ops)
    assert layer.ops is ops and torch.equal(layer.row_major(), w)
    ours = layer(x)
    layer.use_cpu_kernels(None)
    fallback = ONEDNN if isa.onednn_usable(torch.bfloat16) else DENSE  # dense on an AVX2-only CPU
    assert layer.ops is None and layer.layout == fallback and torch.equal(layer.row_major(), w)
    torch.testing.assert_close(layer(x).float(), ours.float(), atol=1e-2, rtol=8e-3)
    layer.use_cpu_kernels(ops)
    assert torch.equal(layer(x), ours)
    # Pairs need an even number of input features: otherwise the layer takes the fallback.
    odd = PackedLinear(w[:, :95].contiguous(), None, ops)
    assert odd.ops is None and odd.layout == fallback and torch.equal(odd.row_major(), w[:, :95])


# ---- the whole model: fused kernels vs the plain torch path --------------------------------------


def test_fused_forward_matches_the_torch_path(runtime_fp32, runtime_bf16):
    """fp32: the same numbers up to summation order (measured max |logit diff| 3e-5). bf16: rounding
    happens in different places (RoPE and norms once in fp32, not per torch op; the bf16 linear and
    attention sum in another order), so both bf16 paths are held to their distance from fp32
    (assert_fused_as_close; random tokens give flat distributions full of near-ties, so token
    choices are not compared here; test_model_reference does that). Measured on an AVX2-only CPU
    over the pooled batches, mean/max: fused 0.133/0.78, torch path 0.118/1.10."""
    ref = mixed_batch_logits(runtime_fp32, True)
    assert (ref - mixed_batch_logits(runtime_fp32, False)).abs().max().item() < 1e-4
    assert_fused_as_close(
        mixed_batch_logits(runtime_bf16, True), mixed_batch_logits(runtime_bf16, False), ref
    )


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_is_causal_over_cached_context(
    ops, dtype, heads, kv_heads, d, block_size
):
    """Three prefill chunks in one call: a fresh prompt (longer than one query tile), a chunk that
    continues 37 cached tokens (not block aligned) and a one-token chunk; blocks scattered."""
    g = torch.Generator().manual_seed(6)
    num_blocks = 30
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    seq_lens, q_lens = [70, 37 + 20, 5], [70, 20, 1]
    tables, block_tables = scattered_tables(seq_lens, num_blocks, block_size, g)
    starts = torch.tensor([0, 70, 90, 91])
    q = torch.randn(91, heads * d, generator=g).to(dtype)
    out = ops.prefill_attention(
        q, k_cache, v_cache, block_tables, starts, torch.tensor(seq_lens), heads, 1 / math.sqrt(d)
    )
    for s, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        ids = torch.tensor(tables[s])
        keys = (
            k_cache[ids]
            .reshape(-1, kv_heads, d)[:n]
            .float()
            .transpose(0, 1)
            .repeat_interleave(heads // kv_heads, 0)
        )
        values = (
            v_cache[ids]
            .reshape(-1, kv_heads, d)[:n]
            .float()
            .transpose(0, 1)
            .repeat_interleave(heads // kv_heads, 0)
        )
        qs = q[starts[s] : starts[s + 1]].float().view(ql, heads, d).transpose(0, 1)
        mask = (
            torch.arange(n)[None, :] <= torch.arange(n - ql, n)[:, None]
        )  # query at n-ql+i sees keys 0..n-ql+i
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


def test_kernels_can_be_switched_off(monkeypatch):
    before = cpu_ops()
    monkeypatch.setenv("LLMSERVE_CPU_KERNELS", "0")
    cpu_ops.cache_clear()
    try:
        assert cpu_ops() is None
        assert unavailable_reason() == "switched off (LLMSERVE_CPU_KERNELS=0)"
    finally:
        monkeypatch.delenv("LLMSERVE_CPU_KERNELS")
        cpu_ops.cache_clear()
    assert cpu_ops() is before
