"""Long prompts on the engine (real SmolLM2-135M, in process): how prefill time grows with the
prompt, and what a long prefill does to a short request's time to first token.

    python -m loadtests.bench_long_prefill [--baseline /path/to/a/checkout/of/main] \\
        [--lengths 1024,2048,4096,8192] [--dtypes float32,bfloat16] [--repeats 2] \\
        [--ttft-long-len 4000] [--ttft-repeats 4] [--thresholds 512,128,64,32] \\
        [--out loadtests/results/bench_long_prefill.json]

Part (a), prefill: one prompt of each length alone, chunked by ``max_num_batched_tokens`` (512),
``max_tokens=1``: seconds to the first token, the share in attention (timed around the attention
backend) and attention's GFLOP/s over the causal half it has to compute.

Part (b), head-of-line blocking: the engine steps in its own thread, fed between steps through a
queue, as the executor runs it. A 5-token request's TTFT is measured alone ("idle"), then sent at
a random moment while a ``--ttft-long-len``-token prompt prefills ("busy"); the long prompt's own
TTFT is reported too (what fairness costs it), and its greedy tokens are checked against its solo
run.

Each configuration runs in its own process. ``--baseline`` names a source tree (a checkout of the
code before the change); its runs alternate with this tree's, so before and after see the same
host noise. Without it, this tree's ``--thresholds`` sweep is the comparison: a threshold of 512
(= the step budget) is the old behaviour, one long prompt taking every step. This 2-core host is
shared: the load average before and after each part is saved with the numbers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_OUT = os.path.join(HERE, "results", "bench_long_prefill.json")
TOKEN_RANGE = (1000, 40000)  # ordinary vocabulary of SmolLM2: no special tokens
SHORT_LEN = 5
NUM_THREADS = 2


# ---- workers: run in a child process against one source tree -------------------------------------


def _engine(dtype: str, overrides: dict[str, Any]):
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine

    settings: dict[str, Any] = dict(num_threads=NUM_THREADS, memory_budget="3GiB", seed=0)
    settings |= overrides
    config = EngineConfig(dtype=dtype, **settings)
    return Engine(config, progress=False)


def torch_threads(n: int) -> None:
    """Intra-op threads of the calling thread (OpenMP's count is per thread, as the executor's
    engine thread sets it too)."""
    import torch

    torch.set_num_threads(n)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def _greedy(max_tokens: int):
    from shared.wire.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class AttentionTimer:
    """Seconds spent in attention (the backend's ``attend``, kernels or torch), patched in before
    the engine is built."""

    def __init__(self) -> None:
        from shared.engine.attention.backend import TorchAttentionBackend

        self.seconds = 0.0
        attend = TorchAttentionBackend.attend

        def timed(backend, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return attend(backend, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        TorchAttentionBackend.attend = timed  # type: ignore[method-assign,assignment]


def attention_flops(cfg, num_queries: int, context: int) -> float:
    """Causal attention of ``num_queries`` new tokens after ``context`` cached ones: query i sees
    context + i + 1 keys; q.k and p.v are 2 * head_dim FLOPs each, per head and layer."""
    pairs = num_queries * context + num_queries * (num_queries + 1) / 2
    return pairs * cfg.num_heads * cfg.head_dim * 4 * cfg.num_layers


def work_steps(
    dtype: str, overrides: dict[str, Any], chunk_sizes: list[int], contexts: list[int], repeats: int
) -> list[dict]:
    """One prefill chunk of each size after each context, through the model runner alone (the
    cache's contents do not matter to the time): the minimum and median over ``repeats``, the
    combinations taken in turn so that the host's noise spreads over all of them."""
    from shared.engine.model_runner import ScheduledChunk

    timer = AttentionTimer()
    engine = _engine(dtype, overrides)
    bs = engine.config.block_size
    table = list(range(1, (max(contexts) + max(chunk_sizes)) // bs + 2))
    rng = random.Random(2)
    combos = [(n, c) for n in chunk_sizes for c in contexts]
    times: dict[tuple[int, int], list[tuple[float, float, float]]] = {k: [] for k in combos}
    for _ in range(repeats + 1):  # the first round warms up
        for n, c in combos:
            chunk = ScheduledChunk(
                token_ids=_prompt(rng, n),
                num_computed=c,
                block_table=table[: -(-(c + n) // bs)],
                need_logits=False,
            )
            timer.seconds, t0, cpu0 = 0.0, time.perf_counter(), time.process_time()
            engine.runner.execute([chunk])
            times[(n, c)].append(
                (time.perf_counter() - t0, timer.seconds, time.process_time() - cpu0)
            )
    cfg = engine.model_config
    rows = []
    for (n, c), runs in times.items():
        runs = runs[1:]
        best = min(runs)
        rows.append(
            dict(
                chunk_tokens=n,
                context_tokens=c,
                min_s=best[0],
                median_s=med([w for w, _, _ in runs]),
                cpu_min_s=min(cpu for _, _, cpu in runs),
                attention_s=best[1],
                attention_gflops_per_s=attention_flops(cfg, n, c) / max(best[1], 1e-9) / 1e9,
            )
        )
    return rows


def work_prefill(dtype: str, overrides: dict[str, Any], lengths: list[int]) -> list[dict]:
    timer = AttentionTimer()
    engine = _engine(dtype, overrides)
    rng = random.Random(1)
    engine.add_request("warm-up", _prompt(rng, 600), _greedy(1))
    while engine.has_unfinished():
        engine.step()
    rows = []
    for n in lengths:
        engine.add_request(f"p{n}", _prompt(rng, n), _greedy(1))  # fresh tokens: no cache hit
        timer.seconds, steps, t0, cpu0 = 0.0, 0, time.perf_counter(), time.process_time()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        rows.append(
            dict(
                num_tokens=n,
                seconds=time.perf_counter() - t0,
                cpu_seconds=time.process_time() - cpu0,
                attention_seconds=timer.seconds,
                steps=steps,
            )
        )
    return rows


class EngineLoop:
    """The engine stepped in a thread of its own, fed between steps through a queue (as the
    executor's engine thread is): a request submitted mid-step waits for that step to end."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()
        self.token_times: dict[str, list[float]] = {}  # when each delta with tokens came out
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, threading.Event] = {}
        self.error: BaseException | None = None
        # Per step: wall clock and process CPU time at its start and end. CPU time is what the
        # engine spent, whatever else the host ran meanwhile: on a shared host, the steady measure.
        self.steps: list[tuple[float, float, float, float]] = []
        self.thread = threading.Thread(target=self._run_or_fail, daemon=True)
        self.thread.start()

    def submit(self, request_id: str, ids: list[int], max_tokens: int) -> float:
        self.finished[request_id] = threading.Event()
        self.tokens[request_id], self.token_times[request_id] = [], []
        sent = time.perf_counter()
        self.inbox.put(lambda: self.engine.add_request(request_id, ids, _greedy(max_tokens)))
        return sent

    def abort(self, request_id: str) -> None:
        def task() -> None:
            self.engine.abort(request_id)
            self.finished[request_id].set()

        self.inbox.put(task)

    def first_token_at(self, request_id: str) -> float:
        return self.token_times[request_id][0]

    def cpu_ttft(self, request_id: str, sent: float) -> float:
        """Engine CPU seconds from ``sent`` to the request's first token: the step in flight at
        ``sent`` counts from that moment on (its CPU time prorated by wall time)."""
        first = self.first_token_at(request_id)
        end = next(c1 for _, w1, _, c1 in self.steps if w1 >= first)
        for w0, w1, c0, c1 in self.steps:
            if w1 >= sent:
                start = c0 + max(0.0, sent - w0) / max(w1 - w0, 1e-9) * (c1 - c0)
                return end - start
        raise ValueError(f"no step after {request_id} was sent")

    def wait(self, request_id: str) -> None:
        self.finished[request_id].wait()
        if self.error is not None:
            raise RuntimeError("the engine thread failed") from self.error

    def close(self) -> None:
        self.inbox.put(None)
        self.thread.join()

    def _run_or_fail(self) -> None:
        try:
            self._run()
        except BaseException as e:  # every waiter wakes up and raises it
            self.error = e
            for event in self.finished.values():
                event.set()

    def _run(self) -> None:
        torch_threads(self.engine.config.num_threads)
        while True:
            block = not self.engine.has_unfinished()
            while True:
                try:
                    task = self.inbox.get(block=block)
                except queue.Empty:
                    break
                if task is None:
                    return
                task()
                block = not self.engine.has_unfinished()
            w0, c0 = time.perf_counter(), time.process_time()
            outputs = self.engine.step()
            now = time.perf_counter()
            self.steps.append((w0, now, c0, time.process_time()))
            for out in outputs:
                for delta in out.deltas:
                    if delta.token_ids:
                        self.token_times[out.request_id].append(now)
                        self.tokens[out.request_id] += delta.token_ids
                if out.finished:
                    self.finished[out.request_id].set()


def work_ttft(
    dtype: str, overrides: dict[str, Any], long_len: int, repeats: int, seed: int
) -> dict[str, Any]:
    """Idle TTFT of a short request; then, ``repeats`` times, the long prompt with a short request
    sent at a random moment of its prefill, while one stream decodes throughout (its largest gap
    between tokens is what the long prefill does to running decodes)."""
    # No prefix cache: the long prompt runs several times and must be prefilled each time.
    loop = EngineLoop(_engine(dtype, dict(overrides, enable_prefix_caching=False)))
    rng = random.Random(seed)

    def run(request_id: str, ids: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
        """(wall TTFT, engine CPU TTFT, tokens)."""
        sent = loop.submit(request_id, ids, max_tokens)
        loop.wait(request_id)
        wall = loop.first_token_at(request_id) - sent
        return wall, loop.cpu_ttft(request_id, sent), loop.tokens[request_id]

    run("warm-up", _prompt(rng, 600), 2)
    idle = [run(f"idle{i}", _prompt(rng, SHORT_LEN), 1)[:2] for i in range(2 * repeats + 1)]
    long_ids = _prompt(rng, long_len)
    solo_s, solo_cpu_s, solo_tokens = run("solo", long_ids, 4)
    busy, long_ttfts, stream_gaps, same = [], [], [], True
    for i in range(repeats):
        loop.submit(f"stream{i}", _prompt(rng, 20), 6000)  # decodes past the long prefill
        while not loop.token_times[f"stream{i}"] and loop.error is None:
            time.sleep(0.005)
        sent = loop.submit(f"long{i}", long_ids, 4)
        time.sleep(rng.uniform(0.15, 0.6) * solo_s)  # somewhere in its prefill
        busy.append(run(f"short{i}", _prompt(rng, SHORT_LEN), 1)[:2])
        loop.wait(f"long{i}")
        long_done = loop.first_token_at(f"long{i}")
        long_ttfts.append((long_done - sent, loop.cpu_ttft(f"long{i}", sent)))
        times = [t for t in loop.token_times[f"stream{i}"] if t <= long_done]
        stream_gaps.append(max(b - a for a, b in itertools.pairwise(times)))
        loop.abort(f"stream{i}")
        loop.wait(f"stream{i}")
        same = same and loop.tokens[f"long{i}"] == solo_tokens
    loop.close()
    return dict(
        idle_ttft_s=[w for w, _ in idle],
        idle_ttft_cpu_s=[c for _, c in idle],
        busy_ttft_s=[w for w, _ in busy],
        busy_ttft_cpu_s=[c for _, c in busy],
        long_ttft_s=[w for w, _ in long_ttfts],
        long_ttft_cpu_s=[c for _, c in long_ttfts],
        long_solo_ttft_s=solo_s,
        long_solo_ttft_cpu_s=solo_cpu_s,
        stream_max_gap_s=stream_gaps,
        long_tokens_unchanged=same,
    )


# ---- the parent: alternates trees and configurations, prints and saves -------------------------


def spawn(tree: str, job: dict[str, Any]) -> Any:
    """Run one job with ``tree``'s code (its own process, so nothing is shared with other
    configurations but the host)."""
    env = dict(os.environ, PYTHONPATH=tree)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed in {tree}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load() -> float:
    return os.getloadavg()[0]


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def ms(xs: list[float]) -> str:
    return f"{1000 * med(xs):8.1f}"


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return my - b * mx, b


def modelled_prefill_s(rows: list[dict], chunk: int, n: int, key: str = "min_s") -> float:
    """A lone ``n``-token prompt's prefill, chunk by chunk, from the step costs: each chunk's time
    is linear in the context before it (attention reads every earlier key), fitted on the measured
    contexts of that chunk size."""
    pts = [(r["context_tokens"], r[key]) for r in rows if r["chunk_tokens"] == chunk]
    a, b = fit_line([c for c, _ in pts], [t for _, t in pts])
    return sum((a + b * c) * min(chunk, n - c) / chunk for c in range(0, n, chunk))


def bench_steps(args, trees: list[tuple[str, str]]) -> dict[str, Any]:
    """(a) one chunk's cost by context, per tree; lone prompts' prefill modelled from it."""
    rows: dict[str, dict[str, list[dict]]] = {}
    load_before = load()
    for dtype in args.dtypes:
        for name, tree in trees:
            job = dict(
                kind="steps",
                dtype=dtype,
                overrides=dict(num_threads=args.num_threads),
                chunk_sizes=args.chunks,
                contexts=args.contexts,
                repeats=args.repeats,
            )
            rows.setdefault(dtype, {})[name] = got = spawn(tree, job)
            for r in got:
                print(
                    f"  {dtype:8s} {name:6s} chunk {r['chunk_tokens']:4d} after "
                    f"{r['context_tokens']:5d}: {1000 * r['min_s']:8.1f} ms (median "
                    f"{1000 * r['median_s']:8.1f}), attention {1000 * r['attention_s']:7.1f} ms at "
                    f"{r['attention_gflops_per_s']:5.1f} GFLOP/s",
                    flush=True,
                )
    modelled: dict[str, dict[str, dict[str, float]]] = {}
    for dtype, by_tree in rows.items():
        for name, got in by_tree.items():
            for chunk in args.chunks:
                label = f"{name}, chunks of {chunk}"
                modelled.setdefault(dtype, {})[label] = {
                    str(n): modelled_prefill_s(got, chunk, n) for n in args.lengths
                }
    for dtype, by_label in modelled.items():
        print(f"  {dtype}: lone prompt prefill modelled from the fastest steps (s)")
        print("    " + " " * 30 + "".join(f"{n:>9d}" for n in args.lengths))
        for label, by_n in by_label.items():
            print(f"    {label:30s}" + "".join(f"{by_n[str(n)]:9.2f}" for n in args.lengths))
    return dict(steps=rows, modelled_prefill_s=modelled, load_before=load_before, load_after=load())


def bench_prefill(args, arms: list[tuple[str, str, dict]]) -> dict[str, Any]:
    """(a) measured: lone prompts through the engine, the arms alternating."""
    runs: dict[str, dict[str, list[dict]]] = {}
    load_before = load()
    for rep in range(args.prefill_repeats):
        for dtype in args.dtypes:
            for name, tree, overrides in arms if rep % 2 == 0 else arms[::-1]:
                job = dict(kind="prefill", dtype=dtype, overrides=overrides, lengths=args.lengths)
                got = spawn(tree, job)
                runs.setdefault(dtype, {}).setdefault(name, []).extend(got)
                for r in got:
                    print(
                        f"  {dtype:8s} {name:14s} {r['num_tokens']:5d} tokens: "
                        f"{r['seconds']:7.2f} s ({r['steps']} steps), attention "
                        f"{r['attention_seconds']:6.2f} s",
                        flush=True,
                    )
    return dict(runs=runs, load_before=load_before, load_after=load())


def bench_ttft(args, arms: list[tuple[str, str, dict]]) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {}
    load_before = load()
    for dtype in args.dtypes:
        for i, (name, tree, overrides) in enumerate(arms):
            job = dict(
                kind="ttft",
                dtype=dtype,
                overrides=overrides,
                long_len=args.ttft_long_len,
                repeats=args.ttft_repeats,
                seed=i,
            )
            r = spawn(tree, job)
            for unit in ("", "_cpu"):
                idle, busy = med(r[f"idle_ttft{unit}_s"]), r[f"busy_ttft{unit}_s"]
                r[f"ratio{unit}_median"] = med(busy) / idle
                r[f"ratio{unit}_max"] = max(busy) / idle
            results.setdefault(dtype, {})[name] = r
            print(
                f"  {dtype:8s} {name:14s} 5-token TTFT idle {ms(r['idle_ttft_s'])} ms, during "
                f"the prefill {ms(r['busy_ttft_s'])} ms = {r['ratio_median']:6.2f}x (max "
                f"{r['ratio_max']:6.2f}x); engine CPU {ms(r['idle_ttft_cpu_s'])} -> "
                f"{ms(r['busy_ttft_cpu_s'])} ms = {r['ratio_cpu_median']:6.2f}x",
                flush=True,
            )
            print(
                f"  {'':8s} {'':14s} the {args.ttft_long_len}-token prompt's TTFT "
                f"{med(r['long_ttft_s']):6.2f} s (CPU {med(r['long_ttft_cpu_s']):6.2f}; alone "
                f"{r['long_solo_ttft_s']:6.2f} s, CPU {r['long_solo_ttft_cpu_s']:6.2f}), its "
                f"tokens {'unchanged' if r['long_tokens_unchanged'] else 'CHANGED'}; a decoding "
                f"stream's longest gap {ms(r['stream_max_gap_s'])} ms",
                flush=True,
            )
    return dict(results=results, load_before=load_before, load_after=load())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--baseline", help="a source tree with the code before the change")
    p.add_argument("--lengths", default="1024,2048,4096,8000")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--chunks", default="512,64", help="(a) chunk sizes whose steps are timed")
    p.add_argument("--contexts", default="0,1024,2048,4096,7680", help="(a) contexts timed")
    p.add_argument("--repeats", type=int, default=3, help="(a) timed runs of each step")
    p.add_argument("--prefill-repeats", type=int, default=1, help="(a) measured lone prefills")
    p.add_argument("--ttft-long-len", type=int, default=4000)
    p.add_argument("--ttft-repeats", type=int, default=4)
    p.add_argument(
        "--thresholds",
        default="512,64",
        help="long_prefill_token_threshold values of this tree to compare (512: no fairness)",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=NUM_THREADS,
        help="the engine's threads (1: no thread waits on another descheduled one, so a shared "
        "host's noise shows less)",
    )
    p.add_argument("--skip", default="", help="parts to skip: steps, prefill, ttft")
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        works: dict[str, Callable[..., Any]] = dict(
            steps=work_steps, prefill=work_prefill, ttft=work_ttft
        )
        work = works[job.pop("kind")]
        print(json.dumps(work(**job)))
        return
    sys.path.insert(0, ROOT)
    from loadtests.results import write_json

    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.chunks = [int(n) for n in args.chunks.split(",")]
    args.contexts = [int(n) for n in args.contexts.split(",")]
    args.dtypes = args.dtypes.split(",")
    skip = set(args.skip.split(",")) - {""}
    os.environ["OMP_NUM_THREADS"] = str(args.num_threads)
    threads = dict(num_threads=args.num_threads)
    trees = [("before", os.path.abspath(args.baseline))] if args.baseline else []
    trees.append(("after", ROOT))
    arms = [("before", trees[0][1], threads)] if args.baseline else []
    arms += [
        (f"threshold {t}", ROOT, dict(threads, long_prefill_token_threshold=int(t)))
        for t in args.thresholds.split(",")
    ]
    out: dict[str, Any] = dict(
        trees=dict(trees),
        arms={name: dict(tree=tree, overrides=o) for name, tree, o in arms},
        num_threads=args.num_threads,
        cpu_count=os.cpu_count(),
        argv=sys.argv[1:],
    )
    if "steps" not in skip:
        print("(a) one prefill chunk by context (fastest of the repeats)", flush=True)
        out["steps"] = bench_steps(args, trees)
    if "prefill" not in skip:
        print("(a) lone prompts through the engine, max_num_batched_tokens=512", flush=True)
        out["prefill"] = bench_prefill(args, arms)
    if "ttft" not in skip:
        print(f"(b) a {SHORT_LEN}-token request during a long prefill", flush=True)
        out["ttft"] = bench_ttft(args, arms)
    print(f"wrote {write_json(args.out, out)}")


if __name__ == "__main__":
    main()
