"""Engine benchmarks, all measured in one run (on a shared CPU only ratios mean something).

(a) Offline throughput: N prompts (seeded lengths in [64, 512], cut from real text tokenized by the
    engine's tokenizer), M greedy output tokens each (ignore_eos), through ``LLM.generate`` for each
    ``--batched-tokens`` value, against Hugging Face ``transformers`` batched ``generate`` on the
    same token ids (left padding + attention mask, min_new_tokens = max_new_tokens, the model loaded
    from the same GGUF), in our dtype and in fp32, transformers' default for a GGUF
    (``--hf-dtypes``).
(b) Continuous vs static batching on a mixed short/long trace: the same engine (max_num_seqs = B),
    either given every request at once (continuous) or given them B at a time, each batch stepped
    until its longest member finishes before the next is admitted (static). Static batching comes
    in two forms: "static" lets a finished member leave the forward pass (its slot idles, its
    compute is saved; the harder baseline on a CPU, where a step's cost grows with its rows),
    "static_padded" keeps decoding it until the batch's longest is done and discards the surplus
    tokens, as a fixed-shape batch does (transformers ``generate``, FasterTransformer).
(c) KV utilization on trace (b): per engine step, live tokens / reserved slots for the paged block
    manager vs contiguous per-request reservations of prompt + max_tokens, prompt + the trace's
    largest max_tokens (a server-wide output cap) and max_model_len.

Process settings, the same for our engine and transformers (both printed and in the JSON):
libgomp's wait policy as the environment sets it (unset: spin briefly, then sleep; on a quiet
machine that is ~2x faster per decode step than OMP_WAIT_POLICY=PASSIVE, which only pays off on a
host shared with other busy processes) and glibc's mmap/trim thresholds raised (``tune_malloc``;
``--no-tune-malloc`` keeps the defaults).

    python -m loadtests.bench_engine --repeats 2 --profile   # what the report used
    python -m loadtests.bench_engine --quantization int8     # the same with W8A8 decoder linears
    python -m loadtests.bench_engine --kv-cache-dtype int8   # ... with an int8 KV cache (combines)
    python -m loadtests.bench_engine                 # full run, writes
                                                     # loadtests/results/bench_engine.json
    python -m loadtests.bench_engine --quick --skip-hf
    python -m loadtests.bench_engine --profile-only  # torch.profiler + cProfile of
                                                     # prefill/decode steps
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from loadtests.engine_mix import bench_mix
from loadtests.engine_offline import (
    agreement,
    bench_engine_offline,
    bench_hf_offline,
    offline_ceiling,
)
from loadtests.engine_profile import profile_engine
from loadtests.engine_report import print_report
from loadtests.engine_setup import build_prompts, engine_revision, load_average, log, tune_malloc
from loadtests.results import write_json
from loadtests.workloads import corpus_token_ids, fingerprint
from shared.engine.default_model import default_model_path
from shared.engine.quantization import (
    KV_CACHE_DTYPE_HELP,
    KV_CACHE_DTYPES,
    QUANTIZATION_HELP,
    QUANTIZATIONS,
)

DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "bench_engine.json"
)


# ---- arguments -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help=QUANTIZATION_HELP)
    p.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_CACHE_DTYPE_HELP
    )
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (engine and HF)")
    p.add_argument("--memory-budget", default="1GiB", help="engine memory budget (weights+act+KV)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-source", choices=("text", "random"), default="text")
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes for a smoke run (8 prompts x 32 tokens; 12-request mix)",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON output path")
    p.add_argument("--skip-offline", action="store_true", help="skip (a)")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline of (a)")
    p.add_argument("--skip-mix", action="store_true", help="skip (b) and (c)")
    p.add_argument(
        "--no-tune-malloc",
        dest="tune_malloc",
        action="store_false",
        help=(
            "keep glibc's default mmap/trim thresholds (see tune_malloc(); the default raises them)"
        ),
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure each engine configuration / batching mode this many times (best is kept)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile prefill and decode steps of the engine (torch.profiler + cProfile)",
    )
    p.add_argument("--profile-only", action="store_true", help="only the profile")
    g = p.add_argument_group("(a) offline throughput")
    g.add_argument("--num-prompts", type=int, default=None, help="default 32 (quick: 8)")
    g.add_argument("--prompt-len", default="64,512", help="min,max prompt tokens")
    g.add_argument("--output-len", type=int, default=None, help="default 128 (quick: 32)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="default: --num-prompts (>= 32)")
    g.add_argument(
        "--batched-tokens",
        default="512,1024",
        help="comma-separated max_num_batched_tokens values to try; the best is reported",
    )
    g.add_argument(
        "--hf-dtypes",
        default="same,float32",
        help=(
            "dtypes of the transformers baselines ('same' = --dtype); the first is compared token "
            "by token"
        ),
    )
    g.add_argument(
        "--hf-max-time",
        type=float,
        default=360.0,
        help="seconds; transformers generate stops early past this (stated in the output)",
    )
    g = p.add_argument_group("(b)/(c) mixed short/long trace")
    g.add_argument("--mix-requests", type=int, default=None, help="default 32 (quick: 12)")
    g.add_argument(
        "--mix-batch",
        type=int,
        default=None,
        help="B: static batch size = the engine's max_num_seqs for both runs (default 8; quick 4)",
    )
    g.add_argument("--mix-prompt-len", default="32,256", help="min,max prompt tokens")
    g.add_argument(
        "--mix-short", type=int, default=None, help="short output tokens (default 16; quick 8)"
    )
    g.add_argument(
        "--mix-long", type=int, default=None, help="long output tokens (default 256; quick 64)"
    )
    g.add_argument("--mix-long-frac", type=float, default=0.25, help="fraction of long requests")
    g.add_argument("--mix-batched-tokens", type=int, default=512)
    args = p.parse_args(argv)
    q = args.quick
    defaults = dict(
        num_prompts=8 if q else 32,
        output_len=32 if q else 128,
        mix_requests=12 if q else 32,
        mix_batch=4 if q else 8,
        mix_short=8 if q else 16,
        mix_long=64 if q else 256,
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.max_num_seqs is None:
        args.max_num_seqs = max(args.num_prompts, 32)
    args.prompt_len = _int_pair(args.prompt_len, "--prompt-len")
    args.mix_prompt_len = _int_pair(args.mix_prompt_len, "--mix-prompt-len")
    args.batched_tokens = [int(x) for x in args.batched_tokens.split(",") if x.strip()]
    args.hf_dtypes = list(
        dict.fromkeys(
            args.dtype if d.strip() == "same" else d.strip()
            for d in args.hf_dtypes.split(",")
            if d.strip()
        )
    )
    if args.profile_only:
        args.profile = True
        args.skip_offline = args.skip_mix = True
    if args.model is None:
        args.model = default_model_path()
    return args


def _int_pair(text: str, flag: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise SystemExit(f"{flag}: expected min,max with 1 <= min <= max, got {text!r}")
    return lo, hi


# ---- the run -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    malloc_tuned = tune_malloc() if args.tune_malloc else False
    torch.set_num_threads(args.threads)
    res: dict[str, Any] = {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
        "env": dict(
            omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
            malloc_tuned=malloc_tuned,
            torch=torch.__version__,
            python=platform.python_version(),
            cpu_count=os.cpu_count(),
            torch_threads=torch.get_num_threads(),
            load_avg_start=load_average(),
            **engine_revision(),
            started=time.strftime("%Y-%m-%dT%H:%M:%S"),
        ),
    }
    t_start = time.perf_counter()
    from shared.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(args.model)
    corpus = None
    if args.prompt_source == "text":
        corpus = corpus_token_ids(
            lambda s: tokenizer.encode(s, add_special_tokens=False), tokenizer.all_special_ids
        )
        res["env"]["corpus_tokens"] = len(corpus)
    rng = random.Random(args.seed)
    lens = [rng.randint(*args.prompt_len) for _ in range(args.num_prompts)]
    prompts = build_prompts(args, tokenizer, lens, rng, corpus)

    if not args.skip_offline:
        a: dict[str, Any] = dict(
            num_prompts=len(prompts),
            prompt_len_range=list(args.prompt_len),
            num_prompt_tokens=sum(lens),
            output_len=args.output_len,
            prompts_fingerprint=fingerprint(prompts),
        )
        eng = bench_engine_offline(args, prompts)
        a["engine"] = {"runs": eng["runs"], "best": eng["best"]}
        a["ceiling"] = offline_ceiling(
            args, eng["model_config"], lens, eng["best"]["output_tokens_per_s"]
        )
        if not args.skip_hf:
            pad = (
                tokenizer.pad_token_id
                if tokenizer.pad_token_id is not None
                else tokenizer.eos_token_ids[0]
            )
            a["hf_runs"] = []
            for dtype_name in args.hf_dtypes:
                hf = bench_hf_offline(args, prompts, pad, dtype_name)
                outputs = hf.pop("outputs")
                if "agreement" not in a:
                    a["agreement"] = agreement(eng["outputs"], outputs)
                hf["ratio"] = eng["best"]["output_tokens_per_s"] / hf["output_tokens_per_s"]
                hf["cpu_ratio"] = (
                    max(r["output_tokens_per_cpu_s"] for r in eng["runs"])
                    / hf["output_tokens_per_cpu_s"]
                )
                a["hf_runs"].append(hf)
        res["offline"] = a
    if not args.skip_mix:
        res["mix"] = bench_mix(args, corpus)
    if args.profile:
        mbt = (
            res["offline"]["engine"]["best"]["max_num_batched_tokens"]
            if "offline" in res
            else args.batched_tokens[0]
        )
        res["profile"] = profile_engine(args, prompts, mbt)
    res["env"]["load_avg_end"] = load_average()
    res["env"]["total_s"] = time.perf_counter() - t_start

    print_report(res)
    log(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
