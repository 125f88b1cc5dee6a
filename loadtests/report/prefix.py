"""Prefix caching: time to first token vs the length of a prefix shared with an earlier request,
and the hit rate, on the engine in process with prefix caching on and off.

Per shared-prefix length L: a fresh random prefix of L tokens; one request (prefix + its own
suffix) runs first and fills the cache; then ``prefix_requests`` more, each the same prefix with a
suffix of its own, one at a time, each asking for one token: TTFT = from ``add_request`` to the
step that returns its first token (no HTTP, no queueing). Only whole blocks can hit, so the ideal
hit is floor(L / block_size) x block_size tokens per request."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from loadtests.report.model import MEASURED, Figure, Section, Series, Table
from loadtests.report.plan import Plan

KEY = "prefix_caching"
SOURCE = f"raw/{KEY}.json"
MODES = (("on", True), ("off", False))


def ideal_hit_tokens(prefix_len: int, block_size: int) -> int:
    """Tokens a request can take from the cache when it shares its first ``prefix_len`` tokens
    with a cached one: the shared prefix's whole blocks."""
    return prefix_len // block_size * block_size


def time_to_first_token(engine: Any, request_id: str, prompt: list[int], params: Any) -> float:
    """Seconds from adding the request until a step returns its first token; the engine must be
    otherwise idle (so the time is the request's own prefill)."""
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == request_id and any(d.token_ids for d in out.deltas):
                ttft = time.perf_counter() - t0
                if not out.finished:
                    engine.abort(request_id)
                return ttft


def measure(plan: Plan, log: Callable[[str], None]) -> dict[str, Any]:
    from loadtests import bench_engine, engine_setup
    from loadtests.workloads import random_prompts
    from shared.wire.sampling_params import SamplingParams

    args = bench_engine.parse_args(["--threads", str(plan.threads), "--skip-hf"])
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    longest = max(plan.prefix_lens) + plan.prefix_suffix_len
    runs: dict[str, Any] = {}
    for mode, enabled in MODES:
        llm = engine_setup.make_llm(
            args,
            max_num_seqs=4,
            max_num_batched_tokens=max(512, longest),
            enable_prefix_caching=enabled,
        )
        engine, tok = llm.engine, llm.tokenizer
        bs = engine.block_manager.block_size
        rows = []
        for length in plan.prefix_lens:
            rng = random.Random(1000 + length)  # the same prompts for caching on and off
            prefix = random_prompts(tok.vocab_size, tok.all_special_ids, [length], rng)[0]
            suffixes = random_prompts(
                tok.vocab_size,
                tok.all_special_ids,
                [plan.prefix_suffix_len] * (plan.prefix_requests + 1),
                rng,
            )
            first = time_to_first_token(
                engine, f"{mode}-{length}-first", prefix + suffixes[0], params
            )
            ttfts, hits = [], []
            for i, suffix in enumerate(suffixes[1:]):
                before = engine.block_manager.prefix_cache_hits_tokens
                ttfts.append(
                    time_to_first_token(engine, f"{mode}-{length}-{i}", prefix + suffix, params)
                )
                hits.append(engine.block_manager.prefix_cache_hits_tokens - before)
            engine_setup.reset_prefix_cache(llm)
            prompt_len = length + plan.prefix_suffix_len
            row: dict[str, Any] = dict(
                prefix_len=length,
                prompt_len=prompt_len,
                first_request_ttft_s=first,
                ttft_s=ttfts,
                median_ttft_s=statistics.median(ttfts),
                hit_tokens=hits,
                hit_rate=sum(hits) / (prompt_len * len(hits)),
                ideal_hit_rate=ideal_hit_tokens(length, bs) / prompt_len,
            )
            rows.append(row)
            log(
                f"prefix caching {mode}, shared prefix {length}: median TTFT "
                f"{1000 * row['median_ttft_s']:.0f} ms, hit rate {row['hit_rate']:.2f}"
            )
        runs[mode] = dict(block_size=bs, rows=rows)
        del llm, engine
    return dict(
        suffix_len=plan.prefix_suffix_len,
        requests_per_length=plan.prefix_requests,
        prefix_lens=list(plan.prefix_lens),
        runs=runs,
    )


def build(raw: dict[str, Any]) -> Section:
    on, off = raw["runs"]["on"]["rows"], raw["runs"]["off"]["rows"]
    lens = raw["prefix_lens"]
    table = Table(
        title="Median TTFT and hit rate vs shared-prefix length",
        columns=[
            "shared prefix (tokens)",
            "prompt (tokens)",
            "TTFT caching off (ms)",
            "TTFT caching on (ms)",
            "speedup (x)",
            "hit rate on (%)",
            "ideal hit rate (%)",
            "hit rate off (%)",
        ],
        rows=[
            [
                a["prefix_len"],
                a["prompt_len"],
                1000 * b["median_ttft_s"],
                1000 * a["median_ttft_s"],
                b["median_ttft_s"] / a["median_ttft_s"],
                100 * a["hit_rate"],
                100 * a["ideal_hit_rate"],
                100 * b["hit_rate"],
            ]
            for a, b in zip(on, off, strict=True)
        ],
        source=SOURCE,
    )
    ttft = Figure(
        title=f"Median TTFT vs shared-prefix length (each prompt = prefix + {raw['suffix_len']} "
        "own tokens)",
        x_label="shared prefix length",
        x_unit="tokens",
        y_label="median TTFT",
        y_unit="ms",
        series=[
            Series("prefix caching off", lens, [1000 * r["median_ttft_s"] for r in off]),
            Series("prefix caching on", lens, [1000 * r["median_ttft_s"] for r in on]),
        ],
        source=SOURCE,
    )
    hit = Figure(
        title="Prefix cache hit rate vs shared-prefix length",
        x_label="shared prefix length",
        x_unit="tokens",
        y_label="prompt tokens served from the cache",
        y_unit="%",
        series=[
            Series("caching on", lens, [100 * r["hit_rate"] for r in on]),
            Series("ideal (whole shared blocks)", lens, [100 * r["ideal_hit_rate"] for r in on]),
            Series("caching off", lens, [100 * r["hit_rate"] for r in off]),
        ],
        source=SOURCE,
    )
    a, b = on[-1], off[-1]
    return Section(
        key=KEY,
        title="Prefix caching: TTFT vs shared-prefix length",
        claim="A request whose prompt starts with blocks already computed skips their prefill: "
        "TTFT falls as the shared prefix grows.",
        status=MEASURED,
        measured=f"median TTFT (ms, engine in process, one request at a time, "
        f"{raw['requests_per_length']} requests per length after one that fills the cache) and "
        "hit rate (% of prompt tokens served from the cache) for shared prefixes of "
        f"{', '.join(map(str, lens))} tokens",
        baseline="the same engine configuration and prompts with prefix caching off, same run",
        reading=f"at a {a['prefix_len']}-token shared prefix TTFT is "
        f"{1000 * a['median_ttft_s']:.0f} ms with caching vs {1000 * b['median_ttft_s']:.0f} ms "
        f"without ({b['median_ttft_s'] / a['median_ttft_s']:.1f}x), hit rate "
        f"{100 * a['hit_rate']:.0f}% (ideal {100 * a['ideal_hit_rate']:.0f}%).",
        tables=[table],
        figures=[ttft, hit],
        commands=[
            "llmserve bench report (this section has no standalone script; the stack-level "
            "equivalent is python -m loadtests.bench_prefix_routing)"
        ],
    )
