"""GGUF block-quantized linears (``quantization="gguf"``): the blocks against ``gguf``'s own
dequantization, ``linear_gguf`` against its torch reference at every kernel level, the default
model's native linears against its dequantized load, and the engine on the default Q4_1 file."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from helpers.greedy import all_position_logits
from helpers.levels import best_ops, needs_kernels
from helpers.prompts import PROMPTS
from shared.engine.models.gguf_linear import (
    FORMATS,
    GGUFLinear,
    dequantize_blocks,
    gguf_linear_reference,
    quantize_input_blocks,
    unpack_gguf_rows,
)
from shared.engine.models.teacher_forcing import perplexity

_TYPES = {
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
    "q8_0": GGMLQuantizationType.Q8_0,
}


def _blocks(n: int, k: int, fmt: str, seed: int = 5):
    """A random weight quantized by gguf's own quantizer: (its raw rows, q, d, m)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).numpy()
    raw = quantize(w, _TYPES[fmt])
    return (raw, *unpack_gguf_rows(raw, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(35, 64), (960, 576), (16, 32)])
def test_blocks_dequantize_as_gguf_does_and_pack_losslessly(fmt, n, k):
    """The unpacked blocks dequantize bit for bit to ``gguf.quants.dequantize``; packed into panels
    (rows padded to a multiple of 16) they come back unchanged."""
    raw, q, d, m = _blocks(n, k, fmt)
    expected = dequantize(raw, _TYPES[fmt]).reshape(n, k)
    assert np.array_equal(dequantize_blocks(q, d, m, fmt).numpy(), expected)
    layer = GGUFLinear(q, d, m, fmt)
    assert layer.qs.shape == (-(-n // 16), k // 32, 8 if fmt == "q8_0" else 4, 64)
    q2, d2, m2 = layer.blocks()
    assert torch.equal(q2, q) and torch.equal(d2, d)
    assert (m2 is None and m is None) or (m2 is not None and m is not None and torch.equal(m2, m))
    assert np.array_equal(layer.row_major().numpy(), expected)


def test_input_blocks_round_as_the_kernels_do():
    """127 / max|x| is an IEEE division (torch's ``127.0 / tensor`` is a reciprocal times 127, one
    bit off here): 1.296875 x 127 / 2.59375 is exactly 63.5, which rounds half to even to 64."""
    x = torch.zeros(1, 32)
    x[0, :2] = torch.tensor([2.59375, 1.296875])
    xq, dx, sx = quantize_input_blocks(x)
    assert xq[0, 0, :2].tolist() == [127, 64] and sx.item() == 191
    assert dx.item() == torch.tensor(2.59375 / 127, dtype=torch.float32).item()


def test_reference_is_the_dequantized_product_up_to_8_bit_inputs():
    """The reference's only approximation is the inputs' 8-bit blocks: within 2% of x W^T with the
    dequantized weight (relative Frobenius error; an outlier feature included)."""
    _, q, d, m = _blocks(96, 256, "q4_1")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 256, generator=g)
    x[:, 7] *= 30
    exact = x @ dequantize_blocks(q, d, m, "q4_1").T
    layer = GGUFLinear(q, d, m, "q4_1")
    rel = ((layer(x) - exact).norm() / exact.norm()).item()
    assert 0 < rel < 0.02


# Rows: decode, tile remainders (passes of at most 4), a prefill; columns: panels of 16 part-filled.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "m,n,k,bias",
    [(1, 960, 576, False), (3, 35, 64, True), (7, 100, 1536, False), (37, 48, 96, True)],
)
def test_linear_gguf_matches_its_reference(ops, dtype, fmt, m, n, k, bias):
    """The same quantized inputs and exact integer block sums; the kernel sums blocks in fp32: fp32
    outputs within 1e-5 of the largest, bf16 outputs within one bf16 rounding."""
    _, q, d, mn = _blocks(n, k, fmt)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(m, k, generator=g)
    if m > 2:
        x[1] = 0  # every block scale 0: output = bias
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    layer = GGUFLinear(q, d, mn, fmt, b)
    x = x.to(dtype)
    expected = gguf_linear_reference(x, layer.qs, layer.scales, layer.mins, fmt, n, b)
    ours = ops.linear_gguf(x, layer.qs, layer.scales, layer.mins, fmt, n, b)
    assert ours.dtype == dtype and ours.shape == (m, n)
    if dtype == torch.float32:
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    else:
        torch.testing.assert_close(ours.float(), expected.float(), rtol=2**-7, atol=1e-6)
    if m > 2:
        assert torch.equal(ours[1], b if b is not None else torch.zeros(n, dtype=dtype))


def test_linear_gguf_rejects_mismatched_inputs(ops):
    _, q, d, m = _blocks(40, 64, "q4_1")
    layer = GGUFLinear(q, d, m, "q4_1")
    x = torch.ones(2, 64)
    with pytest.raises(RuntimeError, match="unknown format 'q5_0'"):
        ops.linear_gguf(x, layer.qs, layer.scales, layer.mins, "q5_0", 40, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.linear_gguf(torch.ones(2, 48), layer.qs, layer.scales, layer.mins, "q4_1", 40, None)
    with pytest.raises(RuntimeError, match=r"qs must be uint8 \[4, 2, 4, 64\]"):
        ops.linear_gguf(x, layer.qs, layer.scales, layer.mins, "q4_1", 60, None)
    with pytest.raises(RuntimeError, match="mins are given for q4_1 and only for it"):
        ops.linear_gguf(x, layer.qs, layer.scales, None, "q4_1", 40, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.linear_gguf(
            x, layer.qs, layer.scales, layer.mins, "q4_1", 40, torch.ones(40).bfloat16()
        )


def test_gguf_linear_switches_between_kernel_and_reference(ops):
    _, q, d, m = _blocks(130, 96, "q4_0")
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(4)).bfloat16()
    layer = GGUFLinear(q, d, m, "q4_0", None, ops)
    ours = layer(x)
    assert ours.shape == (3, 5, 130)
    layer.use_cpu_kernels(None)
    torch.testing.assert_close(layer(x).float(), ours.float(), rtol=2**-7, atol=1e-6)


def test_gguf_linear_refuses_a_format_without_its_mins():
    _, q, d, _ = _blocks(16, 32, "q4_1")
    with pytest.raises(ValueError, match="q4_1 blocks need mins"):
        GGUFLinear(q, d, None, "q4_1")
    with pytest.raises(ValueError, match="unknown GGUF block format"):
        GGUFLinear(q, d, None, "q5_0")


# ---- the default model (SmolLM2-135M-Instruct, Q4_1) ---------------------------------------------


@pytest.fixture(scope="module")
def runtime_gguf(smollm2_path):
    best_ops()
    from shared.engine.models.runtime import load_runtime

    return load_runtime(smollm2_path, dtype="bfloat16", progress=False, quantization="gguf")


def test_native_linears_hold_the_weights_the_dequantized_load_holds(runtime_gguf, runtime_fp32):
    """Every decoder linear of the Q4_1 file runs on its blocks, and its blocks dequantize to the
    fp32 load's weight bit for bit: the fused rows in the same order, Q and K with the loader's
    RoPE row permutation."""
    layers = runtime_gguf.model.layers
    for i, (native, plain) in enumerate(zip(layers, runtime_fp32.model.layers, strict=True)):
        for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            layer = native.get_submodule(path)
            assert isinstance(layer, GGUFLinear) and layer.format == "q4_1", (i, path)
            assert layer.ops is runtime_gguf.backend.ops
            assert torch.equal(layer.row_major(), plain.get_submodule(path).weight), (i, path)
    # The tied head runs on the embedding's Q8_0 blocks; the embedding itself still loads.
    head = runtime_gguf.model.lm_head
    assert isinstance(head, GGUFLinear) and head.format == "q8_0" and runtime_gguf.tied_head is None
    assert head.ops is runtime_gguf.backend.ops
    assert torch.equal(head.row_major(), runtime_fp32.model.embed_tokens.weight)
    assert torch.equal(
        runtime_gguf.model.embed_tokens.weight,
        runtime_fp32.model.embed_tokens.weight.to(torch.bfloat16),
    )
    hidden = torch.randn(3, head.in_features, dtype=torch.bfloat16)
    assert torch.equal(runtime_gguf.compute_logits(hidden), head(hidden).float())


@pytest.fixture(scope="module")
def eval_ids(smollm2_tokenizer) -> list[int]:
    from loadtests.workloads import corpus_text

    return smollm2_tokenizer.encode(corpus_text())[:1000]


def test_gguf_model_stays_close_to_fp32(runtime_fp32, runtime_bf16, runtime_gguf, eval_ids):
    """Teacher-forced over ~1,000 tokens against the fp32 load of the same file: the native blocks
    differ from it only by the 8-bit input blocks (the weights are the same numbers), so top-1
    agreement stays high and perplexity within 2% of fp32's."""
    ref = all_position_logits(runtime_fp32, eval_ids)
    ppl_fp32 = perplexity(ref, eval_ids)
    native = all_position_logits(runtime_gguf, eval_ids)
    bf16 = all_position_logits(runtime_bf16, eval_ids)
    agree = (native.argmax(-1) == ref.argmax(-1)).float().mean().item()
    agree_bf16 = (bf16.argmax(-1) == ref.argmax(-1)).float().mean().item()
    ppl = perplexity(native, eval_ids)
    print(
        f"perplexity fp32 {ppl_fp32:.3f}, bf16 {perplexity(bf16, eval_ids):.3f}, "
        f"gguf {ppl:.3f}; top-1 agreement with fp32: bf16 {agree_bf16:.3f}, gguf {agree:.3f}"
    )
    assert agree >= 0.93
    assert ppl <= 1.02 * ppl_fp32


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@needs_kernels
def test_gguf_engine_greedy_agrees_with_bf16_and_holds_less_memory(smollm2_path):
    """Greedy, 32 tokens on each reference prompt, against bf16 (both approximate the fp32 load of
    the same file). The 8-bit input blocks move near-ties, and one moved token changes the rest, so
    exact equality is no contract: measured, the native blocks' first token is bf16's on 14 of 16
    prompts and the common prefix averages 23 tokens (bf16 against fp32: 16 of 16, 24 tokens).
    Asserted with a margin: 12 first tokens, a mean prefix of 10, and Paris named first. Batch
    invariance holds exactly (each input row is quantized on its own and its integer sums are
    exact), and the weights held shrink by the bf16 panels (the tied head's copy among them) traded
    for the blocks."""
    from shared.engine.config import EngineConfig
    from shared.engine.llm import LLM
    from shared.engine.models.packed_linear import PackedLinear
    from shared.wire.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm = LLM(
        EngineConfig(model=smollm2_path, quantization="gguf", memory_budget="512MiB"),
        progress=False,
    )
    bf16 = LLM(EngineConfig(model=smollm2_path, memory_budget="512MiB"), progress=False)
    ours = [r.outputs[0] for r in llm.generate(PROMPTS, params)]
    reference = [r.outputs[0].token_ids for r in bf16.generate(PROMPTS, params)]
    prefixes = [_common_prefix(o.token_ids, r) for o, r in zip(ours, reference, strict=True)]
    print(f"common prefix with bf16 per prompt: {prefixes}")
    assert sum(p > 0 for p in prefixes) >= 12
    assert sum(prefixes) / len(prefixes) >= 10
    assert "Paris" in ours[0].text.split(".")[0]
    some = PROMPTS[:4]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in some]
    assert alone == [o.token_ids for o in ours[:4]]

    native = [m for m in llm.engine.model.modules() if isinstance(m, GGUFLinear)]
    assert len(native) == 4 * llm.engine.model_config.num_layers + 1  # and the head
    packed = [m for m in bf16.engine.model.modules() if isinstance(m, PackedLinear)]
    bf16_panels = sum(m.packed.numel() * m.packed.element_size() for m in packed)
    blocks = sum(t.numel() * t.element_size() for m in native for t in m.tensors())
    block_bytes = {"q4_1": 20, "q8_0": 34}
    assert blocks == sum(
        -(-m.out_features // 16) * 16 * m.in_features // 32 * block_bytes[m.format] for m in native
    )
    assert (
        llm.engine.model.weight_bytes() == bf16.engine.model.weight_bytes() - bf16_panels + blocks
    )
    assert llm.engine.stats().num_total_blocks > bf16.engine.stats().num_total_blocks


def test_gguf_needs_a_gguf_file(tmp_path):
    from shared.engine.models.loader import load_model

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="runs a GGUF file's blocks"):
        load_model(str(tmp_path), quantization="gguf", progress=False)


def test_gguf_without_the_kernels_is_a_clear_error(monkeypatch, smollm2_path):
    from shared.engine.config import EngineConfig
    from shared.engine.cpu_backend import CpuBackend
    from shared.engine.engine import Engine

    with pytest.raises(ValueError, match="quantization='gguf' needs the CPU kernels"):
        Engine(
            EngineConfig(model=smollm2_path, quantization="gguf"),
            progress=False,
            backend=CpuBackend.off("switched off for the test"),
        )


# ---- int4: any checkpoint quantized into the same blocks at load --------------------------------


@needs_kernels
def test_int4_of_the_dequantized_file_is_the_files_own_blocks(smollm2_path, runtime_gguf):
    """``quantization="int4"`` quantizes with llama.cpp's rounding (the ``gguf`` package's): on the
    default file's dequantized weights it finds the file's own Q4_1 blocks and the tied head's Q8_0
    blocks again, bit for bit, so the model computes exactly what the native blocks compute."""
    from shared.engine.models.gguf_linear import quantize_model_int4
    from shared.engine.models.runtime import load_runtime

    runtime = load_runtime(smollm2_path, dtype="bfloat16", progress=False)
    assert quantize_model_int4(runtime) == 4 * runtime.config.num_layers + 1
    ours = [m for m in runtime.modules() if isinstance(m, GGUFLinear)]
    native = [m for m in runtime_gguf.modules() if isinstance(m, GGUFLinear)]
    assert [m.format for m in ours] == [m.format for m in native]
    for a, b in zip(ours, native, strict=True):
        (qa, da, ma), (qb, db, mb) = a.blocks(), b.blocks()
        assert torch.equal(qa, qb) and torch.equal(da, db)
        assert (ma is None and mb is None) or (
            ma is not None and mb is not None and torch.equal(ma, mb)
        )
        assert a.ops is runtime.backend.ops
    assert runtime.tied_head is None and runtime.weight_bytes() == runtime_gguf.weight_bytes()
    ids = list(range(100, 164))
    assert torch.equal(all_position_logits(runtime, ids), all_position_logits(runtime_gguf, ids))


@needs_kernels
def test_int4_engine_on_a_safetensors_checkpoint(tmp_path):
    """A safetensors model (the tiny random Llama, untied head) under ``quantization="int4"``: every
    decoder linear in Q4_1 blocks within half a step of its weight, the head in Q8_0; the ledger's
    weight bytes are what the engine holds; greedy output does not depend on the batch; and the
    kernels compute what the torch reference of the same blocks computes."""
    from helpers.tiny_llama import save_tiny_llama
    from shared.engine.config import EngineConfig
    from shared.engine.cpu_backend import CpuBackend
    from shared.engine.llm import LLM
    from shared.engine.memory import weight_bytes
    from shared.engine.models.loader import load_model
    from shared.wire.sampling_params import SamplingParams

    path = save_tiny_llama(tmp_path, seed=5, hidden_size=128)
    llm = LLM(EngineConfig(model=path, quantization="int4", num_kv_blocks=64), progress=False)
    runtime = llm.engine.model
    plain = load_model(path, dtype="float32", progress=False)
    layers = {n: m for n, m in runtime.model.named_modules() if isinstance(m, GGUFLinear)}
    assert len(layers) == 4 * runtime.config.num_layers + 1
    assert layers["lm_head"].format == "q8_0"
    for name, layer in layers.items():
        assert layer.format == ("q8_0" if name == "lm_head" else "q4_1")
        _, d, _ = layer.blocks()
        dense = cast(torch.nn.Linear, plain.get_submodule(name))
        w = dense.weight.to(torch.bfloat16).float()  # what the engine loaded
        step = d.float().repeat_interleave(32, dim=1)
        block_max = w.abs().reshape(w.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1)
        # Round to nearest: each weight within half a step, give or take the fp16 rounding of the
        # block's scale and min.
        assert ((layer.row_major() - w).abs() <= 0.55 * step + 2**-10 * block_max).all(), name
    assert weight_bytes(runtime.config, "bfloat16", quantization="int4") == runtime.weight_bytes()

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["hello there", "a b c d e f", "the quick brown fox", "zz"]
    together = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    assert together == [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]

    runtime.use(CpuBackend.off("the torch reference of the same blocks"))
    hidden = torch.randn(5, runtime.config.hidden_size, dtype=torch.bfloat16)
    reference = runtime.compute_logits(hidden)
    runtime.use(llm.engine.backend)
    torch.testing.assert_close(runtime.compute_logits(hidden), reference, rtol=1e-2, atol=1e-2)
