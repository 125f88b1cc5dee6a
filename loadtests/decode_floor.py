"""The least time a token waits on a decode executor: its streams stepping in one engine alone,
pinned to the executor's cores, with nothing of the stack around it (``bench_disagg`` runs it for
the split's decode executor). Every token of a stream waits for one step of the engine that decodes
it, so these step times bound the stream's inter-token latency from below on those cores."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

import torch

from loadtests.bench_serving import percentile
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.wire.sampling_params import SamplingParams


def decode_floor(
    prompts: list[list[int]],
    cpus: tuple[int, ...],
    contexts: tuple[int, int],
    *,
    dtype: str | None = None,
    seed: int = 0,
    memory_budget: str = "1GiB",
) -> dict[str, Any]:
    """Decode ``prompts`` (one stream each, all of one length) greedily in one engine pinned to
    ``cpus`` (a thread a core) until each holds ``contexts[1]`` tokens, timing every step; the step
    times of those that start at a context from ``contexts[0]`` on, in ms. The process's cores and
    torch's thread count are restored afterwards."""
    first, last = contexts
    prompt_len = len(prompts[0])
    if any(len(p) != prompt_len for p in prompts):
        raise ValueError("the streams' prompts must all have one length")
    if not prompt_len < first <= last:
        raise ValueError(f"contexts {contexts} must run from past the prompts ({prompt_len})")
    affinity = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    try:
        config = EngineConfig(num_threads=len(cpus), memory_budget=memory_budget, seed=seed)
        if dtype is not None:
            config = replace(config, dtype=dtype)
        engine = LLM(config, progress=False).engine
        torch.set_num_threads(len(cpus))
        params = SamplingParams(max_tokens=last - prompt_len, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"stream-{i}", prompt, params)
        engine.step()  # the prompts, and each stream's first token
        steps_ms: list[float] = []
        context = prompt_len + 1
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            if context >= first:
                steps_ms.append((time.perf_counter() - start) * 1000)
            context += 1
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    return {
        "cpus": list(cpus),
        "contexts": [first, last],
        "step_ms": {
            "p50": percentile(steps_ms, 50),
            "p99": percentile(steps_ms, 99),
            "min": min(steps_ms),
            "count": len(steps_ms),
        },
    }
