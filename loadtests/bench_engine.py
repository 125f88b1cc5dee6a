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
import cProfile
import gc
import inspect
import io
import os
import platform
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgspec
import torch

from loadtests import ceiling
from loadtests.kv_accounting import KVSample, summarize_kv
from loadtests.results import write_json
from loadtests.workloads import (
    corpus_token_ids,
    fingerprint,
    mixed_trace,
    random_prompts,
    text_prompts,
)
from shared.engine.config import EngineConfig
from shared.engine.default_model import default_model_path
from shared.engine.llm import LLM
from shared.engine.quantization import (
    KV_CACHE_DTYPE_HELP,
    KV_CACHE_DTYPES,
    QUANTIZATION_HELP,
    QUANTIZATIONS,
)
from shared.wire.sampling_params import SamplingParams

DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "bench_engine.json"
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def engine_revision() -> dict[str, Any]:
    """The commit measured and whether shared/engine differs from it (the tree is shared and
    moves)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "shared/engine"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        return {
            "commit": head,
            "engine_modified_files": [line[3:] for line in dirty if line.strip()],
        }
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "engine_modified_files": None}


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def tune_malloc(threshold: int = 1 << 30) -> bool:
    """Keep glibc from returning big freed blocks to the OS (mmap threshold and trim threshold
    raised).

    With glibc's defaults the engine's per-layer decode temporaries (the gathered K/V upcast to
    fp32, ~15 MB each at 32 sequences x 600 tokens) are mmapped and unmapped on every layer of every
    step: measured here ~237k minor page faults and ~0.5 s of system time per 32-sequence decode
    step, 2-3x the step's cost, and whether a process falls into that state varies from run to run.
    glibc only; returns whether both settings were accepted."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, threshold)) and bool(
            libc.mallopt(m_trim_threshold, threshold)
        )
    except (OSError, AttributeError):
        return False


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


# ---- engine helpers ------------------------------------------------------------------------------


def make_llm(args, *, max_num_seqs: int, max_num_batched_tokens: int, **config_overrides) -> LLM:
    """An engine for ``args`` (warmed up, prefix cache empty); ``config_overrides``: other
    ``EngineConfig`` fields (e.g. ``enable_prefix_caching=False``)."""
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        memory_budget=args.memory_budget,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_threads=args.threads,
        seed=args.seed,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        **config_overrides,
    )
    llm = LLM(config, progress=False)
    torch.set_num_threads(args.threads)
    warm_up(llm)
    return llm


def warm_up(llm: LLM) -> None:
    """A short generate to warm the kernels and allocator; then forget its blocks so nothing hits
    the prefix cache."""
    rng = random.Random(12345)
    tok = llm.tokenizer
    prompts = random_prompts(tok.vocab_size, tok.all_special_ids, [48, 80], rng)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    reset_prefix_cache(llm)


def reset_prefix_cache(llm: LLM) -> None:
    if not llm.engine.block_manager.reset_prefix_cache():
        raise RuntimeError("KV blocks still in use after a finished run")


def prefix_hits(llm: LLM) -> int:
    return llm.engine.block_manager.prefix_cache_hits_tokens


def build_prompts(args, tokenizer, lens: list[int], rng: random.Random, corpus: list[int] | None):
    if args.prompt_source == "random":
        return random_prompts(tokenizer.vocab_size, tokenizer.all_special_ids, lens, rng)
    assert corpus is not None
    return text_prompts(corpus, lens, rng)


# ---- (a) offline throughput ----------------------------------------------------------------------


def bench_engine_offline(args, prompts: list[list[int]]) -> dict[str, Any]:
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    expected = len(prompts) * args.output_len
    runs = []
    best_outputs = None
    for mbt in args.batched_tokens:
        llm = make_llm(args, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=mbt)
        engine = llm.engine
        for rep in range(args.repeats):
            log(
                f"(a) engine: {len(prompts)} prompts x {args.output_len} tokens, "
                f"max_num_batched_tokens={mbt}, max_num_seqs={args.max_num_seqs} "
                f"(repeat {rep + 1}/{args.repeats})"
            )
            hits0, stats0 = prefix_hits(llm), engine.stats()
            phase: dict[str, float] = {}
            original_step = engine.step

            def step(engine=engine, original_step=original_step, phase=phase):
                # timestamps the end of the prefill phase (every prompt fully computed)
                out = original_step()
                if (
                    "prefill_done" not in phase
                    and not engine.scheduler.waiting
                    and all(s.num_uncomputed <= 1 for s in engine.scheduler.running)
                ):
                    phase["prefill_done"] = time.perf_counter()
                    phase["tokens_at_prefill_done"] = engine.stats().num_generated_tokens
                return out

            with mock.patch.object(engine, "step", step):
                t0, c0 = time.perf_counter(), time.process_time()
                results = llm.generate(prompts, params)
                elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
            num_out = sum(len(r.outputs[0].token_ids) for r in results)
            if num_out != expected:
                raise RuntimeError(f"engine produced {num_out} tokens, expected {expected}")
            stats = engine.stats()
            prefill_s = phase["prefill_done"] - t0
            decode_tokens = stats.num_generated_tokens - phase["tokens_at_prefill_done"]
            run = dict(
                max_num_batched_tokens=mbt,
                max_num_seqs=args.max_num_seqs,
                repeat=rep,
                elapsed_s=elapsed,
                cpu_s=cpu,
                num_output_tokens=num_out,
                output_tokens_per_s=num_out / elapsed,
                output_tokens_per_cpu_s=num_out / cpu,
                total_tokens_per_s=(num_out + sum(map(len, prompts))) / elapsed,
                prefill_phase_s=prefill_s,
                decode_phase_tokens_per_s=decode_tokens / (elapsed - prefill_s),
                num_steps=stats.num_steps - stats0.num_steps,
                num_kv_blocks=engine.kv_cache.num_blocks,
                num_preemptions=stats.num_preemptions - stats0.num_preemptions,
                prefix_cache_hit_tokens=prefix_hits(llm) - hits0,
                load_avg=load_average(),
            )
            log(
                f"    {num_out} tokens in {elapsed:.1f}s = {run['output_tokens_per_s']:.1f} tok/s "
                f"({run['num_steps']} steps; prefill phase {prefill_s:.1f}s, decode phase "
                f"{run['decode_phase_tokens_per_s']:.1f} tok/s)"
            )
            runs.append(run)
            if run["output_tokens_per_s"] >= max(r["output_tokens_per_s"] for r in runs):
                best_outputs = [r.outputs[0].token_ids for r in results]
            reset_prefix_cache(llm)
            del results
        model_config = engine.model.config
        del llm, engine
        gc.collect()
    best = max(runs, key=lambda r: r["output_tokens_per_s"])
    return {"runs": runs, "best": best, "outputs": best_outputs, "model_config": model_config}


def offline_ceiling(
    args, model_config, prompt_lens: list[int], best_tok_s: float
) -> dict[str, Any]:
    """The run's arithmetic at this host's measured peak (loadtests/ceiling.py): the most output
    tokens/s any engine could reach here (bf16 models; int8 decoder linears at the int8 peak)."""
    if args.dtype != "bfloat16":
        return dict(skipped=f"computed for bfloat16 only, not {args.dtype}")
    flops = ceiling.run_flops(model_config, prompt_lens, args.output_len)
    try:
        bf16 = ceiling.bf16_peak_gflops(args.threads)
        int8 = ceiling.int8_peak_gops(args.threads) if args.quantization == "int8" else None
    except RuntimeError as exc:
        return dict(skipped=str(exc))
    seconds = ceiling.ceiling_seconds(flops, bf16, int8)
    tok_s = len(prompt_lens) * args.output_len / seconds
    log(
        f"(a) ceiling: {sum(flops.values()) / 1e12:.2f} TFLOP at bf16 {bf16:.0f} GFLOP/s"
        + (f", int8 {int8:.0f} GOPS" if int8 else "")
        + f" peak: >= {seconds:.2f} s, <= {tok_s:.0f} tok/s"
    )
    return dict(
        flops=flops,
        bf16_peak_gflops=bf16,
        int8_peak_gops=int8,
        seconds=seconds,
        output_tokens_per_s=tok_s,
        best_fraction=best_tok_s / tok_s,
    )


def bench_hf_offline(
    args, prompts: list[list[int]], pad_token_id: int, dtype_name: str
) -> dict[str, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, dtype_name)
    log(f"(a) transformers: loading the same GGUF (dequantized to {dtype_name})")
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(args.model), gguf_file=os.path.basename(args.model), dtype=dtype
    ).eval()
    load_s = time.perf_counter() - t0

    def batch(ps: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(map(len, ps))
        ids = torch.full((len(ps), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(ps), width), dtype=torch.long)
        for i, p in enumerate(ps):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        return ids, mask

    calls: list[float] = []

    def timestamps(input_ids, scores):  # a logits processor: called once per generated position
        calls.append(time.perf_counter())
        return scores

    def generate(ps, n, max_time=None):
        ids, mask = batch(ps)
        calls.clear()
        with torch.inference_mode():
            out = model.generate(  # noqa: F821 (a closure cell, which `del model` below empties)
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=pad_token_id,
                max_time=max_time,
                logits_processor=transformers.LogitsProcessorList([timestamps]),
            )
        return out[:, ids.shape[1] :]

    rng = random.Random(12345)
    generate(random_prompts(model.config.vocab_size, range(17), [48, 80], rng), 4)  # warm-up
    log(
        f"(a) transformers: batch of {len(prompts)} x {args.output_len} tokens "
        f"(stops early past {args.hf_max_time:.0f}s)"
    )
    t0, c0 = time.perf_counter(), time.process_time()
    new = generate(prompts, args.output_len, max_time=args.hf_max_time)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    num_new = new.shape[1]
    prefill_s = calls[0] - t0
    decode_tokens_per_s = (
        (num_new - 1) * len(prompts) / (elapsed - prefill_s) if num_new > 1 else None
    )
    complete = num_new == args.output_len
    num_out = num_new * len(prompts)
    log(
        f"    {num_out} tokens in {elapsed:.1f}s = {num_out / elapsed:.1f} tok/s"
        + ("" if complete else f" (TRUNCATED at {num_new}/{args.output_len} tokens per prompt)")
    )
    result = dict(
        dtype=dtype_name,
        load_s=load_s,
        elapsed_s=elapsed,
        cpu_s=cpu,
        output_tokens_per_cpu_s=num_out / cpu,
        batch_size=len(prompts),
        new_tokens_per_prompt=num_new,
        complete=complete,
        num_output_tokens=num_out,
        output_tokens_per_s=num_out / elapsed,
        prefill_phase_s=prefill_s,
        decode_phase_tokens_per_s=decode_tokens_per_s,
        load_avg=load_average(),
        padded_width=max(map(len, prompts)),
        measured=(
            f"full batch: {len(prompts)} prompts x {num_new} tokens"
            if complete
            else f"full batch of {len(prompts)} prompts, stopped by max_time after {num_new} of "
            f"{args.output_len} tokens each; tok/s is over what was generated"
        ),
        outputs=new.tolist(),
    )
    del model
    gc.collect()
    return result


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """Greedy agreement (informative: bf16 paths may diverge where the top-2 logits nearly tie)."""
    prefixes = []
    for a, b in zip(ours, theirs, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefixes.append(n)
    compared = min(len(theirs[0]), len(ours[0])) if theirs else 0
    return dict(
        tokens_compared=compared,
        identical_prompts=sum(p == compared for p in prefixes),
        num_prompts=len(prefixes),
        median_common_prefix=statistics.median(prefixes),
    )


# ---- (b)/(c) mixed trace -------------------------------------------------------------------------

# continuous first, then the two static baselines (see the module docstring)
MIX_MODES = ("continuous", "static", "static_padded")


def run_trace(
    llm: LLM,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    label: str,
    static_batch: int | None,
    contiguous_limits: dict[str, list[int]],
    padded: bool = False,
) -> dict[str, Any]:
    """Run the trace; static_batch=None submits everything at once (continuous batching), else B at
    a time, each batch stepped to completion. padded: every member of a static batch decodes as
    many tokens as its longest and only its own max_tokens are counted. Records a KVSample as
    every forward pass starts (a layered long prefill's forward runs over several steps: one
    sample)."""
    engine = llm.engine
    bs = engine.block_manager.block_size
    samples: list[KVSample] = []
    index_of: dict[str, int] = {}
    original_start = engine.runner.start

    def start(chunks):
        running = engine.scheduler.running
        live = sum(s.num_computed_tokens for s in running) + sum(len(c.token_ids) for c in chunks)
        contiguous = {
            name: sum(limit[index_of[s.request.request_id]] for s in running)
            for name, limit in contiguous_limits.items()
        }
        samples.append(KVSample(live, engine.block_manager.num_used_blocks * bs, contiguous))
        return original_start(chunks)

    hits0, steps0, pre0 = (
        prefix_hits(llm),
        engine.stats().num_steps,
        engine.scheduler.num_preemptions,
    )
    n = len(prompts)
    groups = (
        [range(n)]
        if static_batch is None
        else [range(i, min(i + static_batch, n)) for i in range(0, n, static_batch)]
    )
    num_tokens = [0] * n
    finish_s = [0.0] * n
    expected = [_fixed_max_tokens(p) for p in params]
    # an instance attribute shadows the method until the run is over
    with mock.patch.object(engine.runner, "start", start):
        t0, c0 = time.perf_counter(), time.process_time()
        for group in groups:
            longest = max(expected[i] for i in group)
            for i in group:
                rid = f"{label}-{i}"
                index_of[rid] = i
                engine.add_request(
                    rid,
                    prompts[i],
                    msgspec.structs.replace(params[i], max_tokens=longest) if padded else params[i],
                )
            while engine.has_unfinished():
                for out in engine.step():
                    i = index_of[out.request_id]
                    num_tokens[i] += sum(len(d.token_ids) for d in out.deltas)
                    if out.finished:
                        finish_s[i] = time.perf_counter() - t0
            if padded:  # the surplus a fixed-shape batch computes and throws away
                for i in group:
                    num_tokens[i] = min(num_tokens[i], expected[i])
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    if num_tokens != expected:
        raise RuntimeError(f"{label}: generated {num_tokens}, expected {expected}")
    total = sum(num_tokens)
    result = dict(
        elapsed_s=elapsed,
        cpu_s=cpu,
        num_output_tokens=total,
        output_tokens_per_s=total / elapsed,
        output_tokens_per_cpu_s=total / cpu,
        num_steps=engine.stats().num_steps - steps0,
        num_preemptions=engine.scheduler.num_preemptions - pre0,
        prefix_cache_hit_tokens=prefix_hits(llm) - hits0,
        mean_e2e_s=statistics.fmean(finish_s),
        median_e2e_s=statistics.median(finish_s),
        mean_e2e_short_s=_mean_where(finish_s, expected, min(expected)),
        mean_e2e_long_s=_mean_where(finish_s, expected, max(expected)),
        kv=summarize_kv(samples),
    )
    reset_prefix_cache(llm)
    return result


def _fixed_max_tokens(p: SamplingParams) -> int:
    assert p.max_tokens is not None  # every request of the trace asks for a set number of tokens
    return p.max_tokens


def _mean_where(values: list[float], keys: list[int], key: int) -> float:
    return statistics.fmean(v for v, k in zip(values, keys, strict=True) if k == key)


def bench_mix(args, corpus: list[int] | None) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    trace = mixed_trace(
        args.mix_requests,
        rng,
        prompt_len_range=args.mix_prompt_len,
        short_tokens=args.mix_short,
        long_tokens=args.mix_long,
        long_fraction=args.mix_long_frac,
    )
    log(
        f"(b) mixed trace: {len(trace)} requests, outputs {args.mix_short}/{args.mix_long} "
        f"({sum(r.max_tokens == args.mix_long for r in trace)} long), B={args.mix_batch}, "
        f"max_num_batched_tokens={args.mix_batched_tokens}"
    )
    llm = make_llm(
        args, max_num_seqs=args.mix_batch, max_num_batched_tokens=args.mix_batched_tokens
    )
    prompts = build_prompts(args, llm.tokenizer, [r.prompt_len for r in trace], rng, corpus)
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in trace
    ]
    max_out = max(r.max_tokens for r in trace)
    limits = {
        "prompt+max_tokens": [len(p) + r.max_tokens for p, r in zip(prompts, trace, strict=True)],
        "prompt+trace_max_tokens": [len(p) + max_out for p in prompts],
        "max_model_len": [llm.engine.max_model_len] * len(prompts),
    }
    best: dict[str, dict[str, Any]] = {}
    all_tps: dict[str, list[float]] = {mode: [] for mode in MIX_MODES}
    for rep in range(args.repeats):  # alternate the modes so drifting load hits all alike
        for mode in MIX_MODES:
            static_batch = None if mode == "continuous" else args.mix_batch
            log(
                f"(b) {mode} batching"
                + (f" (batches of {static_batch})" if static_batch else "")
                + f" (repeat {rep + 1}/{args.repeats})"
            )
            r = run_trace(
                llm,
                prompts,
                params,
                label=f"{mode}{rep}",
                static_batch=static_batch,
                contiguous_limits=limits,
                padded=mode == "static_padded",
            )
            r["load_avg"] = load_average()
            log(f"    {r['output_tokens_per_s']:.1f} tok/s, {r['num_steps']} steps")
            all_tps[mode].append(r["output_tokens_per_s"])
            if mode not in best or r["output_tokens_per_s"] > best[mode]["output_tokens_per_s"]:
                best[mode] = r
    for mode in MIX_MODES:
        best[mode]["all_output_tokens_per_s"] = all_tps[mode]
    cont, stat, padded = best["continuous"], best["static"], best["static_padded"]
    out = dict(
        trace=dict(
            num_requests=len(trace),
            short_tokens=args.mix_short,
            long_tokens=args.mix_long,
            num_long=sum(r.max_tokens == args.mix_long for r in trace),
            prompt_len_range=list(args.mix_prompt_len),
            batch_size=args.mix_batch,
            max_num_batched_tokens=args.mix_batched_tokens,
            max_model_len=llm.engine.max_model_len,
            block_size=llm.engine.block_manager.block_size,
            prompts_fingerprint=fingerprint(prompts),
            num_prompt_tokens=sum(map(len, prompts)),
            # per request, in trace order: what a KV footprint is computed from
            prompt_lens=[len(p) for p in prompts],
            max_tokens=[r.max_tokens for r in trace],
            num_kv_blocks=llm.engine.kv_cache.num_blocks,  # the pool, padding block included
        ),
        continuous=cont,
        static=stat,
        static_padded=padded,
        throughput_ratio=cont["output_tokens_per_s"] / stat["output_tokens_per_s"],
        cpu_throughput_ratio=cont["output_tokens_per_cpu_s"] / stat["output_tokens_per_cpu_s"],
        padded_throughput_ratio=cont["output_tokens_per_s"] / padded["output_tokens_per_s"],
        padded_cpu_throughput_ratio=cont["output_tokens_per_cpu_s"]
        / padded["output_tokens_per_cpu_s"],
    )
    del llm
    gc.collect()
    return out


# ---- profile -------------------------------------------------------------------------------------


def _breakdown_targets() -> dict[tuple[str, int, str], str]:
    """Engine functions whose cumulative time in one cProfiled step is reported, keyed by cProfile's
    (file, first line, name) of their code objects."""
    from shared.engine.attention.backend import TorchAttentionBackend
    from shared.engine.attention.metadata import build_attention_metadata
    from shared.engine.block_manager import BlockManager
    from shared.engine.engine import Engine
    from shared.engine.model_runner import Forward
    from shared.engine.models.llama import LlamaModel
    from shared.engine.scheduler import Scheduler

    # The linears' share is in the op table (the fused path calls them without a module in
    # between).
    funcs: list[tuple[str, Callable[..., Any]]] = [
        ("schedule", Scheduler.schedule),
        ("attn_metadata", build_attention_metadata),
        ("forward", Forward.advance),
        ("attention(all)", TorchAttentionBackend.attend),
        ("attention_decode", TorchAttentionBackend._decode),
        ("lm_head", LlamaModel.compute_logits),
        ("sample", Engine._sample),
        ("block_commit", BlockManager.commit),
        ("outputs", Engine._collect_outputs),
    ]
    codes = [(label, inspect.unwrap(f).__code__) for label, f in funcs]  # past @inference_mode
    return {(c.co_filename, c.co_firstlineno, c.co_name): label for label, c in codes}


def profile_engine(args, prompts: list[list[int]], mbt: int) -> dict[str, Any]:
    """Profile (1) the first step of the offline workload (a full prefill chunk) and (2) decode
    steps with every prompt running, with torch.profiler (ops) and cProfile (Python)."""
    from torch.profiler import ProfilerActivity, profile

    llm = make_llm(args, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=mbt)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"prof-{i}", p, params)
    report: dict[str, Any] = {"max_num_batched_tokens": mbt, "num_seqs": len(prompts)}

    def profiled(name: str, num_steps: int) -> None:
        num_tokens = []
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(num_steps):
                engine.step()
                num_tokens.append(engine.stats().last_step_num_tokens)
            wall = time.perf_counter() - t0
        cp = cProfile.Profile()
        t1 = time.perf_counter()
        cp.enable()
        engine.step()
        cp.disable()
        cp_wall = time.perf_counter() - t1
        targets = _breakdown_targets()
        by_name = dict.fromkeys(targets.values(), 0.0)
        cp.create_stats()  # what pstats.Stats(cp) reads: cp.stats
        for key, (_, _, _, cumtime, _) in cp.stats.items():
            if key in targets:
                by_name[targets[key]] += cumtime
        ka = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in ka)
        top = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
        s = io.StringIO()
        pstats.Stats(cp, stream=s).sort_stats("tottime").print_stats(12)
        report[name] = dict(
            num_steps=num_steps,
            tokens_per_step=num_tokens,
            ms_per_step=1000 * wall / num_steps,
            top_ops=[
                dict(
                    op=e.key,
                    calls=e.count,
                    self_ms_per_step=e.self_cpu_time_total / 1000 / num_steps,
                    self_pct=100 * e.self_cpu_time_total / total,
                )
                for e in top
            ],
            cprofile_step_ms=1000 * cp_wall,
            cprofile_top=s.getvalue(),
            breakdown_ms={k: 1000 * v for k, v in by_name.items()},
        )

    log(f"profile: first step (prefill chunk of up to {mbt} tokens)")
    profiled("prefill", 1)
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()
    log(f"profile: decode steps with {engine.scheduler.num_running} running")
    profiled("decode", 5)
    for i in range(len(prompts)):
        engine.abort(f"prof-{i}")
    reset_prefix_cache(llm)
    report["decode_scaling"] = decode_scaling(llm, prompts, args.max_num_seqs)
    del llm
    gc.collect()
    return report


def decode_scaling(
    llm: LLM, prompts: list[list[int]], max_seqs: int, *, context: int = 256, num_steps: int = 5
) -> list[dict[str, float]]:
    """Decode-only step time vs batch size at a fixed context: how much batching buys per token.
    Requests get room for every token they may decode while the later ones still prefill; they are
    aborted once timed."""
    engine = llm.engine
    params = SamplingParams(max_tokens=context, temperature=0.0, ignore_eos=True)
    rows = []
    for batch in sorted({1, 4, 8, 16, 32, max_seqs}):
        if batch > max_seqs:
            continue
        ids = [f"scale-{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):  # same length, distinct starts (no prefix hits)
            engine.add_request(
                rid, (prompts[i % len(prompts)] * 4)[i // len(prompts) :][:context], params
            )
        while engine.scheduler.waiting or any(
            s.num_uncomputed > 1 for s in engine.scheduler.running
        ):
            engine.step()
        engine.step()  # first decode-only step, untimed
        if engine.scheduler.num_running != batch:
            raise RuntimeError(
                f"decode scaling: {engine.scheduler.num_running} running, expected {batch}"
            )
        t0 = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        ms = 1000 * (time.perf_counter() - t0) / num_steps
        rows.append(
            dict(
                batch=batch, context=context, ms_per_step=ms, output_tokens_per_s=1000 * batch / ms
            )
        )
        log(
            f"    decode batch {batch:>3} @ {context} ctx: {ms:.0f} ms/step = "
            f"{rows[-1]['output_tokens_per_s']:.0f} tok/s"
        )
        for rid in ids:
            engine.abort(rid)
        reset_prefix_cache(llm)
    return rows


# ---- report --------------------------------------------------------------------------------------


def print_ceiling(c: dict[str, Any], hf_runs: list[dict[str, Any]]) -> None:
    if "skipped" in c:
        print(f"    ceiling: not computed ({c['skipped']})")
        return
    f = c["flops"]
    peaks = f"bf16 {c['bf16_peak_gflops']:.0f} GFLOP/s" + (
        f", int8 {c['int8_peak_gops']:.0f} GOPS" if c["int8_peak_gops"] else ""
    )
    versus = "".join(
        f", {c['output_tokens_per_s'] / hf['output_tokens_per_s']:.2f}x transformers {hf['dtype']}"
        for hf in hf_runs
    )
    print(
        f"    ceiling: the run's {sum(f.values()) / 1e12:.2f} TFLOP "
        f"(decoder linears {f['decoder_linears'] / 1e12:.2f}, "
        f"lm_head {f['lm_head'] / 1e12:.2f}, attention {f['attention'] / 1e12:.2f})\n"
        f"    take >= {c['seconds']:.2f} s at this host's measured peak "
        f"({peaks}; python -m loadtests.ceiling):\n"
        f"    at most {c['output_tokens_per_s']:.0f} output tok/s{versus}; "
        f"the best engine run reached {100 * c['best_fraction']:.0f}% of it"
    )


def print_report(res: dict[str, Any]) -> None:
    line = "-" * 96
    print(line)
    print(
        f"bench_engine  model={os.path.basename(res['config']['model'])}  "
        f"dtype={res['config']['dtype']}  "
        f"quantization={res['config'].get('quantization')}  "
        f"kv_cache_dtype={res['config'].get('kv_cache_dtype', 'auto')}  "
        f"threads={res['config']['threads']}\n"
        f"  OMP_WAIT_POLICY={res['env']['omp_wait_policy']}  "
        f"malloc_tuned={res['env']['malloc_tuned']}  "
        f"repeats={res['config']['repeats']} (best kept)  "
        f"load avg start/end={res['env']['load_avg_start']}"
        f"/{res['env']['load_avg_end']}  total {res['env']['total_s']:.0f}s\n  engine at commit "
        f"{res['env']['commit']}"
        + (
            f" + uncommitted changes to {res['env']['engine_modified_files']}"
            if res["env"]["engine_modified_files"]
            else ""
        )
    )
    a = res.get("offline")
    if a:
        print(line)
        print(
            f"(a) offline throughput: {a['num_prompts']} prompts, {a['prompt_len_range'][0]}-"
            f"{a['prompt_len_range'][1]} tokens ({a['num_prompt_tokens']} total), "
            f"{a['output_len']} greedy output tokens each"
        )
        print(
            f"    {'system':<44}{'output tok/s':>13}{'elapsed s':>10}{'steps':>7}{'prefill s':>10}"
            f"{'decode tok/s':>13}{'tok/CPU-s':>11}"
        )
        for r in a["engine"]["runs"]:
            name = (
                f"llmserve LLM.generate mbt={r['max_num_batched_tokens']} seqs={r['max_num_seqs']}"
            )
            if (
                len(
                    [
                        x
                        for x in a["engine"]["runs"]
                        if x["max_num_batched_tokens"] == r["max_num_batched_tokens"]
                    ]
                )
                > 1
            ):
                name += f" #{r['repeat'] + 1}"
            print(
                f"    {name:<44}{r['output_tokens_per_s']:>13.1f}{r['elapsed_s']:>10.1f}"
                f"{r['num_steps']:>7}"
                f"{r['prefill_phase_s']:>10.1f}{r['decode_phase_tokens_per_s']:>13.1f}"
                f"{r['output_tokens_per_cpu_s']:>11.1f}"
            )
        hf_runs = a.get("hf_runs")
        if hf_runs:
            for hf in hf_runs:
                dec = hf["decode_phase_tokens_per_s"]
                name = f"transformers generate {hf['dtype']} (batched)"
                print(
                    f"    {name:<44}{hf['output_tokens_per_s']:>13.1f}"
                    f"{hf['elapsed_s']:>10.1f}{hf['new_tokens_per_prompt']:>7}"
                    f"{hf['prefill_phase_s']:>10.1f}"
                    f"{dec if dec is None else format(dec, '.1f'):>13}"
                    f"{hf['output_tokens_per_cpu_s']:>11.1f}"
                )
            print(
                "    (prefill s: until every prompt is computed; "
                "decode tok/s: output tokens after that / time;\n"
                "     tok/CPU-s: output tokens per second of this process's CPU time, "
                "less sensitive to neighbours)"
            )
            engine = res["config"]["dtype"] + (" int8" if res["config"].get("quantization") else "")
            kv = res["config"].get("kv_cache_dtype", "auto")
            engine += f", {kv} KV" if kv != "auto" else ""
            for hf in hf_runs:
                print(f"    transformers {hf['dtype']} measured: {hf['measured']}")
                print(
                    "    ratio best engine "
                    f"(mbt={a['engine']['best']['max_num_batched_tokens']}, {engine}) / "
                    f"transformers {hf['dtype']} = {hf['ratio']:.2f}x wall, "
                    f"{hf['cpu_ratio']:.2f}x per CPU-second   (target >= 8x)"
                )
            ag = a["agreement"]
            print(
                f"    greedy agreement with transformers {hf_runs[0]['dtype']} over "
                f"{ag['tokens_compared']} tokens: {ag['identical_prompts']}/"
                f"{ag['num_prompts']} identical, median common prefix {ag['median_common_prefix']}"
            )
        else:
            print("    transformers baseline skipped")
        print_ceiling(a["ceiling"], hf_runs or [])
    b = res.get("mix")
    if b:
        t = b["trace"]
        print(line)
        print(
            f"(b) continuous vs static batching: {t['num_requests']} requests ({t['num_long']} x "
            f"{t['long_tokens']} + {t['num_requests'] - t['num_long']} x {t['short_tokens']} "
            f"output tokens), prompts {t['prompt_len_range'][0]}-{t['prompt_len_range'][1]}, "
            f"B=max_num_seqs={t['batch_size']}"
        )
        print(
            f"    {'mode':<14}{'output tok/s':>14}{'elapsed s':>12}{'steps':>8}{'mean E2E s':>12}"
            f"{'short E2E':>11}{'long E2E':>10}{'tok/CPU-s':>11}"
        )
        for mode in MIX_MODES:
            r = b[mode]
            print(
                f"    {mode:<14}{r['output_tokens_per_s']:>14.1f}{r['elapsed_s']:>12.1f}"
                f"{r['num_steps']:>8}"
                f"{r['mean_e2e_s']:>12.1f}{r['mean_e2e_short_s']:>11.1f}{r['mean_e2e_long_s']:>10.1f}"
                f"{r['output_tokens_per_cpu_s']:>11.1f}"
            )
        for key, name in (("", "static"), ("padded_", "static_padded")):
            print(
                f"    ratio continuous / {name} = {b[key + 'throughput_ratio']:.2f}x wall, "
                f"{b[key + 'cpu_throughput_ratio']:.2f}x per CPU-second   (target >= 2x)"
            )
        if len(b["continuous"]["all_output_tokens_per_s"]) > 1:
            print(
                "    all runs tok/s: "
                + ", ".join(
                    f"{mode} {[round(x, 1) for x in b[mode]['all_output_tokens_per_s']]}"
                    for mode in MIX_MODES
                )
            )
        print(
            "    per step: "
            + ", ".join(
                f"{mode} {1000 * r['elapsed_s'] / r['num_steps']:.0f} ms"
                + (
                    f" ({r['num_steps'] / b['continuous']['num_steps']:.2f}x the steps)"
                    if mode != "continuous"
                    else ""
                )
                for mode in MIX_MODES
                for r in [b[mode]]
            )
        )
        print(line)
        kv = b["continuous"]["kv"]
        print(
            "(c) KV utilization, live tokens / reserved slots, continuous run of (b), "
            f"{kv['num_steps']} steps "
            f"(block_size={t['block_size']}, max_model_len={t['max_model_len']})"
        )
        print(
            f"    {'scheme':<34}{'step mean':>10}{'weighted':>10}{'min':>8}{'@peak':>8}"
            f"{'peak slots':>12}{'x paged':>9}"
        )
        rows = [("paged (block manager)", kv["paged"])] + [
            (f"contiguous: {name}", s) for name, s in kv["contiguous"].items()
        ]
        for name, s in rows:
            print(
                f"    {name:<34}{100 * s['util_step_mean']:>9.1f}%"
                f"{100 * s['util_slot_weighted']:>9.1f}%"
                f"{100 * s['util_min']:>7.1f}%{100 * s['util_at_peak_reserved']:>7.1f}%"
                f"{s['peak_reserved_slots']:>12}{s.get('mean_reserved_vs_paged', 1.0):>8.2f}x"
            )
        print(
            f"    peak live tokens {kv['peak_live_tokens']}; paged target >= 90% "
            "(static run: paged step mean "
            f"{100 * b['static']['kv']['paged']['util_step_mean']:.1f}%)"
        )
    pr = res.get("profile")
    if pr:
        print(line)
        for phase in ("prefill", "decode"):
            ph = pr[phase]
            print(
                f"profile {phase}: {ph['ms_per_step']:.0f} ms/step, "
                f"tokens/step {ph['tokens_per_step']}, "
                f"cProfile step {ph['cprofile_step_ms']:.0f} ms"
            )
            print(
                "    step breakdown (cProfile cumulative, ms): "
                + ", ".join(f"{k}={v:.0f}" for k, v in ph["breakdown_ms"].items())
            )
            for op in ph["top_ops"][:10]:
                print(
                    f"    {op['op']:<44}{op['calls']:>7}{op['self_ms_per_step']:>10.1f} ms/step"
                    f"{op['self_pct']:>7.1f}%"
                )
        if pr.get("decode_scaling"):
            print(
                "decode-only scaling (ms/step -> output tok/s): "
                + ", ".join(
                    f"B={r['batch']}: {r['ms_per_step']:.0f} -> {r['output_tokens_per_s']:.0f}"
                    for r in pr["decode_scaling"]
                )
                + f" (context {pr['decode_scaling'][0]['context']})"
            )
    print(line)


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
