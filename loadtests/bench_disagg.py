"""Prefill/decode disaggregation against aggregated executors, on the whole stack, in one run.

    python -m loadtests.bench_disagg [--streams 16 --long-len 2000 --num-long 4 --interval 4]

Two stacks in turn, each with two executors pinned to one core apiece (``--cpus``, default
"0;1"), same model and engine settings:

    disagg      one prefill + one decode executor (llmserve up --prefill 1 --decode 1)
    aggregated  two 'both' executors (llmserve up --executors 2)

Workload: ``--streams`` requests with short prompts start together and decode greedily with
``ignore_eos`` for as long as the measurement lasts; once they all stream, ``--num-long`` prompts of
``--long-len`` random tokens (distinct: no prefix hits) arrive ``--interval`` seconds apart, each
asking for ``--long-output`` tokens. The window runs from the first long arrival to the last long
prompt's end; the streams are then closed. Reported per stack:

- ITL p50 / p99 of the streams, gaps inside the window only (what a long prefill does to them);
- TTFT p50 / p99 of the long prompts;
- output throughput: tokens the streams and the long prompts received in the window / its length;
- the executors' ``llmserve:kv_transfer_*`` counters and ``engine_step_seconds`` (from the
  gateway's /metrics, differenced over the window): bytes and seconds per transferred token, and
  each executor's mean step time.

After the split, its decode floor (``loadtests/decode_floor.py``): its streams alone in one engine
on the decode executor's cores; the floor's step p99 over the aggregated ITL p99 is the lowest ITL
p99 ratio the split can reach there.

Writes loadtests/results/bench_disagg.json. ``measure(args)`` is the whole measurement (both stacks
and ``summarize``'s per-token transfer cost and ratios) as that JSON, for ``loadtests/report/``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadtests.bench_serving import (
    RequestResult,
    client_session,
    percentile,
    send_one,
    sse_chunks,
)
from loadtests.decode_floor import decode_floor
from loadtests.results import write_json
from services.cli.launcher import StackConfig, launch
from services.executor.config import parse_cpu_list

MODEL_NAME = "SmolLM2-135M-Instruct"
TOKEN_RANGE = (1000, 40000)  # ordinary vocabulary of the default model, no special tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=16, help="concurrent long-decoding requests")
    p.add_argument("--stream-prompt-len", type=int, default=32)
    p.add_argument(
        "--stream-output",
        type=int,
        default=4096,
        help="max_tokens of each stream: more than the window lasts (the client closes them)",
    )
    p.add_argument("--long-len", type=int, default=2000, help="tokens of each long prompt")
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--num-long", type=int, default=4)
    p.add_argument("--interval", type=float, default=4.0, help="seconds between long prompts")
    p.add_argument("--cpus", default="0;1", help="each executor's cores, ';' between executors")
    p.add_argument("--dtype", default=None, help="default: the served default (bfloat16)")
    p.add_argument("--kv-transfer-timeout", type=float, default=30.0)
    p.add_argument("--modes", default="disagg,aggregated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="loadtests/results/bench_disagg.json")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------- client


@dataclass
class Stream:
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each text chunk
    error: str = ""


async def stream_until(
    client: aiohttp.ClientSession, body: dict[str, Any], stream: Stream, stop: asyncio.Event
) -> None:
    """Stream ``body`` recording each text chunk's arrival, until the server ends it or ``stop``."""

    async def read() -> None:
        async with client.post("/v1/completions", json=body) as r:
            if r.status != 200:
                stream.error = f"{r.status}: {(await r.read())[:200]!r}"
                return
            async for chunk in sse_chunks(r):
                if "error" in chunk:
                    stream.error = json.dumps(chunk["error"])[:300]
                    return
                if any(c.get("text") for c in chunk.get("choices", [])):
                    stream.chunk_times.append(time.perf_counter())

    reader = asyncio.create_task(read())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
    for t in (reader, stopper):
        t.cancel()
    if reader.done() and not reader.cancelled() and reader.exception() is not None:
        stream.error = repr(reader.exception())[:300]


def body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def stream_prompts(args: argparse.Namespace, rng: random.Random) -> list[list[int]]:
    """The streams' prompts: the first draws of ``rng`` (seeded with ``args.seed``), so the decode
    floor steps the same prompts the stacks' streams sent."""
    return [random_ids(rng, args.stream_prompt_len) for _ in range(args.streams)]


async def run_workload(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    async with client_session(base_url, args.streams + args.num_long + 4, 600) as client:
        stop = asyncio.Event()
        streams = [Stream() for _ in range(args.streams)]
        tasks = [
            asyncio.create_task(stream_until(client, body(prompt, args.stream_output), s, stop))
            for prompt, s in zip(stream_prompts(args, rng), streams, strict=True)
        ]
        while not all(len(s.chunk_times) >= 2 or s.error for s in streams):
            await asyncio.sleep(0.1)
        if errors := [s.error for s in streams if s.error]:
            stop.set()
            raise RuntimeError(f"streams failed: {errors[:3]}")
        metrics_before = await scrape(client)
        t0 = time.perf_counter()
        long_prompts = [random_ids(rng, args.long_len) for _ in range(args.num_long)]
        longs: list[asyncio.Task[RequestResult]] = []
        for i, prompt in enumerate(long_prompts):
            if i:
                await asyncio.sleep(args.interval)
            longs.append(
                asyncio.create_task(
                    send_one(client, "/v1/completions", body(prompt, args.long_output), False)
                )
            )
        long_results = await asyncio.gather(*longs)
        t1 = time.perf_counter()
        await asyncio.sleep(2.5)  # every executor reports its metrics each second
        metrics_after = await scrape(client)
        stop.set()
        await asyncio.gather(*tasks)
    itls: list[float] = []
    stream_tokens = 0
    num_ended = sum(bool(s.chunk_times) and s.chunk_times[-1] < t1 for s in streams)
    if num_ended:
        print("warning: a stream ended inside the window: raise --stream-output", file=sys.stderr)
    # Each stream's context (prompt + tokens received) when the window opened and when it closed.
    prompt_len = args.stream_prompt_len
    contexts_at_start = [prompt_len + sum(t < t0 for t in s.chunk_times) for s in streams]
    contexts_at_end = [prompt_len + sum(t <= t1 for t in s.chunk_times) for s in streams]
    for s in streams:
        inside = [t for t in s.chunk_times if t0 <= t <= t1]
        stream_tokens += len(inside)
        times = [t for t in s.chunk_times if t <= t1]
        itls += [b - a for a, b in itertools.pairwise(times) if b >= t0]
    window = t1 - t0
    ok_long = [r for r in long_results if r.ok]
    long_tokens = sum(r.output_tokens for r in ok_long)
    return {
        "window_s": window,
        "stream_errors": [s.error for s in streams if s.error],
        "num_streams_ended_in_window": num_ended,
        "long_errors": [r.error for r in long_results if not r.ok],
        "itl_ms": {
            "p50": percentile(itls, 50) * 1000,
            "p99": percentile(itls, 99) * 1000,
            "max": max(itls, default=float("nan")) * 1000,
            "count": len(itls),
        },
        "long_ttft_ms": {
            "p50": percentile([r.ttft_s for r in ok_long], 50) * 1000,
            "p99": percentile([r.ttft_s for r in ok_long], 99) * 1000,
        },
        "stream_contexts": [min(contexts_at_start), max(contexts_at_end)],
        "output_tok_s": (stream_tokens + long_tokens) / window,
        "stream_tok_s": stream_tokens / window,
        "executors": executor_deltas(metrics_before, metrics_after),
    }


# ------------------------------------------------------------------------------------ metrics


async def scrape(client: aiohttp.ClientSession) -> dict[tuple[str, str], float]:
    """(sample name, executor) -> value of the executors' counters we difference."""
    async with client.get("/metrics") as r:
        text = await r.text()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            executor = s.labels.get("executor")
            if executor is None:
                continue
            name = s.name
            if name.startswith("llmserve:kv_transfers") and "outcome" in s.labels:
                name = f"{name}:{s.labels['outcome']}"
            elif not name.startswith(
                ("llmserve:kv_transfer_", "llmserve:engine_step_seconds_")
            ) or name.endswith("_bucket"):
                continue
            out[(name, executor)] = out.get((name, executor), 0.0) + s.value
    return out


def executor_deltas(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[str, dict[str, float]]:
    per: dict[str, dict[str, float]] = {}
    for (name, executor), value in after.items():
        per.setdefault(executor, {})[name] = value - before.get((name, executor), 0.0)
    summary: dict[str, dict[str, float]] = {}
    for executor, d in sorted(per.items()):
        e: dict[str, float] = {k: v for k, v in d.items() if "kv_transfers" in k and v}
        steps = d.get("llmserve:engine_step_seconds_count", 0.0)
        if steps:
            e["steps"] = steps
            e["step_ms_mean"] = d["llmserve:engine_step_seconds_sum"] / steps * 1000
        nbytes = d.get("llmserve:kv_transfer_bytes_total", 0.0)
        n = d.get("llmserve:kv_transfer_seconds_count", 0.0)
        if nbytes and n:
            e["transfer_bytes"] = nbytes
            e["transfer_s_mean"] = d["llmserve:kv_transfer_seconds_sum"] / n
        summary[executor] = e
    return summary


# ----------------------------------------------------------------------------------------- run


def log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_mode(
    mode: str, args: argparse.Namespace, log: Callable[[str], None] = log_stderr
) -> dict[str, Any]:
    cpus = tuple(parse_cpu_list(c) for c in args.cpus.split(";"))
    roles = (
        {"num_executors": 0, "num_prefill": 1, "num_decode": 1}
        if mode == "disagg"
        else {"num_executors": len(cpus)}
    )
    engine = {"dtype": args.dtype} if args.dtype else {}
    config = StackConfig.of(
        port=0,
        model_name=MODEL_NAME,
        executor_cpus=cpus,
        num_prefix_indexes=0,
        memory_budget="1GiB",
        kv_transfer_timeout_s=args.kv_transfer_timeout,
        **roles,
        **engine,
    )
    log(f"[{mode}] starting {config.executors_per_model} executors on {cpus}...")
    with launch(config) as stack:  # ready: the scheduler has heard both executors
        log(f"[{mode}] workload: {args.streams} streams, {args.num_long} x {args.long_len} tokens")
        result = asyncio.run(run_workload(stack.base_url, args))
    result["mode"] = mode
    return result


def transfer_per_token(result: dict[str, Any], long_len: int) -> tuple[float, float]:
    """(bytes, ms) per prompt token moved, over the sending executors' transfers."""
    sent = [e for e in result["executors"].values() if "transfer_bytes" in e]
    if not sent:
        return float("nan"), float("nan")
    n = sum(e.get("llmserve:kv_transfers_total:sent", 0.0) for e in sent)
    nbytes = sum(e["transfer_bytes"] for e in sent)
    seconds = statistics.fmean(e["transfer_s_mean"] for e in sent)
    return nbytes / (n * long_len), seconds * 1000 / long_len


# The target: disaggregated ITL p99 at most half aggregated, at equal or better throughput.
TARGET_ITL_P99_RATIO = 0.5
TARGET_THROUGHPUT_RATIO = 1.0


def summarize(
    results: dict[str, dict[str, Any]], long_len: int, floor: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Per mode, the transfer cost per prompt token; with both modes, disagg / aggregated ratios,
    and with the split's decode floor, the lowest ITL p99 ratio that floor leaves the split."""
    summary: dict[str, Any] = {"per_mode": {}}
    for mode, r in results.items():
        nbytes, ms = transfer_per_token(r, long_len)
        summary["per_mode"][mode] = {"kv_bytes_per_token": nbytes, "kv_transfer_ms_per_token": ms}
    if {"disagg", "aggregated"} <= results.keys():
        d, a = results["disagg"], results["aggregated"]
        itl = d["itl_ms"]["p99"] / a["itl_ms"]["p99"]
        tput = d["output_tok_s"] / a["output_tok_s"]
        summary["disagg_vs_aggregated"] = {
            "itl_p99_ratio": itl,
            "ttft_p50_ratio": d["long_ttft_ms"]["p50"] / a["long_ttft_ms"]["p50"],
            "ttft_p99_ratio": d["long_ttft_ms"]["p99"] / a["long_ttft_ms"]["p99"],
            "throughput_ratio": tput,
            "target_met": itl <= TARGET_ITL_P99_RATIO and tput >= TARGET_THROUGHPUT_RATIO,
        }
        if floor is not None:
            step, ratios = floor["step_ms"], summary["disagg_vs_aggregated"]
            ratios["floor_itl_p99_ratio"] = step["p99"] / a["itl_ms"]["p99"]
            ratios["floor_fastest_step_ratio"] = step["min"] / a["itl_ms"]["p99"]
    return summary


def measure(args: argparse.Namespace, log: Callable[[str], None] = log_stderr) -> dict[str, Any]:
    """Each of ``args.modes`` in turn, then (after the split) its decode floor, then ``summarize``:
    what ``main`` writes as JSON."""
    results = {m: run_mode(m, args, log) for m in args.modes.split(",")}
    floor = None
    if "disagg" in results:
        cpus = parse_cpu_list(args.cpus.split(";")[-1])  # the decode executor's (launched last)
        log(f"[floor] {args.streams} streams decoding in one engine on cpus {cpus}...")
        prompts = stream_prompts(args, random.Random(args.seed))
        first, last = results["disagg"]["stream_contexts"]
        floor = decode_floor(prompts, cpus, (first, last), dtype=args.dtype, seed=args.seed)
    return {
        "args": vars(args),
        "results": results,
        "decode_floor": floor,
        "summary": summarize(results, args.long_len, floor),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = measure(args)
    results, summary = data["results"], data["summary"]
    print(
        f"\n{'mode':<11} {'ITL p50':>8} {'ITL p99':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'out tok/s':>9} {'KV B/tok':>9} {'KV ms/tok':>9}"
    )
    for m, r in results.items():
        per = summary["per_mode"][m]
        print(
            f"{m:<11} {r['itl_ms']['p50']:>8.0f} {r['itl_ms']['p99']:>8.0f} "
            f"{r['long_ttft_ms']['p50']:>9.0f} {r['long_ttft_ms']['p99']:>9.0f} "
            f"{r['output_tok_s']:>9.1f} {per['kv_bytes_per_token']:>9.0f} "
            f"{per['kv_transfer_ms_per_token']:>9.3f}"
        )
        for executor, e in r["executors"].items():
            print(f"    {executor}: {json.dumps(e)}")
        if r["stream_errors"] or r["long_errors"]:
            print(f"    errors: {r['stream_errors'][:3]} {r['long_errors'][:3]}")
    if ratios := summary.get("disagg_vs_aggregated"):
        print(
            f"\nITL p99 disagg/aggregated = {ratios['itl_p99_ratio']:.2f} (target <= "
            f"{TARGET_ITL_P99_RATIO}), throughput ratio = {ratios['throughput_ratio']:.2f} (target "
            f">= {TARGET_THROUGHPUT_RATIO:g}): {'met' if ratios['target_met'] else 'not met'}"
        )
    if (floor := data["decode_floor"]) is not None:
        step = floor["step_ms"]
        print(
            f"\nthe split's decode floor (engine alone, {args.streams} streams on cpus "
            f"{floor['cpus']}, contexts {floor['contexts'][0]}-{floor['contexts'][1]}): step p50 "
            f"{step['p50']:.0f} ms, p99 {step['p99']:.0f} ms, fastest {step['min']:.0f} ms"
        )
        if ratios:
            print(
                f"  against the aggregated ITL p99: {ratios['floor_itl_p99_ratio']:.2f} (p99), "
                f"{ratios['floor_fastest_step_ratio']:.2f} (fastest step): the lowest ITL p99 "
                "ratio the split can reach on these cores"
            )
    path = write_json(args.out, data)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
