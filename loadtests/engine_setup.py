"""What bench_engine's parts share: the engine they build (``make_llm``, warmed up, its prefix cache
emptied), the prompts, the process settings (``tune_malloc``) and the run's provenance."""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any

import torch

from loadtests.workloads import random_prompts, text_prompts
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.llm import LLM
from shared.wire.sampling_params import SamplingParams


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


def empty_prefix_cache(engine: Engine) -> None:
    """Drop every cached prefix block of an idle engine; a block still in use is an error."""
    if not engine.block_manager.reset_prefix_cache():
        raise RuntimeError("KV blocks still in use: the engine is not idle")


def reset_prefix_cache(llm: LLM) -> None:
    empty_prefix_cache(llm.engine)


def prefix_hits(llm: LLM) -> int:
    return llm.engine.block_manager.prefix_cache_hits_tokens


def build_prompts(args, tokenizer, lens: list[int], rng: random.Random, corpus: list[int] | None):
    if args.prompt_source == "random":
        return random_prompts(tokenizer.vocab_size, tokenizer.all_special_ids, lens, rng)
    assert corpus is not None
    return text_prompts(corpus, lens, rng)
