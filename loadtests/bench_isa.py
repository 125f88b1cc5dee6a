"""The engine at each CPU kernel level, against the fp32 torch path, in one run (alternating).

Configurations, each in its own process (the level is chosen when the kernels load):

- ``fp32 torch``: ``LLMSERVE_CPU_KERNELS=0``, fp32 weights: the unfused torch path, what runs on a
  CPU the kernels do not serve;
- ``avx2 bf16``: ``LLMSERVE_CPU_ISA=avx2``: the AVX2+FMA kernels, as on an AVX2-only CPU (oneDNN's
  bf16 matmul is not used there either);
- ``<best> bf16``: the highest level this CPU has.

Each runs bench_engine's offline workload (a) (``--num-prompts`` prompts of 64-512 tokens cut from
real text, ``--output-len`` greedy tokens each, ``max_num_batched_tokens`` 512) and a single stream
(a 128-token prompt, 128 output tokens: ms per output token after the first). Configurations take
turns for ``--repeats`` rounds; the best of each is reported, with the ratios the portable-engine
target is stated in: AVX2 offline vs the fp32 torch path, AVX2 vs the arithmetic ceiling at the AVX2
level's peak (``loadtests/ceiling.py``: fp32 FMA), and the best level vs AVX2.

    python -m loadtests.bench_isa [--repeats 2] [--out loadtests/results/bench_isa.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgspec

from kernels.cpu import isa
from loadtests.results import write_json

DEFAULT_OUT = "loadtests/results/bench_isa.json"
SINGLE_PROMPT, SINGLE_OUTPUT = 128, 128


def configurations() -> list[tuple[str, dict[str, str], str]]:
    """(label, environment, dtype) per configuration, the torch path first."""
    best = isa.best_level()
    if best is None:
        raise SystemExit(f"no CPU kernel level runs here: {isa.why_not(isa.LEVELS[0])}")
    configs = [
        ("fp32 torch", {"LLMSERVE_CPU_KERNELS": "0"}, "float32"),
        ("avx2 bf16", {isa.ISA_ENV: "avx2"}, "bfloat16"),
    ]
    if best.name != "avx2":
        configs.append((f"{best.name} bf16", {}, "bfloat16"))
    return configs


# ---- one configuration, in its own process -------------------------------------------------------


def worker(args) -> dict[str, Any]:
    import torch

    from kernels.cpu import cpu_ops
    from loadtests import bench_engine as be
    from loadtests.engine_setup import make_llm, reset_prefix_cache
    from loadtests.workloads import corpus_token_ids, text_prompts
    from shared.wire.sampling_params import SamplingParams

    ns = be.parse_args(
        [
            "--dtype",
            args.dtype,
            "--threads",
            str(args.threads),
            "--num-prompts",
            str(args.num_prompts),
            "--output-len",
            str(args.output_len),
            "--batched-tokens",
            "512",
            "--skip-hf",
            "--skip-mix",
        ]
    )
    ops = cpu_ops()
    if ops is None:
        level = "torch"
    else:
        best = isa.best_level()
        assert best is not None  # cpu_ops() found kernels, so a level runs here
        level = best.name
    llm = make_llm(ns, max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=512)
    tok = llm.tokenizer
    corpus = corpus_token_ids(
        lambda s: tok.encode(s, add_special_tokens=False), tok.all_special_ids
    )
    rng = random.Random(ns.seed)
    lens = [rng.randint(*ns.prompt_len) for _ in range(ns.num_prompts)]
    prompts = text_prompts(corpus, lens, rng)

    params = SamplingParams(max_tokens=ns.output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    offline_s = time.perf_counter() - t0
    num_out = sum(len(r.outputs[0].token_ids) for r in results)
    reset_prefix_cache(llm)

    # Single stream: token times from the engine's steps (one request, so one token a step).
    engine = llm.engine
    engine.add_request(
        "single",
        corpus[:SINGLE_PROMPT],
        SamplingParams(max_tokens=SINGLE_OUTPUT, temperature=0.0, ignore_eos=True),
    )
    stamps = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            stamps += [time.perf_counter()] * sum(len(d.token_ids) for d in out.deltas)
    ttft = stamps[0] - t0
    tpot_ms = 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return dict(
        level=level,
        dtype=args.dtype,
        threads=torch.get_num_threads(),
        offline_s=offline_s,
        offline_tok_s=num_out / offline_s,
        num_output_tokens=num_out,
        prompt_lens=lens,
        single_ttft_ms=1000 * ttft,
        single_tpot_ms=tpot_ms,
        model_config=engine.model_config,
    )


# ---- the driver ----------------------------------------------------------------------------------


def run_config(label: str, env: dict[str, str], dtype: str, args) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "loadtests.bench_isa",
        "--worker",
        "--dtype",
        dtype,
        "--threads",
        str(args.threads),
        "--num-prompts",
        str(args.num_prompts),
        "--output-len",
        str(args.output_len),
    ]
    full_env = {
        k: v for k, v in os.environ.items() if k not in ("LLMSERVE_CPU_KERNELS", isa.ISA_ENV)
    }
    proc = subprocess.run(
        cmd, env={**full_env, **env}, capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"  {label:<18} offline {res['offline_tok_s']:7.1f} tok/s ({res['offline_s']:.1f} s)   "
        f"single stream {res['single_tpot_ms']:6.1f} ms/token "
        f"(TTFT {res['single_ttft_ms']:.0f} ms)   load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--repeats", type=int, default=2, help="rounds of every configuration, alternating"
    )
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.worker:
        print(msgspec.json.encode(worker(args)).decode())
        return 0

    from loadtests import ceiling
    from shared.engine.models.config import ModelConfig

    configs = configurations()
    print(
        f"bench_isa  {isa.cpu_name()}  threads={args.threads}  "
        f"{args.num_prompts} prompts x {args.output_len} tokens; "
        f"single stream {SINGLE_PROMPT}/{SINGLE_OUTPUT}; {args.repeats} alternating rounds",
        flush=True,
    )
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in configs}
    for rnd in range(args.repeats):
        print(f"round {rnd + 1}/{args.repeats}", flush=True)
        for label, env, dtype in configs:
            runs[label].append(run_config(label, env, dtype, args))
    best = {
        label: dict(
            offline_tok_s=max(r["offline_tok_s"] for r in rs),
            single_tpot_ms=min(r["single_tpot_ms"] for r in rs),
        )
        for label, rs in runs.items()
    }
    first = runs["avx2 bf16"][0]
    flops = ceiling.run_flops(
        msgspec.convert(first["model_config"], ModelConfig), first["prompt_lens"], args.output_len
    )
    avx2_peak = ceiling.bf16_peak_gflops(args.threads, level="avx2")
    avx2_ceiling = first["num_output_tokens"] / ceiling.ceiling_seconds(flops, avx2_peak)
    avx2, torch_fp32 = best["avx2 bf16"], best["fp32 torch"]
    summary = dict(
        avx2_vs_fp32_torch=avx2["offline_tok_s"] / torch_fp32["offline_tok_s"],
        avx2_ceiling_tok_s=avx2_ceiling,
        avx2_peak_gflops=avx2_peak,
        run_tflop=sum(flops.values()) / 1e12,
        avx2_share_of_ceiling=avx2["offline_tok_s"] / avx2_ceiling,
        avx2_single_tpot_ms=avx2["single_tpot_ms"],
    )
    print(
        f"offline: avx2 bf16 {avx2['offline_tok_s']:.1f} tok/s = "
        f"{summary['avx2_vs_fp32_torch']:.2f}x the fp32 "
        f"torch path ({torch_fp32['offline_tok_s']:.1f}); "
        f"the run's {summary['run_tflop']:.2f} TFLOP at the "
        f"avx2 peak ({avx2_peak:.0f} GFLOP/s fp32 FMA) allow {avx2_ceiling:.0f} tok/s: "
        "avx2 reaches "
        f"{100 * summary['avx2_share_of_ceiling']:.0f}% of it"
    )
    print(
        f"single stream: avx2 bf16 {avx2['single_tpot_ms']:.1f} ms/token, fp32 torch "
        f"{torch_fp32['single_tpot_ms']:.1f} ms/token"
    )
    top = configs[-1][0]
    if top != "avx2 bf16":
        summary["best_vs_avx2_offline"] = best[top]["offline_tok_s"] / avx2["offline_tok_s"]
        summary["best_vs_avx2_single"] = avx2["single_tpot_ms"] / best[top]["single_tpot_ms"]
        print(
            f"{top} vs avx2 bf16: offline {summary['best_vs_avx2_offline']:.2f}x "
            f"({best[top]['offline_tok_s']:.1f} tok/s), "
            f"single stream {summary['best_vs_avx2_single']:.2f}x "
            f"({best[top]['single_tpot_ms']:.1f} ms/token)"
        )
    for rs in runs.values():
        for r in rs:
            r.pop("model_config")
            r.pop("prompt_lens")
    res = dict(
        cpu=isa.cpu_name(),
        threads=args.threads,
        num_prompts=args.num_prompts,
        output_len=args.output_len,
        runs=runs,
        best=best,
        summary=summary,
        started=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    print(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
