"""bench_engine ``--profile``: torch.profiler and cProfile of the engine's prefill and decode
steps, and the decode step's time against the number of sequences."""

from __future__ import annotations

import cProfile
import gc
import inspect
import io
import pstats
import time
from collections.abc import Callable
from typing import Any

from loadtests.engine_setup import log, make_llm, reset_prefix_cache
from shared.engine.llm import LLM
from shared.wire.sampling_params import SamplingParams


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
