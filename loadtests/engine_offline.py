"""bench_engine (a): offline throughput of ``LLM.generate`` on N prompts, against transformers'
batched ``generate`` on the same token ids, with the run's arithmetic ceiling."""

from __future__ import annotations

import gc
import os
import random
import statistics
import time
from typing import Any
from unittest import mock

import torch

from loadtests import ceiling
from loadtests.engine_setup import load_average, log, make_llm, prefix_hits, reset_prefix_cache
from loadtests.workloads import random_prompts
from shared.wire.sampling_params import SamplingParams


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
