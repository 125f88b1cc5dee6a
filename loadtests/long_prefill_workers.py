"""The measurements of ``bench_long_prefill``, each run in a process of its own against one source
tree (``PYTHONPATH``), so a tree from before a change runs the same code:

    PYTHONPATH=TREE python loadtests/long_prefill_workers.py '{"kind": "steps", ...}'

prints one line of JSON. Only the engine's public API is used (and the CPU kernels' op), which both
sides of a comparison have.
"""

from __future__ import annotations

import itertools
import json
import queue
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

TOKEN_RANGE = (1000, 40000)  # ordinary vocabulary of SmolLM2: no special tokens
SHORT_LEN = 5
NUM_THREADS = 2


def med(xs: list[float]) -> float:
    return statistics.median(xs)


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


def work_kernel(
    dtype: str, chunk_sizes: list[int], context: int, repeats: int, threads: int
) -> list[dict]:
    """One layer's prefill attention kernel at SmolLM2's shapes, a chunk after ``context`` cached
    tokens (blocks shuffled through the pool): the fastest and median of ``repeats`` calls."""
    import torch

    from kernels.cpu import cpu_ops

    torch_threads(threads)
    ops = cpu_ops()
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in chunk_sizes:
        num_blocks = -(-(context + n) // block)
        shape = (num_blocks + 1, block, kv_heads, head_dim)
        k = torch.randn(shape, generator=g).to(getattr(torch, dtype))
        v = torch.randn(shape, generator=g).to(getattr(torch, dtype))
        table = (torch.randperm(num_blocks, generator=g) + 1).reshape(1, -1)
        q = torch.randn(n, heads * head_dim, generator=g).to(k.dtype)
        starts, lens = torch.tensor([0, n]), torch.tensor([context + n])
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            ops.prefill_attention(q, k, v, table, starts, lens, heads, head_dim**-0.5)
            times.append(time.perf_counter() - t0)
        rows.append(dict(chunk_tokens=n, min_s=min(times[1:]), median_s=med(times[1:])))
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


def main() -> None:
    job = json.loads(sys.argv[1])
    works: dict[str, Callable[..., Any]] = dict(
        steps=work_steps, kernel=work_kernel, prefill=work_prefill, ttft=work_ttft
    )
    print(json.dumps(works[job.pop("kind")](**job)))


if __name__ == "__main__":
    main()
