import json
import math
import struct
from dataclasses import replace
from typing import Any

import pytest

from shared.engine.default_model import default_model_path
from shared.engine.memory import (
    DTYPE_BYTES,
    InsufficientMemoryError,
    activation_bytes,
    format_bytes,
    format_ledger,
    kv_bytes_per_token,
    parse_bytes,
    plan_memory,
    weight_bytes,
)
from shared.engine.models.config import UnsupportedModelError
from shared.engine.models.known_configs import KNOWN_CONFIGS, resolve_config, resolve_model

GiB, MiB = 2**30, 2**20
LLAMA2_7B = KNOWN_CONFIGS["llama-2-7b"]
SHAPE_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rope_theta",
    "max_position_embeddings",
    "tie_word_embeddings",
    "qkv_bias",
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GiB", 80 * GiB),
        ("512MiB", 512 * MiB),
        ("1.5GB", 1_500_000_000),
        ("1024", 1024),
        ("1.5KiB", 1536),
        (" 2 gib ", 2 * GiB),
        ("24G", 24_000_000_000),
        ("8Gi", 8 * GiB),
        ("1.1GB", 1_100_000_000),
        ("100B", 100),
        ("0.5", 0),
        (".5KB", 500),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text", ["", "abc", "-1GiB", "1.2.3GB", "12XB", "GiB", "nan", "inf", "1e9", -5]
)
def test_parse_bytes_rejects_junk(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.parametrize(
    "num_bytes, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (524288, "512 KiB"),
        (80 * GiB, "80 GiB"),
        (int(13.48 * GiB), "13.48 GiB"),
    ],
)
def test_format_bytes(num_bytes, text):
    assert format_bytes(num_bytes) == text


def test_kv_bytes_per_token_published_models():
    assert kv_bytes_per_token(LLAMA2_7B, "float16") == 524288  # 2 * 32 * 32 * 128 * 2 = 512 KiB
    assert (
        kv_bytes_per_token(KNOWN_CONFIGS["llama-3-8b"], "bfloat16") == 131072
    )  # 2 * 32 * 8 * 128 * 2
    assert (
        kv_bytes_per_token(KNOWN_CONFIGS["llama-3-70b"], "bfloat16") == 327680
    )  # 2 * 80 * 8 * 128 * 2
    assert kv_bytes_per_token(KNOWN_CONFIGS["smollm2-135m"], "float32") == 2 * 30 * 3 * 64 * 4
    # The engine's int8 and fp8 caches: each (token, KV head) row carries a 4-byte scale.
    assert (
        kv_bytes_per_token(KNOWN_CONFIGS["llama-3-8b"], "int8") == 67584
    )  # 2 * 32 * 8 * (128 + 4)
    assert kv_bytes_per_token(KNOWN_CONFIGS["llama-3-8b"], "fp8") == 67584


def test_num_params_from_published_shapes():
    # Llama-2-7B: embeddings + 32 x (q,k,v,o 4096x4096; gate, up, down 4096x11008; 2 norms)
    # + norm + head
    layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert 32000 * 4096 + 32 * layer + 4096 + 32000 * 4096 == 6738415616
    assert LLAMA2_7B.num_params() == 6738415616
    # Llama-3-8B: GQA, k and v are 4096 x (8 x 128)
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert 128256 * 4096 + 32 * layer + 4096 + 128256 * 4096 == 8030261248
    assert KNOWN_CONFIGS["llama-3-8b"].num_params() == 8030261248


def test_weight_bytes_and_override():
    assert weight_bytes(LLAMA2_7B, "float16") == 2 * 6738415616
    assert weight_bytes(LLAMA2_7B, "float32", num_params=1000) == 4000
    with pytest.raises(ValueError, match="unknown dtype"):
        weight_bytes(LLAMA2_7B, "float64")


def test_int8_weight_and_activation_bytes_by_hand():
    """Llama-2-7B with int8 decoder linears: per layer QKV 12288x4096, O 4096x4096, gate-up
    22016x4096, down 4096x11008 take a byte per weight, plus 8 bytes per output feature (scale,
    column sum) and 4 per input feature (smoothing); the other 262,410,240 parameters stay fp16."""
    linear = 32 * (12288 * 4096 + 4096 * 4096 + 22016 * 4096 + 4096 * 11008)
    extras = 32 * (8 * (12288 + 4096 + 22016 + 4096) + 4 * (4096 + 4096 + 4096 + 11008))
    assert (linear, extras) == (6476005376, 13860864)
    assert (
        weight_bytes(LLAMA2_7B, "float16", quantization="int8")
        == 2 * (6738415616 - linear) + linear + extras
    )
    # Activations: the bf16/fp16 buffers as before, plus each token's quantized input (at most the
    # intermediate size, 11,008 bytes) and its fp32 scale.
    assert activation_bytes(LLAMA2_7B, 2048, 256, "float16", "int8") == activation_bytes(
        LLAMA2_7B, 2048, 256, "float16"
    ) + 2048 * (11008 + 4)
    with pytest.raises(ValueError, match="unknown quantization"):
        weight_bytes(LLAMA2_7B, "float16", quantization="int3")


def test_gguf_weight_and_activation_bytes_by_hand():
    """Decoder linears held in GGUF blocks take their format's bytes per 32 weights (Q4_0 18, Q4_1
    20, Q8_0 34), rows padded to a multiple of 16; a linear the file holds in another format (None)
    stays in the weight dtype, as does everything else. Llama-2-7B's shapes are multiples of 16."""
    per_layer = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]
    linear = 32 * sum(n * k for n, k in per_layer)
    q4_1 = 32 * sum(n * k // 32 * 20 for n, k in per_layer)
    assert (
        weight_bytes(LLAMA2_7B, "float16", quantization="gguf", gguf_formats=["q4_1"] * 4 * 32)
        == 2 * (6738415616 - linear) + q4_1
    )
    # Layer 0's down projection in another format (Q6_K, say): back to fp16 for that one.
    mixed = ["q4_0", "q4_0", "q8_0", None] + ["q4_1"] * 4 * 31
    down = 4096 * 11008
    expected = (
        2 * (6738415616 - linear + down)
        + (12288 + 4096) * 4096 // 32 * 18
        + 22016 * 4096 // 32 * 34
        + 31 * sum(n * k // 32 * 20 for n, k in per_layer)
    )
    assert weight_bytes(LLAMA2_7B, "float16", quantization="gguf", gguf_formats=mixed) == expected
    # An untied head (32,000 x 4,096) on Q8_0 blocks leaves the fp16 count for its blocks.
    head = 32000 * 4096
    assert (
        weight_bytes(
            LLAMA2_7B, "float16", quantization="gguf", gguf_formats=mixed, gguf_head_format="q8_0"
        )
        == expected - 2 * head + head // 32 * 34
    )
    # int4: any model, no file needed: every decoder linear Q4_1, the head Q8_0.
    assert (
        weight_bytes(LLAMA2_7B, "float16", quantization="int4")
        == 2 * (6738415616 - linear - head) + q4_1 + head // 32 * 34
    )
    with pytest.raises(ValueError, match="needs the block format of each decoder linear"):
        weight_bytes(LLAMA2_7B, "float16", quantization="gguf")
    # Activations: each token's input quantized per 32-block (at most 11,008 bytes) with an fp32
    # scale and an int32 sum per block.
    assert activation_bytes(LLAMA2_7B, 2048, 256, "float16", "gguf") == activation_bytes(
        LLAMA2_7B, 2048, 256, "float16"
    ) + 2048 * (11008 + 11008 // 32 * 8)


def test_gguf_ledger_of_the_default_model_reads_its_formats():
    """The default file holds every decoder linear in Q4_1 and its tied head (the embedding) in
    Q8_0: the ledger counts the linears at 20 bytes per 32 weights (SmolLM2-135M: 30 layers of
    960x576, 576x576, 3072x576, 576x1536) and the head's blocks at 34 beside the bf16 embedding."""
    model = resolve_model(None)
    assert model.gguf_formats == ("q4_1",) * 4 * 30 and model.num_params is not None
    assert model.gguf_head_format == "q8_0" and model.config.tie_word_embeddings
    linear = 30 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536)
    assert (
        weight_bytes(model.config, "bfloat16", model.num_params, "gguf", model.gguf_formats, "q8_0")
        == 2 * (model.num_params - linear) + linear // 32 * 20 + 49152 * 576 // 32 * 34
    )


def test_activation_bytes_by_hand():
    # Llama-2-7B, T = 2048 tokens, fp16: 2h + (q + 2kv) + q + 2i + i = 57600 elements per token
    per_token = 2 * 4096 + (4096 + 2 * 4096) + 4096 + 2 * 11008 + 11008
    assert per_token == 57600
    expected = 2048 * 57600 * 2 + 256 * 32000 * 4 * 2
    assert activation_bytes(LLAMA2_7B, 2048, 256, "float16") == expected == 301465600
    # A step never samples more rows than it has tokens.
    assert activation_bytes(LLAMA2_7B, 64, 256, "float16") == 64 * 57600 * 2 + 64 * 32000 * 8
    with pytest.raises(ValueError):
        activation_bytes(LLAMA2_7B, 0, 256, "float16")


def test_plan_memory_block_arithmetic_by_hand():
    weights, activations, per_block = 2 * 6738415616, 301465600, 16 * 524288
    budget = weights + activations + 100 * per_block + 12345
    ledger = plan_memory(
        LLAMA2_7B,
        memory_budget_bytes=budget,
        weight_dtype="float16",
        kv_dtype="float16",
        context_len=500,
    )
    assert ledger.weight_bytes == weights and ledger.activation_bytes == activations
    assert ledger.kv_bytes_per_block == per_block == 8 * MiB
    assert ledger.num_kv_blocks == 100  # the pool, padding block 0 included
    assert ledger.num_usable_kv_blocks == 99
    assert ledger.num_kv_tokens == 99 * 16 == 1584
    assert ledger.max_concurrent_requests == 99 // 32 == 3  # ceil(500 / 16) = 32 blocks per request
    assert ledger.headroom_bytes == 12345
    assert ledger.context_len == 500


def test_plan_memory_defaults_context_to_model_max():
    ledger = plan_memory(
        LLAMA2_7B, memory_budget_bytes=80 * GiB, weight_dtype="float16", kv_dtype="float16"
    )
    assert ledger.context_len == 4096
    assert ledger.max_concurrent_requests == ledger.num_usable_kv_blocks // 256
    assert 0 <= ledger.headroom_bytes < ledger.kv_bytes_per_block


def test_insufficient_memory_boundary():
    minimum = 2 * 6738415616 + 301465600 + 2 * 8 * MiB
    ledger = plan_memory(
        LLAMA2_7B, memory_budget_bytes=minimum, weight_dtype="float16", kv_dtype="float16"
    )
    assert (
        ledger.num_kv_blocks == 2
        and ledger.num_kv_tokens == 16
        and ledger.max_concurrent_requests == 0
    )
    with pytest.raises(InsufficientMemoryError, match=f"below the minimum .*{minimum} B") as info:
        plan_memory(
            LLAMA2_7B, memory_budget_bytes=minimum - 1, weight_dtype="float16", kv_dtype="float16"
        )
    assert isinstance(info.value, ValueError)
    assert "weights 12.55 GiB" in str(info.value)


def test_plan_memory_rejects_bad_arguments():
    kwargs: dict[str, Any] = dict(
        memory_budget_bytes=80 * GiB, weight_dtype="float16", kv_dtype="float16"
    )
    for bad in (
        dict(block_size=0),
        dict(context_len=0),
        dict(max_num_seqs=0),
        dict(kv_dtype="int4"),
    ):
        with pytest.raises(ValueError):
            plan_memory(LLAMA2_7B, **{**kwargs, **bad})


def test_format_ledger_table():
    ledger = plan_memory(
        LLAMA2_7B,
        memory_budget_bytes=80 * GiB,
        weight_dtype="float16",
        kv_dtype="float16",
        context_len=2048,
    )
    text = format_ledger(ledger, LLAMA2_7B)
    for label in (
        "weights",
        "activations",
        "kv per token",
        "kv per block",
        "kv blocks",
        "kv tokens",
        "concurrent requests",
        "budget",
        "headroom",
    ):
        assert label in text
    assert "512 KiB" in text and "8 MiB" in text and f"{ledger.num_kv_blocks:,}" in text
    width = len("concurrent requests") + 2  # the longest label and two spaces
    for line in text.splitlines():
        assert line[width - 2 : width] == "  " and line[width] != " ", (
            line
        )  # one aligned value column


def test_dtype_table():
    assert DTYPE_BYTES == {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "fp8": 1}


def test_known_configs_and_aliases():
    assert set(KNOWN_CONFIGS) == {
        "llama-2-7b",
        "llama-2-13b",
        "llama-3-8b",
        "llama-3-70b",
        "mistral-7b",
        "smollm2-135m",
    }
    assert resolve_config("LLaMA-3-8B") is KNOWN_CONFIGS["llama-3-8b"]
    assert resolve_config("meta-llama/Meta-Llama-3-8B") is KNOWN_CONFIGS["llama-3-8b"]
    assert resolve_model("llama-2-7b").num_params is None
    mistral = KNOWN_CONFIGS["mistral-7b"]
    assert (mistral.rope_theta, mistral.max_position_embeddings, mistral.num_kv_heads) == (
        1e6,
        32768,
        8,
    )


def test_resolve_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        resolve_config(str(missing))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        resolve_config(str(tmp_path))
    other = tmp_path / "model.bin"
    other.write_bytes(b"x")
    with pytest.raises(UnsupportedModelError, match=r"model\.bin"):
        resolve_config(str(other))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(UnsupportedModelError, match=r"fake\.gguf"):
        resolve_config(str(fake))


def _write_safetensors(path, shapes):
    header = {
        name: {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}
        for name, shape in shapes.items()
    }
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_resolve_hf_directory_counts_tensors(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 100,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 256,
                "tie_word_embeddings": True,
            }
        )
    )
    _write_safetensors(
        tmp_path / "model.safetensors",
        {
            "model.embed_tokens.weight": [100, 64],
            "model.norm.weight": [64],
            "model.layers.0.self_attn.rotary_emb.inv_freq": [8],
        },
    )
    model = resolve_model(str(tmp_path))
    assert model.config.num_kv_heads == 2 and model.config.head_dim == 16
    assert model.config.name == tmp_path.name
    assert model.num_params == 100 * 64 + 64  # inv_freq is a buffer, not a parameter


@pytest.fixture(scope="module")
def smollm2():
    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return resolve_model(None)


def test_smollm2_gguf_matches_known_shapes(smollm2):
    known = KNOWN_CONFIGS["smollm2-135m"]
    for name in SHAPE_FIELDS:
        assert getattr(smollm2.config, name) == getattr(known, name), name
    assert math.isclose(smollm2.config.rms_norm_eps, known.rms_norm_eps, rel_tol=1e-6)
    assert smollm2.num_params == known.num_params() == 134515008
    assert replace(smollm2.config, name="x", rms_norm_eps=1e-5) == replace(known, name="x")
