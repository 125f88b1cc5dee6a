"""bench_engine (b)/(c): a mixed short/long trace through one engine, continuously batched or a
static batch at a time, sampled every forward pass for the KV cache's live tokens and reserved
slots."""

from __future__ import annotations

import gc
import random
import statistics
import time
from typing import Any
from unittest import mock

import msgspec

from loadtests.engine_setup import (
    build_prompts,
    load_average,
    log,
    make_llm,
    prefix_hits,
    reset_prefix_cache,
)
from loadtests.kv_accounting import KVSample, summarize_kv
from loadtests.workloads import fingerprint, mixed_trace
from shared.engine.llm import LLM
from shared.wire.sampling_params import SamplingParams

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
