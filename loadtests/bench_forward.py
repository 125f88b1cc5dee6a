"""Single-stream forward-pass speed of our runtime vs the transformers reference, same run, same host.

Measures, for SmolLM2-135M-Instruct (default GGUF) in fp32 and bf16:
  - decode ms/token: prefill a ``--context``-token prompt, ``--warmup`` decode steps, then the median
    (and p90) of ``--decode-tokens`` individually timed single-token steps;
  - prefill tokens/s: one forward over a ``--prefill-tokens`` prompt from an empty cache (median of
    ``--repeats``, after one warm-up);
  - generate ms/token: prefill + N decodes end to end, divided by N (transformers:
    ``generate(max_new_tokens=N, min_new_tokens=N)``; ours: the same loop through ModelRunner).
transformers decodes with a DynamicCache, timed per step exactly like ours. Absolute numbers on a
shared 2-core CPU mean little; the ratios, measured interleaved in one run, are the result.

    python loadtests/bench_forward.py [--threads 2] [--skip-hf] [--out loadtests/results/bench_forward.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

from shared.engine.kv_cache import KVCache
from shared.engine.model_runner import ModelRunner, ScheduledChunk
from shared.engine.models.loader import load_model, resolve_model_path

BLOCK_SIZE = 16
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_forward.json")


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def summarize(samples_s: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in samples_s)
    return {"median_ms": statistics.median(ms), "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
            "mean_ms": statistics.fmean(ms), "n": len(ms)}


# --- our runtime ---------------------------------------------------------------------------------

class OurStream:
    def __init__(self, model, max_tokens: int) -> None:
        self.model = model
        num_blocks = -(-max_tokens // BLOCK_SIZE)
        self.table = list(range(1, num_blocks + 1))
        self.runner = ModelRunner(model, KVCache(model.config, num_blocks + 1, BLOCK_SIZE, model.dtype))

    def prefill(self, ids: list[int]) -> torch.Tensor:
        return self.runner.execute([ScheduledChunk(ids, 0, self.table)])[0]

    def step(self, token: int, position: int) -> torch.Tensor:
        return self.runner.execute([ScheduledChunk([token], position, self.table)])[0]


def bench_ours(model, args, vocab: int) -> dict:
    prompt = random_ids(args.context, vocab, 1)
    steps = args.warmup + args.decode_tokens
    stream = OurStream(model, args.context + steps + 1)
    logits = stream.prefill(prompt)
    times = []
    for i in range(steps):
        token = int(logits.argmax())
        t0 = time.perf_counter()
        logits = stream.step(token, args.context + i)
        times.append(time.perf_counter() - t0)
    decode = summarize(times[args.warmup:])

    long_prompt = random_ids(args.prefill_tokens, vocab, 2)
    prefill_times = []
    for r in range(args.repeats + 1):
        stream = OurStream(model, args.prefill_tokens)
        t0 = time.perf_counter()
        stream.prefill(long_prompt)
        if r:  # the first is warm-up
            prefill_times.append(time.perf_counter() - t0)
    prefill_s = statistics.median(prefill_times)

    stream = OurStream(model, args.context + args.decode_tokens + 1)
    t0 = time.perf_counter()
    logits = stream.prefill(prompt)
    for i in range(args.decode_tokens - 1):
        logits = stream.step(int(logits.argmax()), args.context + i)
    generate_ms = (time.perf_counter() - t0) * 1e3 / args.decode_tokens
    return {"decode": decode, "prefill_s": prefill_s, "prefill_tok_s": args.prefill_tokens / prefill_s,
            "generate_ms_per_token": generate_ms}


# --- transformers reference ----------------------------------------------------------------------

@torch.inference_mode()
def bench_hf(model, args, vocab: int) -> dict:
    from transformers import DynamicCache

    prompt = torch.tensor([random_ids(args.context, vocab, 1)])
    cache = DynamicCache(config=model.config)
    out = model(prompt, past_key_values=cache, use_cache=True)
    logits = out.logits[0, -1]
    times = []
    for _ in range(args.warmup + args.decode_tokens):
        token = logits.argmax().view(1, 1)
        t0 = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        logits = out.logits[0, -1]
    decode = summarize(times[args.warmup:])

    long_prompt = torch.tensor([random_ids(args.prefill_tokens, vocab, 2)])
    prefill_times = []
    for r in range(args.repeats + 1):
        t0 = time.perf_counter()
        # Like ours: only the last position's logits are computed.
        model(long_prompt, use_cache=True, past_key_values=DynamicCache(config=model.config),
              logits_to_keep=1)
        if r:
            prefill_times.append(time.perf_counter() - t0)
    prefill_s = statistics.median(prefill_times)

    n = args.decode_tokens
    t0 = time.perf_counter()
    model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n,
                   min_new_tokens=n, pad_token_id=0)
    generate_ms = (time.perf_counter() - t0) * 1e3 / n
    return {"decode": decode, "prefill_s": prefill_s, "prefill_tok_s": args.prefill_tokens / prefill_s,
            "generate_ms_per_token": generate_ms}


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


# --- driver --------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF path (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--context", type=int, default=128, help="prompt tokens before timed decode")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="timed prefills (median)")
    p.add_argument("--skip-hf", action="store_true", help="only our runtime")
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    hf_fp32 = None if args.skip_hf else load_hf(path)
    results = []
    for dtype_name in dtypes:
        ours = load_model(path, dtype=dtype_name, progress=False)
        vocab = ours.config.vocab_size
        row = {"impl": "llmserve", "dtype": dtype_name, **bench_ours(ours, args, vocab)}
        results.append(row)
        print(f"llmserve {dtype_name}: decode {row['decode']['median_ms']:.2f} ms/tok", file=sys.stderr)
        del ours
        if hf_fp32 is not None:
            # Same dequantized weights as the fp32 reference, cast like from_pretrained(dtype=...) would.
            hf = hf_fp32 if dtype_name == "float32" else copy.deepcopy(hf_fp32).to(getattr(torch, dtype_name))
            row = {"impl": "transformers", "dtype": dtype_name, **bench_hf(hf, args, vocab)}
            results.append(row)
            del hf
            print(f"transformers {dtype_name}: decode {row['decode']['median_ms']:.2f} ms/tok", file=sys.stderr)

    speedups = {}
    for dtype_name in dtypes:
        by_impl = {r["impl"]: r for r in results if r["dtype"] == dtype_name}
        if len(by_impl) == 2:
            o, h = by_impl["llmserve"], by_impl["transformers"]
            speedups[dtype_name] = {
                "decode": h["decode"]["median_ms"] / o["decode"]["median_ms"],
                "prefill": o["prefill_tok_s"] / h["prefill_tok_s"],
                "generate": h["generate_ms_per_token"] / o["generate_ms_per_token"],
            }

    header = f"{'impl':<13}{'dtype':<10}{'decode ms/tok':>14}{'p90':>8}{'prefill tok/s':>15}{'generate ms/tok':>17}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['impl']:<13}{r['dtype']:<10}{r['decode']['median_ms']:>14.2f}{r['decode']['p90_ms']:>8.2f}"
              f"{r['prefill_tok_s']:>15.1f}{r['generate_ms_per_token']:>17.2f}")
    for dtype_name, s in speedups.items():
        print(f"speedup llmserve/transformers {dtype_name}: decode {s['decode']:.2f}x, "
              f"prefill {s['prefill']:.2f}x, generate {s['generate']:.2f}x")

    report = {
        "benchmark": "bench_forward",
        "model": os.path.basename(path),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "host": {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                 "machine": platform.machine(), "load_avg_1m": os.getloadavg()[0]},
        "results": results,
        "speedups": speedups,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
