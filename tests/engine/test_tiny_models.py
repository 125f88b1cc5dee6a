"""Tiny random Llama-family models built with transformers, saved, and loaded by our loader.

Random weights cover every code path the real SmolLM2 does not: Qwen2's QKV bias, an untied
output head, Llama-3 RoPE scaling, and a GGUF written the way llama.cpp's converter writes it
(Q/K rows permuted for interleaved RoPE), which our loader must undo.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
import torch

from helpers.greedy import all_position_logits, greedy_generate
from shared.engine.models.llama import DecoderLayer
from shared.engine.models.runtime import load_runtime

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

VOCAB = 256
SEQ_LEN = 160  # past the llama3 variant's original context of 64, so its scaling matters
# Max |logit diff| vs transformers, every position, fp32: measured 1.8e-6 .. 5.3e-6 on these models
# (largest: llama3 rope); ~5x headroom.
ATOL = 3e-5

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=None,
)

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-untied": ("llama", dict(tie_word_embeddings=False)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama3-rope": (
        "llama",
        dict(
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2-bias": (
        "qwen2",
        dict(
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
}


def build_hf_model(arch: str, overrides: dict, seed: int = 0):
    """Random-init model, with non-trivial norm scales and (Qwen2) non-zero Q/K/V biases, which
    transformers' init would leave at 1 and 0 and so would not test the loading of."""
    torch.manual_seed(seed)
    if arch == "qwen2":
        config = transformers.Qwen2Config(**COMMON, **overrides)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**COMMON, **overrides)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # run every requested token
    return model.eval()


def random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def compare(ours, hf_model, seed: int = 1) -> float:
    ids = random_ids(SEQ_LEN, seed)
    diff = (all_position_logits(ours, ids) - hf_logits(hf_model, ids)).abs().max().item()
    assert diff <= ATOL, diff
    prompt = ids[:40]
    # Greedy through the paged runtime, with and without chunked prefill, vs HF generate.
    expected = hf_greedy(hf_model, prompt, 24)
    assert greedy_generate(ours, prompt, 24).token_ids == expected
    assert greedy_generate(ours, prompt, 24, chunk_size=7).token_ids == expected
    return diff


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_safetensors_model_matches_transformers(variant, tmp_path):
    arch, overrides = VARIANTS[variant]
    hf_model = build_hf_model(arch, overrides)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "config.json").exists() and list(tmp_path.glob("*.safetensors"))

    ours = load_runtime(str(tmp_path), dtype="float32", progress=False)
    c = ours.config
    assert c.architecture == arch and c.num_layers == 2 and c.num_kv_heads == 2 and c.head_dim == 16
    assert c.tie_word_embeddings == overrides["tie_word_embeddings"]
    assert c.qkv_bias == (arch == "qwen2")
    if variant == "llama3-rope":
        assert (
            c.rope_scaling is not None
            and c.rope_scaling.kind == "llama3"
            and c.rope_theta == 500000.0
        )
    else:
        assert c.rope_scaling is None
    diff = compare(ours, hf_model)
    print(f"{variant}: max |logit diff| {diff:.2g}")


def test_rope_scaling_changes_the_output(tmp_path):
    """The llama3 variant's agreement above is not vacuous: ignoring the scaling changes logits."""
    _, overrides = VARIANTS["llama3-rope"]
    scaled = build_hf_model("llama", overrides)
    plain = build_hf_model(
        "llama", {**overrides, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    )
    ids = random_ids(SEQ_LEN, 1)
    assert (hf_logits(scaled, ids) - hf_logits(plain, ids)).abs().max().item() > 100 * ATOL


# --- GGUF written like llama.cpp's convert_hf_to_gguf.py ---------------------------------------


def llama_cpp_permute(w: torch.Tensor, n_head: int, n_head_kv: int | None = None) -> torch.Tensor:
    """convert_hf_to_gguf.LlamaModel.permute: per head, half-split RoPE rows → interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_llama_gguf(hf_model, path) -> None:
    cfg = hf_model.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            out_name = f"blk.{layer}.{GGUF_NAMES[rest]}"
        else:
            out_name = GGUF_NAMES[name]
        if name.endswith("q_proj.weight"):
            t = llama_cpp_permute(t, n_head, n_head)
        elif name.endswith("k_proj.weight"):
            t = llama_cpp_permute(t, n_head, n_kv)
        # numpy [out, in]; the writer stores GGUF's innermost-first dimensions.
        w.add_tensor(out_name, np.ascontiguousarray(t.detach().float().numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_roundtrip_undoes_llama_cpp_permutation(tied, tmp_path):
    hf_model = build_hf_model("llama", dict(tie_word_embeddings=tied), seed=3)
    q = hf_model.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(
        llama_cpp_permute(q, 4, 4), q
    )  # the permutation is not the identity here
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(hf_model, path)

    ours = load_runtime(str(path), dtype="float32", progress=False)
    assert ours.config.architecture == "llama" and ours.config.tie_word_embeddings == tied
    assert ours.config.num_heads == 4 and ours.config.num_kv_heads == 2
    # The loader put Q/K back in transformers' layout: the fused weight holds the original rows.
    qkv = cast(DecoderLayer, ours.model.layers[0]).self_attn.qkv_proj.weight
    assert torch.equal(qkv[:64], q)
    assert torch.equal(qkv[64:96], hf_model.model.layers[0].self_attn.k_proj.weight)
    diff = compare(ours, hf_model, seed=2)
    print(f"gguf {'tied' if tied else 'untied'}: max |logit diff| {diff:.2g}")
