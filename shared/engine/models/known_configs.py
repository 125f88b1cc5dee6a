"""Published model shapes by name, and resolution of ``--model NAME_OR_PATH`` to a ``ModelConfig``.

Known names let ``llmserve plan`` size a deployment for a model that is not on this machine. Paths
are read for metadata only (GGUF header, ``config.json``, safetensors headers): no weights are
loaded and torch is not imported.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from shared.engine.default_model import default_model_path
from shared.engine.models.config import ModelConfig, UnsupportedModelError
from shared.engine.quantization import GGUF_BLOCK_BYTES, GGUF_LINEAR_PARTS


def _llama(
    name: str,
    *,
    layers: int,
    hidden: int,
    inter: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    ctx: int,
    theta: float = 10000.0,
    arch: str = "llama",
    tied: bool = False,
    head_dim: int | None = None,
) -> ModelConfig:
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        rms_norm_eps=1e-5,
        rope_theta=theta,
        max_position_embeddings=ctx,
        tie_word_embeddings=tied,
        name=name,
    )


# Shapes from each model's published config.json. Llama-3 rope scaling is absent because it applies
# only to Llama-3.1+, not to the 3.0 models listed here.
KNOWN_CONFIGS: dict[str, ModelConfig] = {
    "llama-2-7b": _llama(
        "llama-2-7b",
        layers=32,
        hidden=4096,
        inter=11008,
        heads=32,
        kv_heads=32,
        vocab=32000,
        ctx=4096,
    ),
    "llama-2-13b": _llama(
        "llama-2-13b",
        layers=40,
        hidden=5120,
        inter=13824,
        heads=40,
        kv_heads=40,
        vocab=32000,
        ctx=4096,
    ),
    "llama-3-8b": _llama(
        "llama-3-8b",
        layers=32,
        hidden=4096,
        inter=14336,
        heads=32,
        kv_heads=8,
        vocab=128256,
        ctx=8192,
        theta=500000.0,
    ),
    "llama-3-70b": _llama(
        "llama-3-70b",
        layers=80,
        hidden=8192,
        inter=28672,
        heads=64,
        kv_heads=8,
        vocab=128256,
        ctx=8192,
        theta=500000.0,
    ),
    # Mistral-7B v0.2: full attention over 32k positions, theta 1e6. (v0.1 used a 4096-token sliding
    # window, which this runtime does not implement, so its KV sizing would not match.)
    "mistral-7b": _llama(
        "mistral-7b",
        layers=32,
        hidden=4096,
        inter=14336,
        heads=32,
        kv_heads=8,
        vocab=32000,
        ctx=32768,
        theta=1e6,
        arch="mistral",
    ),
    "smollm2-135m": _llama(
        "smollm2-135m",
        layers=30,
        hidden=576,
        inter=1536,
        heads=9,
        kv_heads=3,
        head_dim=64,
        vocab=49152,
        ctx=8192,
        theta=100000.0,
        tied=True,
    ),
}

# Lower-cased alternative spellings (Hugging Face repo ids included) -> KNOWN_CONFIGS key.
_ALIASES: dict[str, str] = {
    "meta-llama/llama-2-7b-hf": "llama-2-7b",
    "meta-llama/llama-2-7b-chat-hf": "llama-2-7b",
    "llama2-7b": "llama-2-7b",
    "meta-llama/llama-2-13b-hf": "llama-2-13b",
    "meta-llama/llama-2-13b-chat-hf": "llama-2-13b",
    "llama2-13b": "llama-2-13b",
    "meta-llama/meta-llama-3-8b": "llama-3-8b",
    "meta-llama/meta-llama-3-8b-instruct": "llama-3-8b",
    "llama3-8b": "llama-3-8b",
    "meta-llama/meta-llama-3-70b": "llama-3-70b",
    "meta-llama/meta-llama-3-70b-instruct": "llama-3-70b",
    "llama3-70b": "llama-3-70b",
    "mistralai/mistral-7b-instruct-v0.2": "mistral-7b",
    "mistral-7b-v0.2": "mistral-7b",
    "huggingfacetb/smollm2-135m": "smollm2-135m",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m",
    "smollm2": "smollm2-135m",
}


@dataclass(frozen=True)
class ResolvedModel:
    config: ModelConfig
    num_params: int | None  # counted from the tensors on disk; None for a known name
    path: Path | None
    # A GGUF file's block format per decoder linear (``memory.weight_bytes``' gguf_formats), where
    # the kernels run it on its blocks; None for a known name or a safetensors directory.
    gguf_formats: tuple[str | None, ...] | None = None
    # The output head's block format likewise (``memory.weight_bytes``' gguf_head_format).
    gguf_head_format: str | None = None


def known_config(name: str) -> ModelConfig | None:
    key = name.strip().lower()
    return KNOWN_CONFIGS.get(_ALIASES.get(key, key))


def resolve_model(name_or_path: str | Path | None) -> ResolvedModel:
    """A known name, a Hugging Face directory, a ``.gguf`` file, or None for the default model."""
    if isinstance(name_or_path, str) and (config := known_config(name_or_path)) is not None:
        return ResolvedModel(config=config, num_params=None, path=None)
    path = Path(default_model_path()) if name_or_path is None else Path(name_or_path).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.is_dir():
        return _resolve_hf_dir(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UnsupportedModelError(
                f"{path}: expected a .gguf file or a directory with config.json"
            )
        return _resolve_gguf(path)
    raise FileNotFoundError(
        f"model {str(name_or_path)!r} is neither a known name "
        f"({', '.join(KNOWN_CONFIGS)}) nor an existing path"
    )


def resolve_config(name_or_path: str | Path | None) -> ModelConfig:
    return resolve_model(name_or_path).config


def _resolve_hf_dir(path: Path) -> ResolvedModel:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path}: directory has no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file}: invalid JSON ({exc})") from exc
    raw.setdefault("_name_or_path", path.name)
    config = ModelConfig.from_hf_config(raw)
    files = sorted(path.glob("*.safetensors"))
    num_params = sum(_count_safetensors(f) for f in files) if files else None
    return ResolvedModel(config=config, num_params=num_params, path=path)


def _count_safetensors(path: Path) -> int:
    """Elements of every parameter tensor, read from the header (8-byte little-endian length +
    JSON)."""
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return sum(
        math.prod(info["shape"])
        for name, info in header.items()
        if name != "__metadata__" and not name.endswith("rotary_emb.inv_freq")
    )


def _gguf_format(tensor) -> str | None:
    """A GGUF tensor's block format where the kernels run it on its blocks, else None."""
    fmt = None if tensor is None else tensor.tensor_type.name.lower()
    return fmt if fmt in GGUF_BLOCK_BYTES else None


def _gguf_linear_formats(tensors: dict, num_layers: int) -> tuple[str | None, ...]:
    """Per decoder linear, layer by layer: the block format all its GGUF parts share, where the
    kernels run it on its blocks (``quantization="gguf"``), else None."""
    formats: list[str | None] = []
    for i in range(num_layers):
        for _, parts in GGUF_LINEAR_PARTS:
            found = {_gguf_format(tensors.get(f"blk.{i}.{p}.weight")) for p in parts}
            formats.append(found.pop() if len(found) == 1 else None)
    return tuple(formats)


def _resolve_gguf(path: Path) -> ResolvedModel:
    import gguf  # numpy-backed; imported here so that known names need neither
    import numpy as np

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise UnsupportedModelError(f"{path}: not a readable GGUF file ({exc})") from exc
    fields = {key: field.contents() for key, field in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    freq_factors = None
    if (rope := tensors.get("rope_freqs.weight")) is not None:
        if rope.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise UnsupportedModelError(
                f"{path}: rope_freqs.weight has type {rope.tensor_type.name}"
            )
        freq_factors = tuple(float(x) for x in np.asarray(rope.data, dtype=np.float32).reshape(-1))
    config = ModelConfig.from_gguf_fields(
        fields,
        has_output_tensor="output.weight" in tensors,
        has_qkv_bias="blk.0.attn_q.bias" in tensors,
        rope_freq_factors=freq_factors,
    )
    # rope_freqs is a constant table, not a parameter the runtime holds in the weight dtype.
    num_params = sum(
        int(t.n_elements) for name, t in tensors.items() if name != "rope_freqs.weight"
    )
    return ResolvedModel(
        config=config,
        num_params=num_params,
        path=path,
        gguf_formats=_gguf_linear_formats(tensors, config.num_layers),
        gguf_head_format=_gguf_format(
            tensors.get("token_embd.weight" if config.tie_word_embeddings else "output.weight")
        ),
    )
