"""The mixed short/long trace of ``bench_engine`` (b)/(c), run once: continuous batching, static
batching and static padded batching on the same engine, with a KV sample before every forward
pass. ``batching.py`` and ``paged_kv.py`` both read its JSON."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from loadtests.report.plan import Plan

KEY = "mix"
SOURCE = f"raw/{KEY}.json"


def engine_argv(plan: Plan) -> list[str]:
    """``bench_engine``'s flags for this plan's trace (also the command that reproduces it)."""
    return [
        "--skip-offline",
        "--skip-hf",
        "--threads",
        str(plan.threads),
        "--mix-requests",
        str(plan.mix_requests),
        "--mix-batch",
        str(plan.mix_batch),
        "--mix-prompt-len",
        f"{plan.mix_prompt_len[0]},{plan.mix_prompt_len[1]}",
        "--mix-short",
        str(plan.mix_short),
        "--mix-long",
        str(plan.mix_long),
    ]


def command(plan: Plan) -> str:
    return "python -m loadtests.bench_engine " + " ".join(engine_argv(plan))


@functools.cache
def tokenizer_and_corpus(model: str) -> tuple[Any, list[int]]:
    """The model's tokenizer and the benchmark corpus in its tokens, built once per process (reading
    a GGUF's vocabulary takes seconds, tens of them on a busy host)."""
    from loadtests.workloads import corpus_token_ids
    from shared.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(model)
    corpus = corpus_token_ids(
        lambda s: tokenizer.encode(s, add_special_tokens=False), tokenizer.all_special_ids
    )
    return tokenizer, corpus


def measure(plan: Plan, log: Callable[[str], None]) -> dict[str, Any]:
    from loadtests import bench_engine, engine_mix

    args = bench_engine.parse_args(engine_argv(plan))
    _, corpus = tokenizer_and_corpus(args.model)
    log(f"mixed trace: {plan.mix_requests} requests, batch {plan.mix_batch}")
    result = engine_mix.bench_mix(args, corpus)
    result["command"] = command(plan)
    return result
