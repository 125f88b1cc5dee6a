"""Long prompts on the engine (real SmolLM2-135M, in process): how prefill time grows with the
prompt and where it goes, and what a long prefill does to a short request's time to first token.

    python -m loadtests.bench_long_prefill --baseline TREE [--num-threads 1] \\
        [--lengths 1024,2048,4096,8000] [--dtypes float32,bfloat16] [--chunks 512,128,64] \\
        [--thresholds 512,128] [--skip steps,kernel,prefill,ttft] \\
        [--out loadtests/results/bench_long_prefill.json]

(a) Prefill. "steps": one chunk of each ``--chunks`` size after each ``--contexts`` length,
through the model runner, the fastest of ``--repeats`` (min, not mean: the host's noise only ever
adds), with its attention time and attention's GFLOP/s; from them, each lone prompt's prefill,
chunk by chunk (a chunk's cost is linear in the context before it). "kernel": the prefill
attention kernel alone on both cores, quiet and beside a spinning process. "prefill": lone prompts
of ``--lengths`` through the engine, end to end (one run each: noisy).

(b) Head-of-line blocking ("ttft"): the engine steps in its own thread, fed between steps through a
queue, as the executor runs it. A 5-token request's TTFT alone ("idle"), then sent at a random
moment while a ``--ttft-long-len``-token prompt prefills; the long prompt's own TTFT (what fairness
costs it), its greedy tokens against its solo run, and the longest gap of a stream decoding
meanwhile. Wall time and the engine's CPU time, which other tenants of the host do not inflate.

Each measurement runs in its own process (``long_prefill_workers.py``) with one tree's code:
``--baseline`` names a checkout of the code before the change ("before"), this checkout is "after";
``--thresholds`` are this tree's ``long_prefill_token_threshold`` arms (512, the step budget: the
old first-come behaviour). ``--num-threads 1``: no thread waits on another that a neighbour
descheduled, so the numbers move less on this shared 2-core host. Load averages are saved too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKERS = os.path.join(HERE, "long_prefill_workers.py")
DEFAULT_OUT = os.path.join(HERE, "results", "bench_long_prefill.json")
SHORT_LEN = 5  # as long_prefill_workers.SHORT_LEN
NUM_THREADS = 2


# ---- the parent: alternates trees and configurations, prints and saves -------------------------


def spawn(tree: str, job: dict[str, Any]) -> Any:
    """Run one job with ``tree``'s code (its own process, so nothing is shared with other
    configurations but the host)."""
    env = dict(os.environ, PYTHONPATH=tree)
    proc = subprocess.run(
        [sys.executable, WORKERS, json.dumps(job)],
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


def bench_kernel(args, trees: list[tuple[str, str]]) -> dict[str, Any]:
    """(a) the prefill attention kernel alone, on both cores, with the host quiet and with one
    process spinning beside it (as a co-located service or another tenant does): a fixed split of
    the work between threads runs at the pace of the thread that shares its core."""
    rows: dict[str, dict[str, dict[str, list[dict]]]] = {}
    for dtype in args.dtypes:
        for busy in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                for name, tree in trees:
                    job = dict(
                        kind="kernel",
                        dtype=dtype,
                        chunk_sizes=args.chunks,
                        context=4096,
                        repeats=5 * args.repeats,
                        threads=NUM_THREADS,
                    )
                    got = spawn(tree, job)
                    rows.setdefault(dtype, {}).setdefault(name, {})["busy" if busy else "quiet"] = (
                        got
                    )
                    for r in got:
                        print(
                            f"  {dtype:8s} {name:6s} {'one core busy' if busy else 'quiet':13s} "
                            f"chunk {r['chunk_tokens']:4d} after 4096: {1000 * r['min_s']:7.2f} ms "
                            f"(median {1000 * r['median_s']:7.2f}) per layer",
                            flush=True,
                        )
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    return rows


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
    p.add_argument("--skip", default="", help="parts to skip: steps, kernel, prefill, ttft")
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args()
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
    if "kernel" not in skip:
        print("(a) the prefill attention kernel, 2 threads, quiet and beside a busy process")
        out["kernel"] = bench_kernel(args, trees)
    if "prefill" not in skip:
        print("(a) lone prompts through the engine, max_num_batched_tokens=512", flush=True)
        out["prefill"] = bench_prefill(args, arms)
    if "ttft" not in skip:
        print(f"(b) a {SHORT_LEN}-token request during a long prefill", flush=True)
        out["ttft"] = bench_ttft(args, arms)
    print(f"wrote {write_json(args.out, out)}")


if __name__ == "__main__":
    main()
