"""The memory ledger (``shared/engine/memory.py``, what ``llmserve plan`` prints): KV bytes per
token and the tokens that fit, for published model shapes and several memory sizes, checked
against the textbook formula 2 x layers x kv_heads x head_dim x bytes. Pure arithmetic: nothing is
timed, so it is the same on every host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loadtests.report.model import MEASURED, Figure, Section, Series, Table
from loadtests.report.plan import Plan
from shared.engine.memory import (
    InsufficientMemoryError,
    dtype_bytes,
    kv_bytes_per_token,
    parse_bytes,
    plan_memory,
)
from shared.engine.models.config import ModelConfig
from shared.engine.models.known_configs import KNOWN_CONFIGS

KEY = "memory_ledger"
SOURCE = f"raw/{KEY}.json"
MODELS = ("llama-3-8b", "llama-2-7b", "llama-3-70b", "smollm2-135m")
DTYPE = "bfloat16"


def formula_bytes_per_token(config: ModelConfig, dtype: str) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes(dtype)


def model_rows(
    names: Sequence[str], memory: Sequence[str], context: int, dtype: str = DTYPE
) -> list[dict[str, Any]]:
    """Per model: its shape, the formula's and the ledger's KV bytes per token (bf16 and int8 KV)
    and, per memory size, what the ledger plans (weights, KV tokens, requests at ``context``), or
    that the weights alone do not fit."""
    rows = []
    for name in names:
        cfg = KNOWN_CONFIGS[name]
        plans: dict[str, Any] = {}
        for size in memory:
            budget = parse_bytes(size)
            try:
                ledger = plan_memory(
                    cfg,
                    memory_budget_bytes=budget,
                    weight_dtype=dtype,
                    kv_dtype=dtype,
                    context_len=context,
                )
            except InsufficientMemoryError:
                plans[size] = {"fits": False}
                continue
            free = budget - ledger.weight_bytes - ledger.activation_bytes
            plans[size] = {
                "fits": True,
                "weight_bytes": ledger.weight_bytes,
                "activation_bytes": ledger.activation_bytes,
                "kv_cache_bytes": ledger.kv_cache_bytes,
                "num_kv_tokens": ledger.num_kv_tokens,
                # the formula alone: every free byte holds KV, no block rounding, no padding block
                "formula_kv_tokens": free // formula_bytes_per_token(cfg, dtype),
                "max_concurrent_requests": ledger.max_concurrent_requests,
            }
        rows.append(
            {
                "model": name,
                "layers": cfg.num_layers,
                "kv_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim,
                "num_params": cfg.num_params(),
                "formula_bytes_per_token": formula_bytes_per_token(cfg, dtype),
                "ledger_bytes_per_token": kv_bytes_per_token(cfg, dtype),
                "ledger_int8_bytes_per_token": kv_bytes_per_token(cfg, "int8"),
                "plans": plans,
            }
        )
    return rows


def measure(plan: Plan, log: Any = None) -> dict[str, Any]:
    return {
        "dtype": DTYPE,
        "context": plan.ledger_context,
        "memory": list(plan.ledger_memory),
        "block_size": 16,
        "models": model_rows(MODELS, plan.ledger_memory, plan.ledger_context),
    }


def build(raw: dict[str, Any]) -> Section:
    models, memory, ctx = raw["models"], raw["memory"], raw["context"]
    per_token = Table(
        title="KV cache bytes per token: the formula vs the ledger",
        columns=[
            "model",
            "layers",
            "kv heads",
            "head dim",
            "formula bf16 (KiB/token)",
            "ledger bf16 (KiB/token)",
            "ledger int8 KV (KiB/token)",
            "formula = ledger",
        ],
        rows=[
            [
                m["model"],
                m["layers"],
                m["kv_heads"],
                m["head_dim"],
                m["formula_bytes_per_token"] / 1024,
                m["ledger_bytes_per_token"] / 1024,
                m["ledger_int8_bytes_per_token"] / 1024,
                m["formula_bytes_per_token"] == m["ledger_bytes_per_token"],
            ]
            for m in models
        ],
        source=SOURCE,
    )
    fits = Table(
        title=f"KV tokens that fit beside bf16 weights, and requests of {ctx} tokens",
        columns=[
            "model",
            "memory",
            "weights (GiB)",
            "KV tokens (ledger)",
            "KV tokens (formula)",
            f"requests at {ctx} tokens",
        ],
        rows=[
            [
                m["model"],
                size,
                p["weight_bytes"] / 2**30,
                p["num_kv_tokens"],
                p["formula_kv_tokens"],
                p["max_concurrent_requests"],
            ]
            if p["fits"]
            else [m["model"], size, "weights do not fit", None, None, None]
            for m in models
            for size in memory
            for p in [m["plans"][size]]
        ],
        source=SOURCE,
    )
    figure = Figure(
        title="KV tokens that fit, per model and memory size (no bar: the weights do not fit)",
        log_y=True,
        x_label="model",
        x_unit="name",
        y_label="KV cache capacity",
        y_unit="thousands of tokens",
        kind="bar",
        x_ticks=[m["model"] for m in models],
        series=[
            Series(
                name=size,
                xs=list(range(len(models))),
                # NaN leaves no bar (a log axis has no 0)
                ys=[m["plans"][size].get("num_kv_tokens", float("nan")) / 1000 for m in models],
            )
            for size in memory
        ],
        source=SOURCE,
    )
    agree = all(m["formula_bytes_per_token"] == m["ledger_bytes_per_token"] for m in models)
    by_name = {m["model"]: m for m in models}
    l3, l2 = by_name.get("llama-3-8b"), by_name.get("llama-2-7b")
    gqa = (
        f"; GQA makes Llama-3-8B's {l3['ledger_bytes_per_token'] // 1024} KiB/token "
        f"{l2['ledger_bytes_per_token'] / l3['ledger_bytes_per_token']:.0f}x smaller than "
        f"Llama-2-7B's {l2['ledger_bytes_per_token'] // 1024} KiB"
        if l3 and l2
        else ""
    )
    return Section(
        key=KEY,
        title="The memory ledger: KV bytes per token and tokens that fit",
        claim="KV memory per token is 2 x layers x kv_heads x head_dim x bytes; the budget left "
        "after weights and activations, divided by it, is the number of tokens that fit.",
        status=MEASURED,
        measured=f"the ledger (shared/engine/memory.py, as `llmserve plan` prints it) for "
        f"{', '.join(m['model'] for m in models)} in bf16 at {', '.join(memory)}, context {ctx}",
        baseline="the formula, computed independently from each model's published shape",
        reading=(
            "the ledger's bf16 bytes/token equal the formula for every model"
            if agree
            else "the ledger DISAGREES with the formula for some model (see the table)"
        )
        + gqa
        + "; the ledger's token count is a little below the formula's (whole blocks, one "
        "padding block).",
        tables=[per_token, fits],
        figures=[figure],
        commands=[
            f"llmserve plan --model {m['model']} --memory {memory[0]} --dtype bfloat16 "
            f"--context {ctx}"
            for m in models
        ],
    )
