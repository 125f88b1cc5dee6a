"""The cost of the architecture: the same requests through the whole stack over HTTP (gateway →
tokenizer → scheduler → executor over NATS) and through the engine in process, in one run.

    python -m loadtests.bench_stack_vs_engine \\
        [--num-prompts 64 --concurrency 16 --input-len 128 --output-len 128] [--rounds 3]

Both sides see identical token-id prompts, greedy decoding with ignore_eos, the same engine config
and the same number of requests in flight. The in-process side keeps ``concurrency`` requests in the
engine and adds the next one as soon as one finishes, timing each request from when it is added.

The stack and the in-process engine stay up for the whole run and take turns, ``--rounds`` times
(stack, engine, stack, engine, ...), and the throughput ratio is taken round by round: a shared
host's speed drifts by more than the ratio's margins between minutes, and a pair run back to back
sees the same host. The headline is the median round's ratio. Each round draws its own prompts (its
index is their seed), so that neither side's prefix cache holds a round's prompts from an earlier
one: both sides prefill every prompt of every round. Writes
loadtests/results/bench_stack_vs_engine.json.

``--front-ceiling`` adds a third run to each round: the engine in process again, while a second
stack whose executor computes nothing (``--mock-step-ms``: a mock engine stepping at the first
stack round's step time) serves the same workload to a client in another process. That stack's
gateway, tokenizer, scheduler, index, bus and client then take what they take in a real round, and
the engine's throughput beside them over its throughput alone is the most the stack can reach on
this host with its front as it is: the rest of the stack's gap is the executor's own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time

from services.cli.launcher import set_executor_openmp_policy

# Same OpenMP policy as the stack's executor; must precede torch's import.
set_executor_openmp_policy(os.environ)

from loadtests.bench_serving import RequestResult, make_prompts, print_report, summarize  # noqa: E402 (after the OpenMP policy)
from loadtests.bench_serving import parse_args as serving_args  # noqa: E402 (after the OpenMP policy)
from loadtests.bench_serving import run as run_serving  # noqa: E402 (after the OpenMP policy)
from loadtests.results import write_json  # noqa: E402 (after the OpenMP policy)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument(
        "--rounds", type=int, default=3, help="stack and in-process runs, taking turns, of each"
    )
    p.add_argument(
        "--front-ceiling",
        action="store_true",
        help="also run the engine beside a mock-engine stack's load, each round (see above)",
    )
    p.add_argument("--out", default="loadtests/results/bench_stack_vs_engine.json")
    return p.parse_args(argv)


def serving_argv(
    args: argparse.Namespace, base_url: str, num_prompts: int, seed: int = 0
) -> list[str]:
    """bench_serving's arguments for this benchmark's workload, its prompts drawn from ``seed``."""
    return [
        "--base-url",
        base_url,
        "--num-prompts",
        str(num_prompts),
        "--concurrency",
        str(args.concurrency),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--prompt-mode",
        "ids",
        "--warmup",
        "1",
        "--seed",
        str(seed),
    ]


def serving_namespace(
    args: argparse.Namespace, base_url: str | None, seed: int = 0
) -> argparse.Namespace:
    return serving_args(serving_argv(args, base_url or "", args.num_prompts, seed))


def round_prompts(args: argparse.Namespace, seed: int) -> list[str | list[int]]:
    """The prompts the HTTP client sends for ``seed`` (``serving_namespace``), the warm-up's first:
    what ``run_engine`` gets for the same round."""
    ns = serving_namespace(args, None, seed)
    return make_prompts(ns, random.Random(ns.seed))


def step_counts(before, after, duration_s: float) -> dict:
    """Engine steps between two ``EngineStats``, what each step carried on average, the mean step
    time and the share of ``duration_s`` (the run's wall time) the engine spent stepping."""
    steps = max(after.num_steps - before.num_steps, 1)
    busy_s = after.step_seconds_total - before.step_seconds_total
    return dict(
        num_steps=after.num_steps - before.num_steps,
        generated_tokens_per_step=(after.num_generated_tokens - before.num_generated_tokens)
        / steps,
        computed_tokens_per_step=(after.num_computed_tokens - before.num_computed_tokens) / steps,
        step_ms=1000 * busy_s / steps,
        busy_share=busy_s / duration_s,
    )


async def next_heartbeat_stats(stack):
    """The executor's counters from its next heartbeat (sent after this call starts), heard as the
    stack's admin user (its bus is closed to others)."""
    from shared.wire import messages, subjects
    from shared.wire.bus import Bus

    async with (
        await Bus.connect(stack.nats_url, "bench", auth=stack.admin_auth) as bus,
        await bus.subscribe_iter(subjects.EXECUTOR_STATS_ALL) as sub,
    ):
        return messages.EXECUTOR_HEARTBEAT.decode((await sub.next(timeout=10)).data).stats


def make_engine(args: argparse.Namespace, max_concurrency: int | None = None):
    """The engine ``run_engine`` drives: the stack's executor configuration for ``args`` (the
    served defaults, as ``start_stack``'s executor gets them: its memory budget, and so its KV
    pool, included)."""
    from dataclasses import replace

    from services.executor.config import SERVED_ENGINE_DEFAULTS
    from shared.engine.engine import Engine

    return Engine(
        replace(
            SERVED_ENGINE_DEFAULTS,
            dtype=args.dtype,
            max_num_seqs=max(64, max_concurrency or args.concurrency),
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_threads=args.num_threads,
        ),
        progress=False,
    )


def run_engine(args: argparse.Namespace, prompts: list[str | list[int]], engine=None) -> dict:
    """The prompts through the engine in process, ``args.concurrency`` in flight (the first one is
    a warm-up, not counted). ``engine``: reuse one (idle, from ``make_engine``), e.g. across
    concurrency levels; by default a new one. Its prefix cache is emptied first: the run computes
    every prompt, whatever ran before it."""
    from loadtests.engine_setup import empty_prefix_cache
    from shared.wire.sampling_params import SamplingParams

    if engine is None:
        engine = make_engine(args)
    empty_prefix_cache(engine)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    warm, prompts = prompts[0], prompts[1:]
    engine.add_request("warmup", warm, params)
    while engine.has_unfinished():
        engine.step()
    results = [RequestResult() for _ in prompts]
    stats0 = engine.stats()
    started: dict[str, float] = {}
    last: dict[str, float] = {}
    pending = list(range(len(prompts)))
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(engine.requests) < args.concurrency:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params)
            started[str(i)] = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            r = results[int(out.request_id)]
            n = sum(len(d.token_ids) for d in out.deltas)
            if n:
                if r.output_tokens == 0:
                    r.ttft_s = now - started[out.request_id]
                else:
                    r.itl_s.append(now - last[out.request_id])
                last[out.request_id] = now
                r.output_tokens += n
            if out.finished:
                r.ok, r.status, r.e2e_s = True, 200, now - started[out.request_id]
    duration_s = time.perf_counter() - start
    summary = summarize(serving_namespace(args, None), "in-process", results, duration_s)
    summary["steps"] = step_counts(stats0, engine.stats(), duration_s)
    return summary


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process (Linux /proc), 0.0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def stack_pids(stack) -> dict[str, int]:
    """Every process of ``stack`` by name: its services, nats-server and redis-server."""
    pids = {name: svc.pid for name, svc in stack.services.items()}
    pids.update({server.name: server.pid for server in stack.servers})
    return pids


def cpu_now(procs: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in procs.items()}


def cpu_since(before: dict[str, float], procs: dict[str, int]) -> dict[str, float]:
    """CPU seconds each process of ``procs`` spent since ``before`` (``cpu_now``)."""
    return {name: cpu_seconds(pid) - before[name] for name, pid in procs.items()}


def start_stack(args: argparse.Namespace, mock_step_ms: float | None = None):
    """The stack ``run_stack_round`` sends requests to, its executor as ``make_engine``'s engine,
    or with ``mock_step_ms`` a mock engine stepping that long (shared/engine/mock.py)."""
    from services.cli.launcher import StackConfig, launch

    config = StackConfig.of(
        port=0,
        dtype=args.dtype,
        max_num_seqs=max(64, args.concurrency),
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.num_threads,
        max_queue_len=1024,
    )
    if mock_step_ms is None:
        return launch(config)
    # The launcher hands its environment down to the services; only the executor reads this.
    os.environ["LLMSERVE_MOCK_STEP_MS"] = str(mock_step_ms)
    try:
        return launch(config)
    finally:
        del os.environ["LLMSERVE_MOCK_STEP_MS"]


def run_stack_round(args: argparse.Namespace, stack, seed: int = 0) -> dict:
    """One serving run through ``stack`` (``start_stack``) of the prompts drawn from ``seed``
    (``serving_namespace``): its summary, plus ``cpu_s``: CPU seconds each process spent during
    the run (the services, nats-server, redis-server, and this client; on a host with few cores,
    what the others take is what the executor does not get), and ``steps``: the executor's steps
    over the run, from its heartbeats (after the warm-up)."""
    procs = stack_pids(stack)
    before = cpu_now(procs)
    client_before = time.process_time()

    async def serve() -> dict:
        stats0 = []

        async def after_warmup() -> None:
            stats0.append(await next_heartbeat_stats(stack))

        result = await run_serving(serving_namespace(args, stack.base_url, seed), after_warmup)
        after = await next_heartbeat_stats(stack)
        result["steps"] = step_counts(stats0[0], after, result["duration_s"])
        return result

    summary = asyncio.run(serve())
    summary["cpu_s"] = cpu_since(before, procs)
    summary["cpu_s"]["client (this process)"] = time.process_time() - client_before
    return summary


def run_beside_front(args: argparse.Namespace, prompts: list, engine, front, seed: int = 0) -> dict:
    """``run_engine`` while ``front``, a mock-engine stack (``start_stack(mock_step_ms=...)``),
    serves this workload to a client in another process, already in full flight when the engine
    starts and stopped when it ends: the engine's summary, plus ``cpu_s``, the CPU seconds the
    front's processes and that client took during the engine's run."""
    argv = serving_argv(args, front.base_url, LOAD_PROMPTS_FACTOR * args.num_prompts, seed)
    client = subprocess.Popen(
        [sys.executable, "-m", "loadtests.bench_serving", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while asyncio.run(next_heartbeat_stats(front)).num_running < args.concurrency:
            if client.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the mock-engine stack's client did not get its load going")
        procs = {**stack_pids(front), "client (its own process)": client.pid}
        before = cpu_now(procs)
        run = run_engine(args, prompts, engine)
        run["cpu_s"] = cpu_since(before, procs)
        if client.poll() is not None:
            raise RuntimeError("the mock-engine stack's load ended before the engine's run")
    finally:
        client.terminate()
        client.wait()
    return run


# The front's client sends this many times the workload's prompts: its load outlasts the engine's
# run beside it, which ends it.
LOAD_PROMPTS_FACTOR = 4


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    print("starting the stack and loading the engine in process ...", file=sys.stderr)
    rounds: list[dict] = []
    stack = start_stack(args)
    front = None
    try:
        engine = make_engine(args)
        for r in range(args.rounds):
            prompts = round_prompts(args, seed=r)
            stack_run = run_stack_round(args, stack, seed=r)
            engine_run = run_engine(args, prompts, engine)
            engine_tps = engine_run["output_throughput_tps"]
            ratio = stack_run["output_throughput_tps"] / engine_tps
            rounds.append({"stack": stack_run, "engine": engine_run, "throughput_ratio": ratio})
            line = (
                f"round {r + 1}/{args.rounds}: stack {stack_run['output_throughput_tps']:.1f}, "
                f"in process {engine_tps:.1f} output tok/s: {ratio:.3f}"
            )
            if args.front_ceiling:
                if front is None:  # its token rate: the stack's, as first measured
                    front = start_stack(args, mock_step_ms=stack_run["steps"]["step_ms"])
                beside = run_beside_front(args, prompts, engine, front, seed=r)
                rounds[-1]["beside_front"] = beside
                rounds[-1]["front_ceiling"] = beside["output_throughput_tps"] / engine_tps
                line += (
                    f"; beside the front {beside['output_throughput_tps']:.1f}: "
                    f"{rounds[-1]['front_ceiling']:.3f}"
                )
            print(line, file=sys.stderr, flush=True)
    finally:
        stack.stop()
        if front is not None:
            front.stop()
    # The median round (the lower middle one for an even count) is the one reported in full.
    ranked = sorted(rounds, key=lambda rd: rd["throughput_ratio"])
    median = ranked[(len(ranked) - 1) // 2]
    stack_run, engine_run = median["stack"], median["engine"]
    for name, s in (("stack over HTTP", stack_run), ("in-process engine", engine_run)):
        print(f"\n### {name} (the median round)")
        print_report(s)
    print(
        "\nCPU seconds during the stack run "
        f"({stack_run['duration_s']:.1f} s on {os.cpu_count()} cores): "
        + ", ".join(
            f"{name} {sec:.1f}"
            for name, sec in sorted(stack_run["cpu_s"].items(), key=lambda kv: -kv[1])
        )
    )
    for name, s in (("stack", stack_run), ("in process", engine_run)):
        st = s["steps"]
        print(
            f"engine steps, {name}: {st['num_steps']}, "
            f"{st['generated_tokens_per_step']:.1f} tokens generated and "
            f"{st['computed_tokens_per_step']:.1f} computed per step, "
            f"{st['step_ms']:.1f} ms per step, stepping {100 * st['busy_share']:.0f}% of the run"
        )
    ratios = [rd["throughput_ratio"] for rd in rounds]
    median_ratio = statistics.median(ratios)
    print(
        f"\nstack / in-process output throughput: median {median_ratio:.3f} "
        f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)}; target >= 0.90)"
    )
    result = {
        "rounds": rounds,
        "throughput_ratio": median_ratio,
        "load_avg": os.getloadavg(),
    }
    if args.front_ceiling:
        ceilings = [rd["front_ceiling"] for rd in rounds]
        result["front_ceiling"] = statistics.median(ceilings)
        cpu = median["beside_front"]["cpu_s"]
        print(
            f"the engine beside a mock-engine stack's front / alone: median "
            f"{result['front_ceiling']:.3f} (rounds: {', '.join(f'{x:.3f}' for x in ceilings)}), "
            "the most the stack reaches here with its front as it is\n"
            "CPU seconds the front took beside the median round's engine: "
            + ", ".join(
                f"{name} {sec:.1f}" for name, sec in sorted(cpu.items(), key=lambda kv: -kv[1])
            )
        )
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
