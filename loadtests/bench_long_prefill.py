"""A short request while a long prompt prefills (real SmolLM2-135M, in process): its time to first
token against the same request on an idle engine, and what that fairness costs the long prompt.

    python -m loadtests.bench_long_prefill [--dtypes bfloat16,float32] [--long-len 4000] \\
        [--repeats 3] [--arms layered,off] [--set prefill_slice_ms=10 ...] \\
        [--out loadtests/results/bench_long_prefill.json]

The engine steps in a thread of its own, fed between steps through a queue, as the executor's
engine thread runs it: a request sent mid-step waits for that step to end. Per dtype and arm:

- idle: a 5-token request alone (``2 * repeats + 1`` times; the median is the reference);
- solo: the ``--long-len``-token prompt alone: its TTFT and greedy tokens;
- busy (``repeats`` times): the long prompt, and the 5-token request sent at a random moment of its
  prefill: the short one's TTFT and its ratio to the idle median (the goal: under 2), the long
  one's TTFT against solo, and whether its greedy tokens are unchanged;
- stream (``repeats`` times): the same with a stream decoding throughout: its longest gap between
  tokens while the long prompt prefills, and the long prompt's TTFT beside it.

Arms: ``layered`` is the engine's defaults (long prefills in forwards of their own, a slice at a
time); ``off`` sets ``long_prefill_token_threshold`` above the prompt, so the long prompt shares
every step's batch first come first served, as before. ``--set`` overrides engine settings in
every arm. TTFTs are wall time and the engine process's CPU time (which other tenants of this
shared host do not inflate); load averages are saved beside them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import random
import statistics
import threading
import time
from datetime import date
from typing import Any

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TOKEN_RANGE = (1000, 40000)  # ordinary vocabulary of SmolLM2: no special tokens
SHORT_LEN = 5
ARMS = {"layered": {}, "off": {"long_prefill_token_threshold": 1_000_000}}


def greedy(max_tokens: int):
    from shared.wire.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class EngineLoop:
    """The engine stepped in a thread of its own, fed between steps (as the executor's is)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()
        self.token_times: dict[str, list[float]] = {}  # when each delta with tokens came out
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, threading.Event] = {}
        self.error: BaseException | None = None
        # Per step: wall clock and process CPU time at its start and end.
        self.steps: list[tuple[float, float, float, float]] = []
        self.thread = threading.Thread(target=self._run_or_fail, daemon=True)
        self.thread.start()

    def submit(self, request_id: str, ids: list[int], max_tokens: int) -> float:
        self.finished[request_id] = threading.Event()
        self.tokens[request_id], self.token_times[request_id] = [], []
        sent = time.perf_counter()
        self.inbox.put(lambda: self.engine.add_request(request_id, ids, greedy(max_tokens)))
        return sent

    def abort(self, request_id: str) -> None:
        def task() -> None:
            self.engine.abort(request_id)
            self.finished[request_id].set()

        self.inbox.put(task)

    def wait(self, request_id: str) -> None:
        self.finished[request_id].wait()
        if self.error is not None:
            raise RuntimeError("the engine thread failed") from self.error

    def ttft(self, request_id: str, sent: float) -> tuple[float, float]:
        """(wall, engine CPU) seconds from ``sent`` to the first token; the step in flight at
        ``sent`` counts its CPU time from that moment on (prorated by wall time)."""
        first = self.token_times[request_id][0]
        cpu_end = next(c1 for _, w1, _, c1 in self.steps if w1 >= first)
        w0, w1, c0, c1 = next(s for s in self.steps if s[1] >= sent)
        cpu_start = c0 + max(0.0, sent - w0) / max(w1 - w0, 1e-9) * (c1 - c0)
        return first - sent, cpu_end - cpu_start

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
        import torch

        torch.set_num_threads(self.engine.config.num_threads)  # per thread, as the executor sets it
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


def measure(dtype: str, settings: dict[str, Any], long_len: int, repeats: int) -> dict[str, Any]:
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine

    # No prefix cache: the long prompt runs several times and must be prefilled each time.
    config = EngineConfig(
        dtype=dtype, memory_budget="3GiB", enable_prefix_caching=False, seed=0, **settings
    )
    loop = EngineLoop(Engine(config, progress=False))
    rng = random.Random(0)
    ids = iter(itertools.count())

    def prompt(n: int) -> list[int]:
        return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    def run(ids_: list[int], max_tokens: int) -> tuple[tuple[float, float], list[int]]:
        rid = f"r{next(ids)}"
        sent = loop.submit(rid, ids_, max_tokens)
        loop.wait(rid)
        return loop.ttft(rid, sent), loop.tokens[rid]

    def with_long(stream: bool) -> dict[str, Any]:
        """The long prompt with a short request sent somewhere in its prefill (and a stream
        decoding throughout)."""
        if stream:
            loop.submit("stream", prompt(20), 6000)
            while not loop.token_times["stream"] and loop.error is None:
                time.sleep(0.002)
        sent = loop.submit("long", long_ids, 4)
        time.sleep(rng.uniform(0.15, 0.6) * solo[0][0])
        short = run(prompt(SHORT_LEN), 1)[0]
        loop.wait("long")
        got = dict(short=short, long=loop.ttft("long", sent), same=loop.tokens["long"] == solo[1])
        if stream:
            done = loop.token_times["long"][0]
            times = [t for t in loop.token_times["stream"] if sent <= t <= done]
            got["stream_max_gap_s"] = max(b - a for a, b in itertools.pairwise(times))
            loop.abort("stream")
            loop.wait("stream")
        return got

    run(prompt(600), 2)  # warm-up
    idle = [run(prompt(SHORT_LEN), 1)[0] for _ in range(2 * repeats + 1)]
    long_ids = prompt(long_len)
    solo = run(long_ids, 4)
    busy = [with_long(stream=False) for _ in range(repeats)]
    streamed = [with_long(stream=True) for _ in range(repeats)]
    loop.close()
    return dict(
        settings=settings,
        idle_ttft_s=[w for w, _ in idle],
        idle_ttft_cpu_s=[c for _, c in idle],
        long_solo_ttft_s=solo[0][0],
        long_solo_ttft_cpu_s=solo[0][1],
        busy=busy,
        stream=streamed,
    )


def summary(r: dict[str, Any]) -> dict[str, Any]:
    idle, idle_cpu = statistics.median(r["idle_ttft_s"]), statistics.median(r["idle_ttft_cpu_s"])
    busy = [b["short"][0] for b in r["busy"]]
    busy_cpu = [b["short"][1] for b in r["busy"]]
    long_busy = [b["long"][0] for b in r["busy"]]
    return dict(
        idle_ms=1000 * idle,
        busy_ms=[1000 * b for b in busy],
        ratio=[b / idle for b in busy],
        ratio_cpu=[b / idle_cpu for b in busy_cpu],
        long_solo_s=r["long_solo_ttft_s"],
        long_busy_s=long_busy,
        long_cost=[b / r["long_solo_ttft_s"] - 1 for b in long_busy],
        stream_max_gap_ms=[1000 * s["stream_max_gap_s"] for s in r["stream"]],
        stream_short_ratio=[s["short"][0] / idle for s in r["stream"]],
        long_with_stream_s=[s["long"][0] for s in r["stream"]],
        long_tokens_unchanged=all(b["same"] for b in r["busy"] + r["stream"]),
    )


def show(dtype: str, arm: str, s: dict[str, Any]) -> None:
    def ms(xs: list[float]) -> str:
        return " ".join(f"{x:.0f}" for x in xs)

    def f(xs: list[float], fmt: str = ".2f") -> str:
        return " ".join(format(x, fmt) for x in xs)

    print(
        f"{dtype} {arm}: idle TTFT {s['idle_ms']:.0f} ms; busy TTFT {ms(s['busy_ms'])} ms, "
        f"ratio {f(s['ratio'])} (CPU time {f(s['ratio_cpu'])}); long TTFT solo "
        f"{s['long_solo_s']:.2f} s, busy {f(s['long_busy_s'])} s (+{f(s['long_cost'], '.0%')}); "
        f"with a stream: its max gap {ms(s['stream_max_gap_ms'])} ms, short ratio "
        f"{f(s['stream_short_ratio'])}, long TTFT {f(s['long_with_stream_s'])} s; long tokens "
        f"unchanged: {s['long_tokens_unchanged']}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--long-len", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--arms", default="layered,off")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="NAME=INT")
    p.add_argument("--out", default=os.path.join(DEFAULT_OUT, "bench_long_prefill.json"))
    args = p.parse_args()
    overrides = {k: int(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    results: dict[str, Any] = dict(
        date=date.today().isoformat(), argv=vars(args), cpu_count=os.cpu_count(), runs={}
    )
    for dtype in args.dtypes.split(","):
        for arm in args.arms.split(","):
            settings = dict(num_threads=args.num_threads) | ARMS[arm] | overrides
            load = os.getloadavg()[0]
            r = measure(dtype, settings, args.long_len, args.repeats)
            r |= dict(load_before=load, load_after=os.getloadavg()[0], summary=summary(r))
            results["runs"][f"{dtype} {arm}"] = r
            show(dtype, arm, r["summary"])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
