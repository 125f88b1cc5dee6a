"""What quantization costs in quality: SmolLM2 in bf16, int8 (W8A8, per SmoothQuant alpha, and
without smoothing), the file's own GGUF blocks run natively (``quantization="gguf"``: Q4_1 for
the default file, its tied head Q8_0) and the same formats quantized at load from the dequantized
weights (``quantization="int4"``), with int8 and fp8 (e4m3) KV caches beside some, against fp32
(the file dequantized), teacher-forced over the same text (the engine's own docstrings, none of it
in the int8 calibration text). With a quantized KV cache every position attends to the quantized
keys and values, as in the engine.

Per configuration: perplexity of the text, top-1 agreement with fp32 at every position, and the
mean and max |logit - fp32 logit|; plus the bytes the model holds.

    python -m loadtests.bench_quality [--tokens 1500] [--alphas 0.5] [--skip-gguf] \\
        [--out loadtests/results/bench_quality.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from loadtests.results import write_json
from loadtests.workloads import corpus_text
from shared.engine.default_model import default_model_path
from shared.engine.models import int8_linear
from shared.engine.models.gguf_linear import quantize_model_int4
from shared.engine.models.runtime import load_runtime
from shared.engine.models.teacher_forcing import all_position_logits, perplexity
from shared.engine.tokenizer import Tokenizer

DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "bench_quality.json"
)


def measure(
    path: str,
    *,
    tokens: int = 1500,
    alphas: str = "0.5",
    unsmoothed: bool = True,
    gguf: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Score every configuration on the first ``tokens`` tokens of the corpus against fp32; one
    row per configuration (see the module docstring). ``unsmoothed``: also int8 without
    SmoothQuant; ``gguf``: also the file's blocks run natively (its ``quantize_s`` is the whole
    load, which replaces the dequantizing one)."""
    tokenizer = Tokenizer.from_gguf(path)
    ids = tokenizer.encode(corpus_text())[:tokens]
    calibration = tokenizer.encode(int8_linear.calibration_text())
    log(
        f"bench_quality  {os.path.basename(path)}  {len(ids)} tokens scored, "
        f"{len(calibration)} calibration tokens"
    )

    reference = load_runtime(path, dtype="float32", progress=False)
    ref = all_position_logits(reference, ids)
    # (name, dtype, SmoothQuant alpha, quantization: None, "int8", "int4" or "gguf", KV cache dtype)
    configs: list[tuple[str, str, float | None, str | None, str]] = [
        ("fp32", "float32", None, None, "auto"),
        ("bf16", "bfloat16", None, None, "auto"),
        ("bf16, int8 KV", "bfloat16", None, None, "int8"),
        ("bf16, fp8 KV", "bfloat16", None, None, "fp8"),
    ]
    for a in alphas.split(","):
        configs += [
            (f"int8 alpha={a}", "bfloat16", float(a), "int8", "auto"),
            (f"int8 alpha={a}, int8 KV", "bfloat16", float(a), "int8", "int8"),
            (f"int8 alpha={a}, fp8 KV", "bfloat16", float(a), "int8", "fp8"),
        ]
    if unsmoothed:
        configs.append(("int8 no smoothing", "bfloat16", None, "int8", "auto"))
    if gguf:
        configs += [
            ("gguf blocks", "bfloat16", None, "gguf", "auto"),
            ("gguf blocks, int8 KV", "bfloat16", None, "gguf", "int8"),
            ("int4 (requantized at load)", "bfloat16", None, "int4", "auto"),
        ]
    rows = []
    # Configurations that differ only in the KV cache dtype share one loaded (and quantized) model:
    # the KV dtype is an argument of the scoring pass, and loading is the slow part here.
    loaded: tuple[tuple[str, float | None, str | None], Any, float] | None = (
        ("float32", None, None),
        reference,
        0.0,
    )
    del reference
    for name, dtype, alpha, quantization, kv_cache_dtype in configs:
        if loaded is None or loaded[0] != (dtype, alpha, quantization):
            loaded = None  # free the previous model before loading the next
            t0 = time.perf_counter()
            model = load_runtime(
                path,
                dtype=dtype,
                progress=False,
                quantization="gguf" if quantization == "gguf" else None,
            )
            if quantization != "gguf":
                t0 = time.perf_counter()
            if quantization == "int8":
                int8_linear.quantize_model_int8(model, calibration, model.backend, alpha)
            elif quantization == "int4":
                quantize_model_int4(model)
            loaded = ((dtype, alpha, quantization), model, time.perf_counter() - t0)
        _, model, quantize_s = loaded
        logits = all_position_logits(model, ids, kv_cache_dtype=kv_cache_dtype)
        diff = (logits - ref).abs()
        row: dict[str, Any] = dict(
            config=name,
            dtype=dtype,
            alpha=alpha,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            perplexity=perplexity(logits, ids),
            top1_agreement=(logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            mean_abs_logit_diff=diff.mean().item(),
            max_abs_logit_diff=diff.max().item(),
            weight_bytes=model.weight_bytes(),
            quantize_s=quantize_s,
        )
        rows.append(row)
        log(
            f"  {name:<26} perplexity {row['perplexity']:7.3f}   "
            f"top-1 = fp32 {100 * row['top1_agreement']:5.1f}%   "
            f"|logit diff| mean {row['mean_abs_logit_diff']:.3f} "
            f"max {row['max_abs_logit_diff']:.2f}   "
            f"weights {row['weight_bytes'] / 2**20:.0f} MiB"
        )
        del model
    return dict(
        model=os.path.basename(path),
        tokens=len(ids),
        calibration_tokens=len(calibration),
        rows=rows,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tokens", type=int, default=1500, help="tokens of text scored")
    p.add_argument("--alphas", default="0.5", help="SmoothQuant alphas to try (comma-separated)")
    p.add_argument(
        "--skip-gguf", action="store_true", help="leave out the file's blocks run natively"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(
        args.model or default_model_path(),
        tokens=args.tokens,
        alphas=args.alphas,
        gguf=not args.skip_gguf,
        log=lambda line: print(line, flush=True),
    )
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
