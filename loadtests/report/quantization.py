"""Weight quantization (bf16 vs int8 W8A8 decoder linears) and KV quantization (auto = the model
dtype vs int8): offline decode speed (``bench_engine`` (a)), memory (the weights a loaded model
holds, the KV bytes per token, the KV pool a fixed budget buys) and quality (``bench_quality``:
perplexity and top-1 agreement with fp32, teacher-forced). int4 weights do not exist in this tree.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from typing import Any

from loadtests.report import mix
from loadtests.report.model import MEASURED, Figure, Section, Series, Table
from loadtests.report.plan import Plan

KEY = "quantization"
SOURCE = f"raw/{KEY}.json"
# (label, --quantization, --kv-cache-dtype, bench_quality's row for the same numerics); the first
# is the baseline, the next two change one thing each, the last (full runs only) both.
CONFIGS: tuple[tuple[str, str | None, str, str], ...] = (
    ("bf16 weights, bf16 KV", None, "auto", "bf16"),
    ("bf16 weights, int8 KV", None, "int8", "bf16, int8 KV"),
    ("int8 weights, bf16 KV", "int8", "auto", "int8 alpha={alpha}"),
    ("int8 weights, int8 KV", "int8", "int8", "int8 alpha={alpha}, int8 KV"),
)


def engine_argv(plan: Plan, quantization: str | None, kv: str) -> list[str]:
    argv = [
        "--skip-hf",
        "--skip-mix",
        "--threads",
        str(plan.threads),
        "--num-prompts",
        str(plan.quant_prompts),
        "--prompt-len",
        f"{plan.quant_prompt_len[0]},{plan.quant_prompt_len[1]}",
        "--output-len",
        str(plan.quant_output_len),
        "--batched-tokens",
        "512",
        "--repeats",
        str(plan.quant_repeats),
        "--kv-cache-dtype",
        kv,
    ]
    return argv + (["--quantization", quantization] if quantization else [])


def measure(plan: Plan, log: Callable[[str], None]) -> dict[str, Any]:
    from loadtests import bench_engine, bench_quality, engine_offline, engine_setup
    from shared.engine.default_model import default_model_path
    from shared.engine.memory import kv_bytes_per_token
    from shared.engine.models.int8_linear import SMOOTHING_ALPHA

    speed = []
    prompts = None
    for label, quantization, kv, _ in CONFIGS[: None if plan.quant_combined else 3]:
        argv = engine_argv(plan, quantization, kv)
        args = bench_engine.parse_args(argv)
        if prompts is None:  # the same prompts for every configuration
            tokenizer, corpus = mix.tokenizer_and_corpus(args.model)
            rng = random.Random(args.seed)
            lens = [rng.randint(*args.prompt_len) for _ in range(args.num_prompts)]
            prompts = engine_setup.build_prompts(args, tokenizer, lens, rng, corpus)
        log(f"quantization: decode speed, {label}")
        eng = engine_offline.bench_engine_offline(args, prompts)
        run = eng["best"]
        speed.append(
            dict(
                label=label,
                quantization=quantization,
                kv_cache_dtype=kv,
                memory_budget=args.memory_budget,
                kv_bytes_per_token=kv_bytes_per_token(
                    eng["model_config"], "int8" if kv == "int8" else args.dtype
                ),
                command="python -m loadtests.bench_engine " + " ".join(argv),
                **{
                    k: run[k]
                    for k in (
                        "output_tokens_per_s",
                        "decode_phase_tokens_per_s",
                        "output_tokens_per_cpu_s",
                        "elapsed_s",
                        "num_kv_blocks",
                        "num_output_tokens",
                    )
                },
            )
        )
        del eng
        gc.collect()
    log("quantization: perplexity (bench_quality)")
    alpha = str(SMOOTHING_ALPHA)
    quality = bench_quality.measure(
        default_model_path(),
        tokens=plan.quality_tokens,
        alphas=alpha,
        unsmoothed=plan.quality_unsmoothed,
        log=log,
    )
    return dict(
        alpha=alpha,
        num_prompts=plan.quant_prompts,
        prompt_len_range=list(plan.quant_prompt_len),
        output_len=plan.quant_output_len,
        speed=speed,
        quality=quality,
        quality_command=f"python -m loadtests.bench_quality --tokens {plan.quality_tokens} "
        f"--alphas {alpha}",
    )


def build(raw: dict[str, Any]) -> Section:
    speed, q = raw["speed"], raw["quality"]
    by_config = {r["config"]: r for r in q["rows"]}
    base = speed[0]
    rows = []
    for s, (_, _, _, qname) in zip(speed, CONFIGS[: len(speed)], strict=True):
        qr = by_config.get(qname.format(alpha=raw["alpha"]), {})
        rows.append(
            [
                s["label"],
                s["output_tokens_per_s"],
                s["decode_phase_tokens_per_s"],
                s["output_tokens_per_s"] / base["output_tokens_per_s"],
                qr.get("weight_bytes", 0) / 2**20,
                s["kv_bytes_per_token"],
                s["num_kv_blocks"],
                qr.get("perplexity"),
                100 * qr["top1_agreement"] if qr else None,
            ]
        )
    table = Table(
        title="Speed, memory and quality per configuration (SmolLM2-135M)",
        columns=[
            "configuration",
            "output (tokens/s)",
            "decode phase (tokens/s)",
            "output vs bf16/bf16 (x)",
            "weights held (MiB)",
            "KV (bytes/token)",
            f"KV blocks in {base['memory_budget']}",
            "perplexity",
            "top-1 = fp32 (%)",
        ],
        rows=rows,
        source=SOURCE,
    )
    quality = Table(
        title=f"Teacher-forced quality over {q['tokens']} tokens of text, against fp32",
        columns=[
            "configuration",
            "perplexity",
            "top-1 = fp32 (%)",
            "mean |logit diff|",
            "max |logit diff|",
            "weights held (MiB)",
        ],
        rows=[
            [
                r["config"],
                r["perplexity"],
                100 * r["top1_agreement"],
                r["mean_abs_logit_diff"],
                r["max_abs_logit_diff"],
                r["weight_bytes"] / 2**20,
            ]
            for r in q["rows"]
        ],
        source=SOURCE,
    )
    labels = [s["label"] for s in speed]
    xs = list(range(len(labels)))
    fig_speed = Figure(
        title=f"Offline output throughput ({raw['num_prompts']} prompts x {raw['output_len']} "
        "tokens)",
        x_label="configuration",
        x_unit="name",
        y_label="output throughput",
        y_unit="tokens/s",
        kind="bar",
        x_ticks=[lb.replace(", ", "\n") for lb in labels],
        series=[
            Series("whole run", xs, [s["output_tokens_per_s"] for s in speed]),
            Series("decode phase", xs, [s["decode_phase_tokens_per_s"] for s in speed]),
        ],
        source=SOURCE,
    )
    fig_ppl = Figure(
        title="Perplexity per configuration (lower is better; fp32 is the reference)",
        x_label="configuration",
        x_unit="name",
        y_label="perplexity",
        y_unit="exp(mean NLL), dimensionless",
        kind="bar",
        x_ticks=[r["config"].replace(", ", "\n") for r in q["rows"]],
        series=[
            Series("perplexity", list(range(len(q["rows"]))), [r["perplexity"] for r in q["rows"]])
        ],
        source=SOURCE,
    )
    int8w, int8kv = speed[2], speed[1]
    ref = by_config.get("bf16", {})
    w8 = by_config.get(f"int8 alpha={raw['alpha']}", {})
    reading = (
        f"int8 weights run {int8w['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x "
        f"bf16's output tokens/s; an int8 KV cache holds "
        f"{int8kv['num_kv_blocks'] / base['num_kv_blocks']:.2f}x the blocks in the same budget at "
        f"{int8kv['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x the speed"
    )
    if ref and w8:
        reading += (
            f"; perplexity bf16 {ref['perplexity']:.2f} vs int8 {w8['perplexity']:.2f} "
            f"(fp32 {by_config['fp32']['perplexity']:.2f})."
        )
    return Section(
        key=KEY,
        title="Weight and KV quantization: speed, memory, perplexity",
        claim="int8 weights (W8A8) and an int8 KV cache cut memory and speed up CPU decode at a "
        "small cost in quality.",
        status=MEASURED,
        measured="output tokens/s of the engine offline (same prompts, greedy, ignore_eos), the "
        "weight bytes a loaded model holds, KV bytes per token and the KV blocks a fixed budget "
        "buys, and teacher-forced perplexity / top-1 agreement with fp32",
        baseline="bf16 weights with a bf16 KV cache (speed, memory); fp32 (quality); same run",
        reading=reading,
        tables=[table, quality],
        figures=[fig_speed, fig_ppl],
        commands=[s["command"] for s in speed] + [raw["quality_command"]],
        notes=[
            "int4 weights: not implemented in this tree (the only --quantization is int8), so "
            "there is no int4 row."
        ],
    )
