"""Model architecture description, read from GGUF metadata or a Hugging Face ``config.json``.

One frozen value object feeds the model, the KV-cache sizing and the memory ledger, so all three
agree on layer counts, head shapes and dtypes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.field_checks import require_positive

if TYPE_CHECKING:
    import torch

# Architectures the Llama implementation covers. Qwen2 is Llama plus a bias on Q/K/V.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")

_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


class UnsupportedModelError(ValueError):
    """The model file describes something this runtime cannot run (named in the message)."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is 'linear' or 'llama3'; GGUF files carry Llama-3 scaling as
    per-frequency factors (``freq_factors``) instead of parameters."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        require_positive(
            self,
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count from shapes alone (what the memory ledger uses for models not on
        disk)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = _HF_ARCHITECTURES.get(archs[0]) if archs else cfg.get("model_type")
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs[0]!r}; supported: {', '.join(_HF_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=_hf_rope_scaling(rope),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            name=cfg.get("_name_or_path", ""),
        )

    @classmethod
    def from_gguf_fields(
        cls,
        fields: dict[str, Any],
        *,
        has_output_tensor: bool,
        has_qkv_bias: bool,
        rope_freq_factors: tuple[float, ...] | None,
    ) -> ModelConfig:
        """``fields`` maps GGUF metadata keys to plain Python values."""
        arch = fields.get("general.architecture", "?")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def key(name: str, default: Any = None) -> Any:
            value = fields.get(f"{arch}.{name}", default)
            if value is None:
                raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{name}")
            return value

        hidden = key("embedding_length")
        num_heads = key("attention.head_count")
        num_kv_heads = key("attention.head_count_kv", num_heads)
        head_dim = fields.get(f"{arch}.attention.key_length") or hidden // num_heads
        vocab = fields.get(f"{arch}.vocab_size") or len(fields.get("tokenizer.ggml.tokens", ()))
        scaling = None
        if rope_freq_factors is not None:
            scaling = RopeScaling(kind="freq_factors", freq_factors=rope_freq_factors)
        elif fields.get(f"{arch}.rope.scaling.type") == "linear":
            scaling = RopeScaling(
                kind="linear", factor=float(fields[f"{arch}.rope.scaling.factor"])
            )
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            num_layers=key("block_count"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=key("context_length", 2048),
            tie_word_embeddings=not has_output_tensor,
            qkv_bias=has_qkv_bias,
            name=fields.get("general.name", ""),
        )


def _hf_rope_scaling(rope: dict[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(rope["factor"]),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings", 8192)
            ),
        )
    raise UnsupportedModelError(
        f"unsupported rope scaling type {kind!r}; supported: linear, llama3"
    )


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding (fp32, one per pair of dimensions), scaling
    applied.

    The base is computed exactly as Hugging Face does (int64 arange cast to fp32) so positions agree
    bit for bit with the reference implementation."""
    import torch

    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = config.rope_scaling
    if s is None:
        return inv
    if s.kind == "linear":
        return inv / s.factor
    if s.kind == "freq_factors":
        assert s.freq_factors is not None and len(s.freq_factors) == inv.numel()
        return inv / torch.tensor(s.freq_factors, dtype=torch.float32)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    old_ctx = s.original_max_position_embeddings
    low_wavelen = old_ctx / s.low_freq_factor
    high_wavelen = old_ctx / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)
