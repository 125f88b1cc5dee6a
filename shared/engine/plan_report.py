"""``llmserve plan`` as data: the memory ledger of a model and budget as one JSON-ready dict.

The one function behind both ``llmserve plan --json`` and the gateway's console (its capacity
planner form), so the two print the same numbers. Torch-free: a known name needs only the table of
shapes, a GGUF file only its header (the ``gguf`` reader).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from shared.engine.memory import format_bytes, parse_bytes, plan_memory
from shared.engine.models.known_configs import KNOWN_CONFIGS, resolve_model
from shared.engine.quantization import kv_dtype_name

WEIGHT_DTYPES = ("float16", "bfloat16", "float32")
KV_DTYPES = ("auto", "float16", "bfloat16", "float32", "int8", "fp8")
# The names a form may choose from (a path is for the command line only).
KNOWN_MODEL_NAMES = tuple(KNOWN_CONFIGS)


def plan_report(
    model: str | Path | None,
    *,
    memory: str | int,
    dtype: str = "float16",
    kv_dtype: str = "auto",
    quantization: str | None = None,
    block_size: int = 16,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    context: int | None = None,
) -> dict[str, Any]:
    """The ledger of ``model`` (a known name, a .gguf file, a Hugging Face directory; None: the
    default model). ValueError (InsufficientMemoryError among them) for settings that cannot be
    planned; FileNotFoundError for an unknown model."""
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    resolved = resolve_model(model)
    ledger = plan_memory(
        resolved.config,
        memory_budget_bytes=parse_bytes(memory),
        weight_dtype=dtype,
        kv_dtype=kv_dtype_name(kv_dtype, dtype),
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        context_len=context,
        num_params=resolved.num_params,
        quantization=quantization,
        gguf_formats=resolved.gguf_formats,
        gguf_head_format=resolved.gguf_head_format,
    )
    config = resolved.config
    notes = []
    if ledger.context_len > config.max_position_embeddings:
        notes.append(
            f"context {ledger.context_len} exceeds the model's maximum of "
            f"{config.max_position_embeddings} positions"
        )
    if ledger.max_concurrent_requests == 0:
        notes.append(f"not one request of {ledger.context_len} tokens fits in the KV cache")
    return {
        "model": config.name or config.architecture,
        **dataclasses.asdict(ledger),
        "num_usable_kv_blocks": ledger.num_usable_kv_blocks,
        "kv_cache_bytes": ledger.kv_cache_bytes,
        "headroom_bytes": ledger.headroom_bytes,
        "shape": {
            "num_layers": config.num_layers,
            "hidden_size": config.hidden_size,
            "num_heads": config.num_heads,
            "num_kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
            "max_position_embeddings": config.max_position_embeddings,
        },
        "readable": {
            name: format_bytes(getattr(ledger, name))
            for name in (
                "memory_budget_bytes",
                "weight_bytes",
                "activation_bytes",
                "kv_cache_bytes",
                "kv_bytes_per_token",
                "kv_bytes_per_block",
                "headroom_bytes",
            )
        },
        "notes": notes,
    }
