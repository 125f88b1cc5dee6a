"""An executor's memory over many short requests, with prefix caching on: RSS must stay flat.

    python -m loadtests.bench_rss [--num-requests 20000 --concurrency 64 --num-kv-blocks 512]

Runs the executor's engine path in process: the real Engine (the default SmolLM2) owned by the
executor's EngineWorker thread, fed ExecuteRequests as the scheduler sends them (the tokenizer's
block hashes included), with every event the worker emits encoded as the service would publish it
(StreamOutput deltas, KVEventBatch per step) and dropped; NATS itself is left out. ``concurrency``
requests are kept in flight; the next one is submitted when one finishes.

Requests: a 16-token prefix (one full block: the prefix cache can hit it) plus 1-12 unique tokens,
1-2 greedy output tokens, every 8th with logprobs. Half the prefixes come from ``--hot-prefixes``
(they stay cached), half from ``--cold-prefixes`` (more than the small KV pool, ``--num-kv-blocks``,
can keep), so cached blocks are evicted and reused all along and KV events (stores and removals)
flow every step.

RSS is read from /proc/self/status at checkpoints, together with the per-request structures that
must stay bounded (the engine's requests, the block manager's sequences, cached blocks and pending
events, the worker's live set; read while the engine thread steps, so pending events may show the
current step's). The first checkpoint after warm-up is the baseline: the KV pool's
pages are touched lazily, so RSS rises until every block has been used once. Writes
loadtests/results/bench_rss.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import queue
import random
import sys
import time
from typing import Any

from services.cli.launcher import set_executor_openmp_policy  # imports no torch

set_executor_openmp_policy(os.environ)  # as the stack's executor; must precede torch's import

from loadtests.results import write_json  # noqa: E402
from services.executor.worker import (  # noqa: E402
    Add,
    EngineWorker,
    Event,
    Failed,
    KVEvents,
    Outputs,
    Rejected,
)
from shared.wire import messages  # noqa: E402
from shared.wire.block_hash import hash_prompt_blocks  # noqa: E402
from shared.wire.kv_events import KV_EVENTS_MESSAGE, KVEventsMessage  # noqa: E402
from shared.wire.messages import ExecuteRequest, SamplingParams, StreamOutput  # noqa: E402

PREFIX_LEN = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-requests", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--hot-prefixes", type=int, default=16)
    p.add_argument("--cold-prefixes", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2000, help="requests before the RSS baseline")
    p.add_argument("--checkpoints", type=int, default=8, help="RSS readings after the warm-up")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="loadtests/results/bench_rss.json")
    return p.parse_args(argv)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def make_requests(
    n: int, vocab: int, num_hot: int, num_cold: int, rng: random.Random, block_size: int
) -> list[ExecuteRequest]:
    def prefixes(k: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab) for _ in range(PREFIX_LEN)] for _ in range(k)]

    hot, cold = prefixes(num_hot), prefixes(num_cold)
    requests = []
    for i in range(n):
        prefix = rng.choice(hot if rng.random() < 0.5 else cold)
        prompt = prefix + [rng.randrange(100, vocab) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(1, 2),
            ignore_eos=True,
            logprobs=2 if i % 8 == 0 else None,
        )
        requests.append(
            ExecuteRequest(
                request_id=f"rss-{i}",
                model="bench",
                prompt_token_ids=prompt,
                block_hashes=hash_prompt_blocks(prompt, block_size),
                params=params,
            )
        )
    return requests


def structures(engine: Any, worker: EngineWorker) -> dict[str, int]:
    bm = engine.block_manager
    return {
        "engine_requests": len(engine.requests),
        "running": engine.scheduler.num_running,
        "waiting": engine.scheduler.num_waiting,
        "block_manager_seqs": len(bm._seqs),
        "cached_blocks": bm.num_cached_blocks,
        "pending_kv_events": bm.num_pending_events,
        "worker_live": len(worker._live),
        "gc_objects": len(gc.get_objects()),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine

    rss_start = rss_mib()
    engine = Engine(
        EngineConfig(
            dtype=args.dtype,
            num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.concurrency,
            num_threads=args.num_threads,
            enable_prefix_caching=True,
        ),
        progress=False,
    )
    rss_loaded = rss_mib()
    requests = make_requests(
        args.num_requests,
        engine.model_config.vocab_size,
        args.hot_prefixes,
        args.cold_prefixes,
        random.Random(args.seed),
        engine.config.block_size,
    )
    worker = EngineWorker(engine, num_threads=args.num_threads, kv_events=True)
    events: queue.SimpleQueue[list[Event]] = queue.SimpleQueue()
    worker.start(events.put)

    step = max(1, (args.num_requests - args.warmup) // args.checkpoints)
    marks = {min(args.warmup + k * step, args.num_requests) for k in range(args.checkpoints + 1)}
    marks.add(args.num_requests)
    checkpoints: list[dict[str, Any]] = []
    counts = {"outputs": 0, "kv_batches": 0, "kv_events": 0, "stream_bytes": 0, "kv_bytes": 0}
    next_request = 0
    num_done = 0
    t0 = time.perf_counter()

    def checkpoint() -> None:
        gc.collect()
        point = {
            "requests_done": num_done,
            "elapsed_s": round(time.perf_counter() - t0, 1),
            "rss_mib": round(rss_mib(), 1),
            **structures(engine, worker),
        }
        checkpoints.append(point)
        print("  ".join(f"{k}={v}" for k, v in point.items()), flush=True)

    while next_request < min(args.concurrency, len(requests)):
        worker.submit(Add(requests[next_request]))
        next_request += 1
    while num_done < len(requests):
        for event in events.get(timeout=600):
            if isinstance(event, (Rejected, Failed)):
                raise RuntimeError(f"the engine refused or failed a request: {event}")
            if isinstance(event, KVEvents):
                counts["kv_batches"] += 1
                counts["kv_events"] += len(event.batch.events)
                counts["kv_bytes"] += len(
                    KV_EVENTS_MESSAGE.encode(
                        KVEventsMessage(executor_id="e", epoch="1", model="m", batch=event.batch)
                    )
                )
            elif isinstance(event, Outputs):
                for out in event.outputs:
                    counts["outputs"] += 1
                    counts["stream_bytes"] += len(
                        messages.STREAM_MESSAGE.encode(
                            StreamOutput(executor_id="bench", output=out)
                        )
                    )
                    if not out.finished:
                        continue
                    num_done += 1
                    if next_request < len(requests):
                        worker.submit(Add(requests[next_request]))
                        next_request += 1
                    if num_done in marks:
                        checkpoint()
    elapsed = time.perf_counter() - t0
    worker.stop(10)

    baseline, last = checkpoints[0], checkpoints[-1]
    growth_mib = round(last["rss_mib"] - baseline["rss_mib"], 1)
    stats = engine.stats()
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "rss_mib": {
            "start": round(rss_start, 1),
            "model_loaded": round(rss_loaded, 1),
            "after_warmup": baseline["rss_mib"],
            "end": last["rss_mib"],
            "growth_after_warmup": growth_mib,
        },
        "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(len(requests) / elapsed, 1),
        "prefix_cache_hit_rate": round(
            stats.prefix_cache_hits_tokens / max(1, stats.prefix_cache_queries_tokens), 3
        ),
        "num_steps": stats.num_steps,
        "num_preemptions": stats.num_preemptions,
        **counts,
        "checkpoints": checkpoints,
    }
    print(
        f"bench_rss: {len(requests)} requests in {elapsed:.0f} s; RSS start {rss_start:.0f} MiB, "
        f"model loaded {rss_loaded:.0f} MiB, after {baseline['requests_done']} requests "
        f"{baseline['rss_mib']:.0f} MiB, at the end {last['rss_mib']:.0f} MiB "
        f"({growth_mib:+.1f} MiB); "
        f"prefix cache hit rate {result['prefix_cache_hit_rate']:.0%}; {counts['kv_events']} KV "
        f"events in {counts['kv_batches']} batches"
    )
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
