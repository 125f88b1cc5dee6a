"""Single-stream decode of the default GGUF file: dequantized to bf16 against its Q4_1 blocks run
natively (``--quantization gguf``), and llama.cpp's ``llama-bench`` on the same file, same threads,
in the same run.

Ours, per configuration: the engine generates 1 and then 1 + ``--tokens`` greedy tokens (EOS
ignored) from a short prompt; decode ms/token is the difference over ``--tokens``, so the prompt's
prefill and the per-request overheads cancel. Configurations alternate within each of
``--repeats`` rounds (load from other processes on a shared host hits them alike); the median round
is reported. llama.cpp: ``llama-bench -p 0 -n <tokens> -t <threads>`` (its tg128 when tokens is
128), run between our rounds when ``--llama-bench`` names its binary, else skipped with a message.

    python -m loadtests.bench_gguf [--tokens 128] [--threads 2] [--repeats 3] \\
        [--llama-bench /path/to/llama-bench] [--out loadtests/results/bench_gguf.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from loadtests.results import write_json
from shared.engine.default_model import default_model_path

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_gguf.json")
PROMPT = "The history of the printing press"
CONFIGS = {"bf16 (dequantized)": None, "Q4_1 blocks (gguf)": "gguf"}


def _decode_ms(llm, tokens: int) -> float:
    from shared.wire.sampling_params import SamplingParams

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([PROMPT], params)[0].outputs[0].token_ids
        assert len(out) == n
        return time.perf_counter() - t0

    return (run(1 + tokens) - run(1)) / tokens * 1e3


def llama_bench(binary: str, model: str, tokens: int, threads: int) -> dict[str, Any]:
    """One ``llama-bench`` text-generation run: its tokens/s (mean over its own 5 repetitions)."""
    cmd = [binary, "-m", model, "-p", "0", "-n", str(tokens), "-t", str(threads), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    (row,) = json.loads(out)
    return {
        "tokens_per_s": row["avg_ts"],
        "ms_per_token": 1e3 / row["avg_ts"],
        "cmd": " ".join(cmd),
    }


def measure(
    path: str, *, tokens: int, threads: int, repeats: int, llama_bench_path: str | None, log=print
) -> dict[str, Any]:
    from shared.engine.config import EngineConfig
    from shared.engine.llm import LLM

    llms = {
        name: LLM(
            EngineConfig(model=path, quantization=q, num_threads=threads, memory_budget="512MiB"),
            progress=False,
        )
        for name, q in CONFIGS.items()
    }
    for llm in llms.values():  # warm-up: first calls allocate
        _decode_ms(llm, 8)
    rounds: dict[str, list[float]] = {name: [] for name in llms}
    llama_runs: list[dict[str, Any]] = []
    if llama_bench_path is None:
        log("llama-bench: skipped (no --llama-bench binary given)")
    elif not os.access(llama_bench_path, os.X_OK):
        log(f"llama-bench: skipped ({llama_bench_path} is not an executable file)")
        llama_bench_path = None
    for r in range(repeats):
        for name, llm in llms.items():
            rounds[name].append(_decode_ms(llm, tokens))
        if llama_bench_path is not None:
            llama_runs.append(llama_bench(llama_bench_path, path, tokens, threads))
        log(
            f"  round {r + 1}: "
            + ", ".join(f"{name} {ms[-1]:.2f}" for name, ms in rounds.items())
            + (f", llama.cpp {llama_runs[-1]['ms_per_token']:.2f}" if llama_runs else "")
            + " ms/token"
        )
    rows: dict[str, dict[str, Any]] = {
        name: {
            "decode_ms_per_token": statistics.median(ms),
            "rounds_ms": ms,
            "weight_bytes": llms[name].engine.model.weight_bytes(),
        }
        for name, ms in rounds.items()
    }
    result: dict[str, Any] = dict(
        model=os.path.basename(path), tokens=tokens, threads=threads, repeats=repeats, rows=rows
    )
    if llama_runs:
        result["llama_bench"] = {
            "ms_per_token": statistics.median(run["ms_per_token"] for run in llama_runs),
            "rounds_ms": [run["ms_per_token"] for run in llama_runs],
            "cmd": llama_runs[0]["cmd"],
        }
    for name, row in rows.items():
        log(
            f"{name:<20} {row['decode_ms_per_token']:6.2f} ms/token  "
            f"weights {row['weight_bytes'] / 2**20:.0f} MiB"
        )
    if llama_runs:
        ms = result["llama_bench"]["ms_per_token"]
        log(f"{'llama.cpp tg' + str(tokens):<20} {ms:6.2f} ms/token")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--tokens", type=int, default=128, help="decode tokens timed (tg128)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary")
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    result = measure(
        args.model or default_model_path(),
        tokens=args.tokens,
        threads=args.threads,
        repeats=args.repeats,
        llama_bench_path=args.llama_bench,
        log=lambda line: print(line, flush=True),
    )
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
