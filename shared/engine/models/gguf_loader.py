"""Read a GGUF file: metadata → ModelConfig, tensors → Hugging Face-named fp tensors.

llama.cpp's converter permutes the rows of Q and K for its interleaved RoPE; the model here uses the
Hugging Face half-split layout, so those rows are permuted back on load (Llama/Mistral only; Qwen2
GGUFs are written unpermuted).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from shared.engine.models.config import ModelConfig, UnsupportedModelError

_FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
# The block formats the kernels run in place (``models/gguf_linear.py``), by their names there.
NATIVE_FORMATS = {
    GGMLQuantizationType.Q4_0: "q4_0",
    GGMLQuantizationType.Q4_1: "q4_1",
    GGMLQuantizationType.Q8_0: "q8_0",
}

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
# Tensors that carry configuration, not parameters.
_SKIPPED = {"rope_freqs.weight"}


def open_gguf(path: str) -> GGUFReader:
    if not os.path.exists(path):
        raise FileNotFoundError(f"model file not found: {path}")
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as e:
        raise UnsupportedModelError(f"{path} is not a readable GGUF file: {e}") from e


def gguf_fields(reader: GGUFReader) -> dict[str, Any]:
    """Metadata as plain Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def gguf_model_config(reader: GGUFReader) -> ModelConfig:
    names = {t.name for t in reader.tensors}
    freq_factors = None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            freq_factors = tuple(float(x) for x in _to_numpy(t))
    return ModelConfig.from_gguf_fields(
        gguf_fields(reader),
        has_output_tensor="output.weight" in names,
        has_qkv_bias="blk.0.attn_q.bias" in names,
        rope_freq_factors=freq_factors,
    )


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise UnsupportedModelError(f"unexpected tensor {gguf_name!r} in GGUF file")


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: per head, rows (0, 2, 4, …, 1, 3, 5, …) ← interleaved
    pairs."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def _to_numpy(tensor) -> np.ndarray:
    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        data = dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise UnsupportedModelError(
            f"tensor {tensor.name!r} uses quantization type {qtype.name}, "
            "which cannot be dequantized "
            "(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants)"
        ) from e
    # GGUF lists dimensions innermost first; numpy's shape is the reverse, which is torch's [out,
    # in]. A copy: F32 tensors come back as views of the read-only memory map.
    return np.array(data, dtype=np.float32).reshape(tuple(reversed([int(d) for d in tensor.shape])))


def rope_permuted(config: ModelConfig) -> bool:
    """Whether the file holds Q and K rows in llama.cpp's interleaved order (see the module doc)."""
    return config.architecture in ("llama", "mistral")


def native_format(tensor) -> str | None:
    """The block format a tensor's data can run in as it is, or None."""
    return NATIVE_FORMATS.get(GGMLQuantizationType(tensor.tensor_type))


def tensor_rows(tensor) -> np.ndarray:
    """A tensor's raw data as rows (uint8 [out, bytes per row] for a block format)."""
    return np.asarray(tensor.data)


def read_tensor(tensor) -> torch.Tensor:
    """One tensor dequantized to fp32, in torch's [out, in] shape (no row permutation)."""
    return torch.from_numpy(_to_numpy(tensor))


def iter_gguf_weights(
    reader: GGUFReader,
    config: ModelConfig,
    dtype: torch.dtype,
    skip: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor by its Hugging Face name, in ``dtype``, but those named in ``skip`` (loaded
    another way: ``models/gguf_linear.py``)."""
    unpermute = rope_permuted(config)
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or name in skip:
            continue
        w = torch.from_numpy(_to_numpy(t))
        if unpermute and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rope_rows(w, config.num_heads)
        elif unpermute and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rope_rows(w, config.num_kv_heads)
        yield name, w.to(dtype)
