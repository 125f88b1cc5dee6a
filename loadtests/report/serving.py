"""The serving curve: output throughput and latency percentiles vs the number of requests in
flight, on the engine in process (``bench_stack_vs_engine.run_engine``: closed loop, the next
request added as soon as one finishes, vLLM's TTFT / TPOT / E2E definitions from
``bench_serving``), with the ceiling this host's arithmetic allows for the same work
(``ceiling.py``: the run's FLOPs at the measured bf16 peak)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loadtests.report.model import MEASURED, Figure, Section, Series, Table
from loadtests.report.plan import Plan

KEY = "serving_curve"
SOURCE = f"raw/{KEY}.json"


def stack_argv(plan: Plan, concurrency: int) -> list[str]:
    return [
        "--num-prompts",
        str(plan.requests_per_slot * concurrency),
        "--concurrency",
        str(concurrency),
        "--input-len",
        str(plan.serving_input_len),
        "--output-len",
        str(plan.serving_output_len),
        "--num-threads",
        str(plan.threads),
    ]


def measure(plan: Plan, log: Callable[[str], None]) -> dict[str, Any]:
    from loadtests import bench_stack_vs_engine as sve
    from loadtests import ceiling

    engine = None
    points = []
    for c in plan.concurrency:
        args = sve.parse_args(stack_argv(plan, c))
        prompts = sve.round_prompts(args, seed=c)  # distinct per level
        if engine is None:
            engine = sve.make_engine(args, max(plan.concurrency))
        log(f"serving curve: {len(prompts) - 1} requests, {c} in flight")
        summary = sve.run_engine(args, prompts, engine)
        summary["concurrency"] = c
        points.append(summary)
    assert engine is not None
    prompt_lens = [plan.serving_input_len] * (plan.requests_per_slot * max(plan.concurrency))
    flops = ceiling.run_flops(engine.model.config, prompt_lens, plan.serving_output_len)
    try:
        peak = ceiling.bf16_peak_gflops(plan.threads)
        seconds = ceiling.ceiling_seconds(flops, peak)
        bound: dict[str, Any] = dict(
            bf16_peak_gflops=peak,
            level=ceiling.peak_level(),
            flops=flops,
            seconds=seconds,
            output_tokens_per_s=len(prompt_lens) * plan.serving_output_len / seconds,
        )
    except RuntimeError as exc:
        bound = dict(skipped=str(exc))
    return dict(
        input_len=plan.serving_input_len,
        output_len=plan.serving_output_len,
        requests_per_slot=plan.requests_per_slot,
        points=points,
        ceiling=bound,
        commands=[
            "python -m loadtests.bench_stack_vs_engine "
            + " ".join(stack_argv(plan, c))
            + "  # its in-process half"
            for c in plan.concurrency
        ],
    )


def build(raw: dict[str, Any]) -> Section:
    pts = raw["points"]
    cs = [p["concurrency"] for p in pts]
    table = Table(
        title="Throughput and latency vs requests in flight",
        columns=[
            "in flight (requests)",
            "requests",
            "output (tokens/s)",
            "requests/s",
            "TTFT p50 (ms)",
            "TTFT p99 (ms)",
            "TPOT p50 (ms)",
            "TPOT p99 (ms)",
            "E2E p50 (ms)",
            "E2E p99 (ms)",
        ],
        rows=[
            [
                p["concurrency"],
                p["num_completed"],
                p["output_throughput_tps"],
                p["request_throughput_rps"],
                p["ttft_ms"]["median"],
                p["ttft_ms"]["p99"],
                p["tpot_ms"]["median"],
                p["tpot_ms"]["p99"],
                p["e2e_ms"]["median"],
                p["e2e_ms"]["p99"],
            ]
            for p in pts
        ],
        source=SOURCE,
    )
    bound = raw["ceiling"]
    hlines = (
        [
            (
                f"ceiling: {bound['output_tokens_per_s']:.0f} tokens/s (bf16 peak "
                f"{bound['bf16_peak_gflops']:.0f} GFLOP/s)",
                bound["output_tokens_per_s"],
            )
        ]
        if "skipped" not in bound
        else []
    )
    throughput = Figure(
        title="Output throughput vs concurrency (dashed: the arithmetic ceiling of this host)",
        x_label="requests in flight",
        x_unit="requests",
        y_label="output throughput",
        y_unit="tokens/s",
        series=[Series("engine in process", cs, [p["output_throughput_tps"] for p in pts])],
        hlines=hlines,
        log_x=True,
        x_ticks=[str(c) for c in cs],
        source=SOURCE,
    )
    latency = Figure(
        title="Latency percentiles vs concurrency",
        x_label="requests in flight",
        x_unit="requests",
        y_label="latency",
        y_unit="ms",
        series=[
            Series("TTFT p50", cs, [p["ttft_ms"]["median"] for p in pts]),
            Series("TTFT p99", cs, [p["ttft_ms"]["p99"] for p in pts]),
            Series("TPOT p50", cs, [p["tpot_ms"]["median"] for p in pts]),
            Series("TPOT p99", cs, [p["tpot_ms"]["p99"] for p in pts]),
        ],
        log_x=True,
        x_ticks=[str(c) for c in cs],
        source=SOURCE,
    )
    lo, hi = pts[0], pts[-1]
    reading = (
        f"{hi['concurrency']} in flight give {hi['output_throughput_tps']:.1f} tokens/s = "
        f"{hi['output_throughput_tps'] / lo['output_throughput_tps']:.2f}x one at a time, at "
        f"TPOT p50 {hi['tpot_ms']['median']:.0f} ms vs {lo['tpot_ms']['median']:.0f} ms"
    )
    if "skipped" not in bound:
        best = max(p["output_throughput_tps"] for p in pts)
        reading += (
            f"; the best point reaches {100 * best / bound['output_tokens_per_s']:.0f}% "
            "of the arithmetic ceiling."
        )
    else:
        reading += f"; ceiling not computed ({bound['skipped']})."
    return Section(
        key=KEY,
        title="Throughput vs concurrency: the serving curve",
        claim="Batching more requests raises throughput until the host's compute is used, at the "
        "cost of each request's per-token latency.",
        status=MEASURED,
        measured=f"the engine in process, closed loop at {', '.join(map(str, cs))} requests in "
        f"flight ({raw['requests_per_slot']} x that many requests each, {raw['input_len']} prompt "
        f"+ {raw['output_len']} output tokens, greedy, ignore_eos): output tokens/s, TTFT / TPOT "
        "/ E2E percentiles in ms",
        baseline="one request in flight (the first point), and the arithmetic ceiling: the "
        "run's FLOPs at this host's measured bf16 peak (generous: KV reads and memory bandwidth "
        "are not counted)",
        reading=reading,
        tables=[table],
        figures=[throughput, latency],
        commands=raw["commands"],
        notes=[
            "In process, not over HTTP: the stack's own overhead on the same requests is "
            "what bench_stack_vs_engine measures (see loadtests/RESULTS.md); p99 over a few "
            "requests is close to the maximum."
        ],
    )
