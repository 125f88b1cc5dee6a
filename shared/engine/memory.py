"""The exact memory ledger: weights + activations + KV cache = the configured budget.

``plan_memory`` is the single source of truth for the size of the KV pool: the runtime allocates
exactly ``MemoryLedger.num_kv_blocks`` blocks, and ``llmserve plan`` prints the same ledger, so what
a user plans is what the executor gets.

KV pool layout (one K and one V tensor per layer, see ``kv_cache.py``)::

    block:  0        1        2            num_kv_blocks-1
          [ pad  ][ usable ][ usable ] ... [ usable ]     each block = block_size token slots
            ^ reserved: padded slot-mapping entries point here, never owned by a request

so the usable capacity is ``num_kv_blocks - 1`` blocks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from shared.engine.models.config import ModelConfig
from shared.engine.quantization import (
    GGUF_BLOCK,
    GGUF_BLOCK_BYTES,
    GGUF_PANEL_ROWS,
    INT4_HEAD_FORMAT,
    INT4_LINEAR_FORMAT,
    KV_SCALE_BYTES,
    SCALED_KV_CACHE_DTYPES,
)

# Bytes per element. int8/fp8 exist for quantized KV caches; weights use the first three.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "fp8": 1,
}
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}

# Unit suffixes, matched case-insensitively: IEC binary (KiB = 1024) and SI decimal (KB = 1000).
# A bare letter (K, M, G, T) is decimal, as in Kubernetes quantities; "Ki"/"Gi" are binary.
_UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _UNITS[f"{_p}ib"] = _UNITS[f"{_p}i"] = 1024**_i
    _UNITS[f"{_p}b"] = _UNITS[_p] = 1000**_i
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_FORMAT_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


class InsufficientMemoryError(ValueError):
    """The budget cannot hold the weights, the activations and a minimal KV pool."""


def dtype_bytes(dtype: str) -> int:
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def parse_bytes(text: str | int) -> int:
    """``"80GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"1024"`` -> bytes (fractions of a byte round
    down)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"memory size must not be negative, got {text}")
        return text
    match = _BYTES_RE.match(str(text))
    if match is None:
        raise ValueError(
            f"cannot parse memory size {text!r}; expected e.g. 80GiB, 512MiB, 1.5GB or 1024"
        )
    number, unit = match.groups()
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(
            f"unknown unit {unit!r} in {text!r}; use B, KiB, MiB, GiB, TiB or KB, MB, GB, TB"
        )
    try:
        value = (
            Decimal(number) * scale
        )  # Decimal: "1.1GB" must be exactly 1_100_000_000, no float error
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimal numerals
        raise ValueError(f"cannot parse memory size {text!r}") from exc
    return int(value)


def format_bytes(num_bytes: int) -> str:
    """Binary units, at most two decimals, trailing zeros dropped: 524288 -> '512 KiB'."""
    sign, value = ("-" if num_bytes < 0 else ""), float(abs(num_bytes))
    unit = 0
    while value >= 1024 and unit < len(_FORMAT_UNITS) - 1:
        value /= 1024
        unit += 1
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{sign}{text} {_FORMAT_UNITS[unit]}"


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str) -> int:
    """K and V, for every layer and KV head: 2 x num_layers x num_kv_heads x head_dim x bytes. An
    int8 or fp8 row also carries its fp32 scale: 2 x num_layers x num_kv_heads x (head_dim + 4),
    as the engine's scaled caches hold it (``shared/engine/kv_cache.py``)."""
    row = (
        config.head_dim + KV_SCALE_BYTES
        if kv_dtype in SCALED_KV_CACHE_DTYPES
        else config.head_dim * dtype_bytes(kv_dtype)
    )
    return 2 * config.num_layers * config.num_kv_heads * row


def decoder_linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of one decoder layer's linears as the engine holds them: fused
    QKV, O, fused gate-up, down."""
    h, i = config.hidden_size, config.intermediate_size
    return [(config.q_size + 2 * config.kv_size, h), (h, config.q_size), (2 * i, h), (h, i)]


def gguf_linear_bytes(out_features: int, in_features: int, fmt: str) -> int:
    """Bytes of one linear held in GGUF blocks of ``fmt`` as the kernels' panels hold them (rows
    padded to a multiple of 16)."""
    if fmt not in GGUF_BLOCK_BYTES:
        raise ValueError(f"unknown GGUF block format {fmt!r}; known: {', '.join(GGUF_BLOCK_BYTES)}")
    rows = -(-out_features // GGUF_PANEL_ROWS) * GGUF_PANEL_ROWS
    return rows * (in_features // GGUF_BLOCK) * GGUF_BLOCK_BYTES[fmt]


def weight_bytes(
    config: ModelConfig,
    weight_dtype: str,
    num_params: int | None = None,
    quantization: str | None = None,
    gguf_formats: Sequence[str | None] | None = None,
    gguf_head_format: str | None = None,
) -> int:
    """Parameters x bytes. ``num_params`` overrides the count from shapes when the real tensors of a
    model on disk were counted. ``quantization="int8"``: the decoder linears' weights take one byte
    each, plus, per linear, an fp32 scale and an int32 column sum per output feature and an fp32
    smoothing factor per input feature (``shared/engine/models/int8_linear.py``); the embedding,
    norms, biases and output head stay in ``weight_dtype``. ``quantization="gguf"``: each decoder
    linear whose entry in ``gguf_formats`` (the file's block format per linear, layer by layer in
    ``decoder_linear_shapes`` order; None where it is not native) names a format takes that
    format's bytes (``gguf_linear_bytes``), and so does the output head where ``gguf_head_format``
    names one (a tied head's blocks come beside the embedding, which stays); the rest stay in
    ``weight_dtype``. ``quantization="int4"``: every decoder linear in ``INT4_LINEAR_FORMAT``
    and the head in ``INT4_HEAD_FORMAT``, whatever the checkpoint."""
    count = config.num_params() if num_params is None else num_params
    if quantization is None:
        return count * dtype_bytes(weight_dtype)
    shapes = decoder_linear_shapes(config)
    if quantization == "int4":  # what models/gguf_linear.py's quantize_model_int4 makes
        quantization = "gguf"
        gguf_formats = [INT4_LINEAR_FORMAT] * len(shapes) * config.num_layers
        gguf_head_format = INT4_HEAD_FORMAT
    if quantization == "gguf":
        if gguf_formats is None or len(gguf_formats) != len(shapes) * config.num_layers:
            raise ValueError(
                "quantization='gguf' needs the block format of each decoder linear "
                "(a GGUF file's: plan a .gguf model)"
            )
        native = [
            (shape, fmt)
            for shape, fmt in zip(shapes * config.num_layers, gguf_formats, strict=True)
            if fmt is not None
        ]
        if gguf_head_format is not None:
            native.append(((config.vocab_size, config.hidden_size), gguf_head_format))
        native_params = sum(n * k for (n, k), _ in native)
        if gguf_head_format is not None and config.tie_word_embeddings:
            native_params -= config.vocab_size * config.hidden_size  # the embedding stays
        blocks = sum(gguf_linear_bytes(n, k, fmt) for (n, k), fmt in native)
        return (count - native_params) * dtype_bytes(weight_dtype) + blocks
    if quantization != "int8":
        raise ValueError(f"unknown quantization {quantization!r}")
    linear = config.num_layers * sum(n * k for n, k in shapes)
    extras = config.num_layers * sum(8 * n + 4 * k for n, k in shapes)
    return (count - linear) * dtype_bytes(weight_dtype) + linear + extras


def activation_bytes(
    config: ModelConfig,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    dtype: str,
    quantization: str | None = None,
) -> int:
    """Conservative peak transient memory of one forward pass over a full token budget.

    With T = max_num_batched_tokens, h = hidden, q = num_heads x head_dim, kv = num_kv_heads x
    head_dim, i = intermediate, V = vocab, R = min(max_num_seqs, T), b = bytes of ``dtype``::

        T x (2h           residual stream + its RMS-normed copy
             + (q + 2kv)  fused QKV projection output
             + q          attention output
             + 2i         fused gate/up projection output
             + i) x b     SwiGLU product silu(gate) * up
        + R x V x 4 x 2   fp32 logits of the sampled rows, and the sampler's working copy
        + T x (i + 4)     int8 only: a linear's input quantized (at most i bytes) and its row scale
        + T x 5i/4        gguf, int4: a linear's input quantized per 32-block (at most i bytes) and
                          each block's fp32 scale and int32 sum

    Every buffer is counted as if alive at once (an upper bound: layers run one at a time, so only
    one layer's buffers exist). R <= T because every scheduled sequence puts at least one token in
    the step. Attention is assumed paged/fused, never materializing a T x context score matrix.
    """
    if max_num_batched_tokens <= 0 or max_num_seqs <= 0:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) and max_num_seqs "
            f"({max_num_seqs}) must be positive"
        )
    h, i = config.hidden_size, config.intermediate_size
    per_token = 2 * h + (config.q_size + 2 * config.kv_size) + config.q_size + 2 * i + i
    rows = min(max_num_seqs, max_num_batched_tokens)
    widest = max(k for _, k in decoder_linear_shapes(config))
    blocks = widest + widest // GGUF_BLOCK * 8
    quantized = {"int8": widest + 4, "gguf": blocks, "int4": blocks}.get(quantization or "", 0)
    return (
        max_num_batched_tokens * (per_token * dtype_bytes(dtype) + quantized)
        + rows * config.vocab_size * 4 * 2
    )


@dataclass(frozen=True)
class MemoryLedger:
    """Where the budget goes. ``num_kv_blocks`` counts the whole pool, padding block 0 included."""

    memory_budget_bytes: int
    weight_dtype: str
    kv_dtype: str
    num_params: int
    weight_bytes: int
    activation_bytes: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    num_kv_blocks: int
    num_kv_tokens: int  # usable blocks x block_size: tokens that requests can actually hold
    context_len: int
    max_concurrent_requests: int  # full-context requests that fit at once in the usable blocks
    quantization: str | None = None

    @property
    def num_usable_kv_blocks(self) -> int:
        return self.num_kv_blocks - 1

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_bytes_per_block

    @property
    def headroom_bytes(self) -> int:
        """Budget left over: less than one block, since the pool takes every whole block that
        fits."""
        return (
            self.memory_budget_bytes
            - self.weight_bytes
            - self.activation_bytes
            - self.kv_cache_bytes
        )


def plan_memory(
    config: ModelConfig,
    *,
    memory_budget_bytes: int,
    weight_dtype: str,
    kv_dtype: str,
    block_size: int = 16,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    context_len: int | None = None,
    num_params: int | None = None,
    resident_weight_bytes: int | None = None,
    quantization: str | None = None,
    gguf_formats: Sequence[str | None] | None = None,
    gguf_head_format: str | None = None,
) -> MemoryLedger:
    """Size the KV pool from the budget: floor((budget - weights - activations) / bytes per block).
    ``resident_weight_bytes``: what a loaded model really holds (packed weights, and the tied head's
    packed copy next to the embedding), used instead of params x dtype bytes when given."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if memory_budget_bytes < 0:
        raise ValueError(f"memory budget must not be negative, got {memory_budget_bytes}")
    context = config.max_position_embeddings if context_len is None else context_len
    if context <= 0:
        raise ValueError(f"context_len must be positive, got {context}")
    params = config.num_params() if num_params is None else num_params
    weights = (
        weight_bytes(config, weight_dtype, params, quantization, gguf_formats, gguf_head_format)
        if resident_weight_bytes is None
        else resident_weight_bytes
    )
    activations = activation_bytes(
        config, max_num_batched_tokens, max_num_seqs, weight_dtype, quantization
    )
    per_token = kv_bytes_per_token(config, kv_dtype)
    per_block = per_token * block_size
    # The padding block plus one usable block is the smallest pool that can run anything.
    minimum = weights + activations + 2 * per_block
    if memory_budget_bytes < minimum:
        raise InsufficientMemoryError(
            f"memory budget {format_bytes(memory_budget_bytes)} ({memory_budget_bytes} B) "
            f"is below the minimum {format_bytes(minimum)} ({minimum} B): "
            f"weights {format_bytes(weights)} + "
            f"activations {format_bytes(activations)} + 2 KV blocks of {format_bytes(per_block)}"
        )
    num_blocks = (memory_budget_bytes - weights - activations) // per_block
    usable = num_blocks - 1
    return MemoryLedger(
        memory_budget_bytes=memory_budget_bytes,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        num_params=params,
        weight_bytes=weights,
        activation_bytes=activations,
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        kv_bytes_per_token=per_token,
        kv_bytes_per_block=per_block,
        num_kv_blocks=num_blocks,
        num_kv_tokens=usable * block_size,
        context_len=context,
        max_concurrent_requests=usable // math.ceil(context / block_size),
        quantization=quantization,
    )


def format_ledger(ledger: MemoryLedger, config: ModelConfig) -> str:
    """An aligned, human-readable table of the ledger."""
    budget = ledger.memory_budget_bytes

    def share(num_bytes: int) -> str:
        return (
            f"{format_bytes(num_bytes)}  ({100 * num_bytes / budget:.1f}%)"
            if budget
            else format_bytes(num_bytes)
        )

    rows = [
        ("model", config.name or config.architecture),
        (
            "shape",
            f"{config.num_layers} layers, hidden {config.hidden_size}, {config.num_heads} heads, "
            f"{config.num_kv_heads} kv heads x {config.head_dim}",
        ),
        ("budget", f"{format_bytes(budget)}  ({budget} B)"),
        (
            "weights",
            f"{share(ledger.weight_bytes)}  [{ledger.num_params:,} params, {ledger.weight_dtype}"
            + (f", {ledger.quantization} decoder linears]" if ledger.quantization else "]"),
        ),
        (
            "activations",
            f"{share(ledger.activation_bytes)}  [{ledger.max_num_batched_tokens} batched "
            f"tokens, {ledger.max_num_seqs} seqs]",
        ),
        ("kv cache", f"{share(ledger.kv_cache_bytes)}  [{ledger.kv_dtype}]"),
        ("kv per token", format_bytes(ledger.kv_bytes_per_token)),
        (
            "kv per block",
            f"{format_bytes(ledger.kv_bytes_per_block)}  [{ledger.block_size} tokens]",
        ),
        (
            "kv blocks",
            f"{ledger.num_kv_blocks:,}  "
            f"(block 0 is padding: {ledger.num_usable_kv_blocks:,} usable)",
        ),
        ("kv tokens", f"{ledger.num_kv_tokens:,}"),
        (
            "concurrent requests",
            f"{ledger.max_concurrent_requests:,}  at context {ledger.context_len:,}",
        ),
        ("headroom", format_bytes(ledger.headroom_bytes)),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    if ledger.context_len > config.max_position_embeddings:
        lines.append(
            f"note: context {ledger.context_len} exceeds the model's maximum of "
            f"{config.max_position_embeddings} positions"
        )
    if ledger.max_concurrent_requests == 0:
        lines.append(f"note: not one request of {ledger.context_len} tokens fits in the KV cache")
    return "\n".join(lines)
