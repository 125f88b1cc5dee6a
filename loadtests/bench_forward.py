"""Single-stream forward-pass speed of our runtime vs the transformers reference, same run, same
host.

For SmolLM2-135M-Instruct (default GGUF), per dtype (fp32, bf16):
  - decode ms/token: prefill a ``--context``-token prompt, ``--warmup`` decode steps, then the
    median (and p90) of ``--decode-tokens`` individually timed single-token steps (transformers:
    the same loop over a DynamicCache);
  - prefill tokens/s: one forward over a ``--prefill-tokens`` prompt from an empty cache, median of
    ``--repeats`` after one warm-up (only the last position's logits computed, on both sides);
  - generate ms/token: prompt + N greedy tokens end to end, divided by N (transformers:
    ``generate(max_new_tokens=N, min_new_tokens=N)``; ours: the same loop through ModelRunner).
The two implementations are timed interleaved, step by step, so that load from other processes on
a shared machine hits both alike; ``decode_pair_ratio`` is the median of per-step ratios. Absolute
numbers on a shared 2-core CPU mean little: the ratios are the result.

    python loadtests/bench_forward.py [--threads 2] [--skip-hf] \\
        [--out loadtests/results/bench_forward.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from loadtests.results import write_json
from shared.engine.kv_cache import KVCache
from shared.engine.model_runner import ModelRunner, ScheduledChunk
from shared.engine.models.loader import resolve_model_path
from shared.engine.models.runtime import load_runtime

BLOCK_SIZE = 16
DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "bench_forward.json"
)


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def summarize(samples_s: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in samples_s)
    return {
        "median_ms": statistics.median(ms),
        "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
        "mean_ms": statistics.fmean(ms),
        "n": len(ms),
    }


class Ours:
    """One sequence through ModelRunner over a contiguous block table."""

    name = "llmserve"

    def __init__(self, model) -> None:
        self.model = model

    def reset(self, max_tokens: int) -> None:
        num_blocks = -(-max_tokens // BLOCK_SIZE)
        self.table = list(range(1, num_blocks + 1))
        self.runner = ModelRunner(
            self.model, KVCache(self.model.config, num_blocks + 1, BLOCK_SIZE, self.model.dtype)
        )

    def prefill(self, ids: list[int]) -> torch.Tensor:
        return self.runner.execute([ScheduledChunk(ids, 0, self.table)])[0]

    def step(self, token: int, position: int) -> torch.Tensor:
        return self.runner.execute([ScheduledChunk([token], position, self.table)])[0]

    def generate(self, ids: list[int], n: int) -> None:
        self.reset(len(ids) + n)
        logits = self.prefill(ids)
        for i in range(n - 1):
            logits = self.step(int(logits.argmax()), len(ids) + i)


class Reference:
    """The same operations on transformers with a DynamicCache."""

    name = "transformers"

    def __init__(self, model) -> None:
        self.model = model

    def reset(self, max_tokens: int) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        out = self.model(
            torch.tensor([ids]), past_key_values=self.cache, use_cache=True, logits_to_keep=1
        )
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def step(self, token: int, position: int) -> torch.Tensor:
        out = self.model(torch.tensor([[token]]), past_key_values=self.cache, use_cache=True)
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def generate(self, ids: list[int], n: int) -> None:
        prompt = torch.tensor([ids])
        self.model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )


def timed(fn, *args):
    t0 = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - t0


def bench(contenders: list, args, vocab: int) -> dict[str, Any]:
    """Every measurement interleaves the contenders (alternating who goes first)."""
    times: dict[str, dict[str, list[float]]] = {
        c.name: {"decode": [], "prefill": [], "generate": []} for c in contenders
    }
    prompt = random_ids(args.context, vocab, 1)
    steps = args.warmup + args.decode_tokens
    logits = {}
    for c in contenders:
        c.reset(args.context + steps + 1)
        logits[c.name] = c.prefill(prompt)
    for i in range(steps):
        for c in contenders if i % 2 == 0 else contenders[::-1]:
            # Each follows its own greedy path; the work per step does not depend on the token.
            logits[c.name], dt = timed(c.step, int(logits[c.name].argmax()), args.context + i)
            if i >= args.warmup:
                times[c.name]["decode"].append(dt)

    long_prompt = random_ids(args.prefill_tokens, vocab, 2)
    for r in range(args.repeats + 1):
        for c in contenders if r % 2 == 0 else contenders[::-1]:
            c.reset(args.prefill_tokens)
            _, dt = timed(c.prefill, long_prompt)
            if r:  # the first round is warm-up
                times[c.name]["prefill"].append(dt)

    for r in range(args.generate_repeats):
        for c in contenders if r % 2 == 0 else contenders[::-1]:
            _, dt = timed(c.generate, prompt, args.decode_tokens)
            times[c.name]["generate"].append(dt)

    out: dict[str, Any] = {}  # a dict per contender, and "decode_pair_ratio"
    for c in contenders:
        t = times[c.name]
        prefill_s = statistics.median(t["prefill"])
        out[c.name] = {
            "decode": summarize(t["decode"]),
            "prefill_s": prefill_s,
            "prefill_tok_s": args.prefill_tokens / prefill_s,
            "generate_ms_per_token": statistics.median(t["generate"]) * 1e3 / args.decode_tokens,
        }
    if len(contenders) == 2:
        a, b = (times[c.name]["decode"] for c in contenders)
        out["decode_pair_ratio"] = statistics.median(y / x for x, y in zip(a, b, strict=True))
    return out


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF path (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--context", type=int, default=128, help="prompt tokens before the timed decode")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument(
        "--repeats", type=int, default=3, help="timed prefills per implementation (median)"
    )
    p.add_argument("--generate-repeats", type=int, default=1)
    p.add_argument("--skip-hf", action="store_true", help="only our runtime")
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    hf_fp32 = None if args.skip_hf else load_hf(path)
    results, speedups = [], {}
    for dtype_name in dtypes:
        ours = load_runtime(path, dtype=dtype_name, progress=False)
        contenders: list[Ours | Reference] = [Ours(ours)]
        if hf_fp32 is not None:
            # The reference's own dequantized weights, cast as from_pretrained(dtype=...) would.
            hf = (
                hf_fp32 if dtype_name == "float32" else load_hf(path).to(getattr(torch, dtype_name))
            )
            contenders.append(Reference(hf))
        measured = bench(contenders, args, ours.config.vocab_size)
        for c in contenders:
            results.append({"impl": c.name, "dtype": dtype_name, **measured[c.name]})
            print(
                f"{c.name} {dtype_name}: decode "
                f"{measured[c.name]['decode']['median_ms']:.2f} ms/tok",
                file=sys.stderr,
            )
        if len(contenders) == 2:
            o, h = measured["llmserve"], measured["transformers"]
            speedups[dtype_name] = {
                "decode": h["decode"]["median_ms"] / o["decode"]["median_ms"],
                "decode_pair_ratio": measured["decode_pair_ratio"],
                "prefill": o["prefill_tok_s"] / h["prefill_tok_s"],
                "generate": h["generate_ms_per_token"] / o["generate_ms_per_token"],
            }
        del ours, contenders

    header = (
        f"{'impl':<13}{'dtype':<10}{'decode ms/tok':>14}{'p90':>9}{'prefill tok/s':>15}"
        f"{'generate ms/tok':>17}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['impl']:<13}{r['dtype']:<10}{r['decode']['median_ms']:>14.2f}{r['decode']['p90_ms']:>9.2f}"
            f"{r['prefill_tok_s']:>15.1f}{r['generate_ms_per_token']:>17.2f}"
        )
    for dtype_name, s in speedups.items():
        print(
            f"speedup llmserve vs transformers, {dtype_name}: decode {s['decode']:.2f}x "
            f"(per-step pairs {s['decode_pair_ratio']:.2f}x), prefill {s['prefill']:.2f}x, "
            f"generate {s['generate']:.2f}x"
        )

    report = {
        "benchmark": "bench_forward",
        "model": os.path.basename(path),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "host": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "load_avg_1m_at_end": os.getloadavg()[0],
        },
        "results": results,
        "speedups": speedups,
    }
    print(f"wrote {write_json(args.out, report)}")
    return report


if __name__ == "__main__":
    main()
