"""The cost of tracing: stack throughput with every request traced (each service exporting over
OTLP/HTTP to a receiver in this process) against the same stack with OTEL_* unset.

    python -m loadtests.bench_tracing [--rounds 3 --num-prompts 48 --concurrency 16 \\
        --input-len 128 --output-len 32]

Both stacks are started once and kept up (the idle one costs a heartbeat every 0.5 s); the runs
alternate off, on, off, on, ... so a drift of the host's load falls on both alike. Each run is
bench_serving's fixed-concurrency client (token-id prompts, greedy, ignore_eos) after a warm-up
request; each pair of runs draws its own prompts (seeded by the round), so no stack finds a run's
prompts in its prefix cache from an earlier one. Reports each run's output tokens/s, the medians
and the cost (1 − on/off), the spans the receiver got, and writes
loadtests/results/bench_tracing.json.

It also prices the spans themselves: a child process creates a request's worth of spans (as many
as the traced runs averaged, with attributes and an event each) a thousand times and exports them
through the same OTLP/HTTP exporter to the receiver; its CPU time per request against the stack's
CPU time per request gives the share tracing's own work can explain.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

from services.cli.launcher import set_executor_openmp_policy

# Same OpenMP policy as the stack's executor; must precede torch's import.
set_executor_openmp_policy(os.environ)

# The OTLP receiver is the tests' (tests/helpers/otlp.py): one implementation of it.
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)

from helpers.otlp import OtlpReceiver  # noqa: E402 (after the path)
from loadtests.bench_serving import parse_args as serving_args  # noqa: E402
from loadtests.bench_serving import run as run_serving  # noqa: E402
from loadtests.bench_stack_vs_engine import cpu_seconds  # noqa: E402
from loadtests.results import write_json  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=3, help="off/on pairs of runs")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--out", default="loadtests/results/bench_tracing.json")
    return p.parse_args(argv)


def serving_namespace(args: argparse.Namespace, base_url: str, seed: int) -> argparse.Namespace:
    return serving_args(
        [
            *("--base-url", base_url),
            *("--num-prompts", str(args.num_prompts)),
            *("--concurrency", str(args.concurrency)),
            *("--input-len", str(args.input_len)),
            *("--output-len", str(args.output_len)),
            *("--prompt-mode", "ids"),
            *("--warmup", "1"),
            *("--seed", str(seed)),
        ]
    )


def noop_cost_us(num: int = 20_000) -> float:
    """Microseconds per request that every tracing hook of the request path costs with tracing off
    (no provider installed: this process installs none), timed in process."""
    from services.executor.spans import ExecutorSpans
    from services.gateway.tracing import start_request_span
    from services.scheduler.router import Dispatch
    from services.scheduler.spans import SchedulerSpans
    from shared.tracing import extract, headers_for
    from shared.wire.messages import ExecuteRequest
    from shared.wire.outputs import CompletionDelta, RequestOutput
    from shared.wire.sampling_params import SamplingParams

    req = ExecuteRequest(
        request_id="r",
        model="m",
        prompt_token_ids=[1] * 128,
        block_hashes=[],
        params=SamplingParams(),
    )
    out = RequestOutput(
        request_id="r",
        deltas=[CompletionDelta(index=0, token_ids=[1], text="x")],
        num_prompt_tokens=128,
        num_cached_tokens=0,
        finished=False,
    )
    executor, scheduler = ExecutorSpans("e"), SchedulerSpans("cache")
    start = time.perf_counter()
    for _ in range(num):
        span = start_request_span("POST", "/v1/chat/completions", {})  # gateway
        headers_for(span)
        span.is_recording()
        span.end()
        extract(None)  # tokenizer
        scheduler.submitted("r", None)  # scheduler
        scheduler.route(Dispatch("e", req))
        executor.accepted(req, None)  # executor
        for _ in range(32):  # one lookup per output step
            executor.on_output(out)
    return (time.perf_counter() - start) / num * 1e6


_SPAN_WORK = """
import sys
import time
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

url, num_spans, num_requests = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url + "/v1/traces")))
tracer = provider.get_tracer("bench")
start = time.process_time()  # every thread of the process: the exporter's included
for i in range(num_requests):
    with tracer.start_as_current_span("request", attributes={"gen_ai.request.model": "m"}):
        for j in range(num_spans - 1):
            span = tracer.start_span("hop", attributes={"llmserve.request_id": str(i), "n": j})
            span.add_event("event")
            span.end()
    if i % 64 == 63:
        provider.force_flush()  # the exporter's queue never overflows (no span dropped)
provider.shutdown()
print(time.process_time() - start)
"""


def span_cost_ms(receiver_url: str, spans_per_request: int, num_requests: int = 1000) -> float:
    """CPU milliseconds (in a child process, its start-up left out) to create and export one
    request's ``spans_per_request`` spans over OTLP/HTTP."""
    done = subprocess.run(
        [sys.executable, "-c", _SPAN_WORK, receiver_url, str(spans_per_request), str(num_requests)],
        check=True,
        capture_output=True,
        text=True,
    )
    return 1000 * float(done.stdout) / num_requests


def main(argv: list[str] | None = None) -> int:
    from services.cli.launcher import StackConfig, launch

    args = parse_args(argv)
    noop_us = noop_cost_us()
    print(f"tracing off: {noop_us:.1f} µs of hooks per request (32 output steps)", file=sys.stderr)
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        del os.environ[name]  # "off" means off: nothing inherited from this shell
    common = dict(
        port=0,
        dtype=args.dtype,
        max_num_seqs=max(64, args.concurrency),
        num_threads=args.num_threads,
        max_queue_len=1024,
    )
    receiver = OtlpReceiver()
    print("starting the untraced and the traced stack ...", file=sys.stderr)
    off = launch(StackConfig.of(**common))
    on = launch(
        StackConfig.of(**common, extra_env=(("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url),))
    )
    runs: dict[str, list[float]] = {"off": [], "on": []}
    # CPU seconds the stack's processes spent per 1000 output tokens: robust to a busy host, where
    # the wall-clock throughput swings with what else runs.
    cpu_per_kt: dict[str, list[float]] = {"off": [], "on": []}
    summaries: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        for i in range(args.rounds):
            for label, stack in (("off", off), ("on", on)):
                assert stack.base_url is not None
                pids = [svc.pid for svc in stack.services.values()]
                cpu0 = sum(cpu_seconds(pid) for pid in pids)
                summary = asyncio.run(run_serving(serving_namespace(args, stack.base_url, i)))
                cpu = sum(cpu_seconds(pid) for pid in pids) - cpu0
                cpu_per_kt[label].append(1000 * cpu / summary["total_output_tokens"])
                if summary["num_failed"]:
                    raise SystemExit(f"{label}: {summary['num_failed']} requests failed")
                tps = summary["output_throughput_tps"]
                runs[label].append(tps)
                summaries[label].append(summary)
                print(
                    f"round {i + 1} {label:>3}: {tps:7.1f} output tokens/s, "
                    f"{cpu_per_kt[label][-1]:.2f} CPU s per 1000 tokens",
                    file=sys.stderr,
                )
        time.sleep(1.0)  # the traced services' last export (5 s batches; some are still queued)
    finally:
        on.stop()
        off.stop()
        receiver.close()
    median = {label: statistics.median(v) for label, v in runs.items()}
    cost = 1.0 - median["on"] / median["off"]
    spans = receiver.spans()
    print(
        f"\noutput tokens/s, median of {args.rounds}: off {median['off']:.1f}, "
        f"on {median['on']:.1f}: tracing costs {100 * cost:.1f}% (target <= 3%)\n"
        f"off runs {[round(v, 1) for v in runs['off']]}, "
        f"on runs {[round(v, 1) for v in runs['on']]}"
        f"\nspans received: {len(spans)} over {receiver.num_requests} OTLP requests "
        f"({len({s.trace_id for s in spans})} traces)"
    )
    # The off path's hooks as CPU time: at the off runs' request rate, the share of one core.
    off_rps = statistics.median(x["request_throughput_rps"] for x in summaries["off"])
    noop_share = noop_us * 1e-6 * off_rps
    print(
        f"tracing off: {noop_us:.1f} µs of hooks per request = "
        f"{100 * noop_share:.4f}% of one core at {off_rps:.2f} requests/s"
    )
    cpu_median = {label: statistics.median(v) for label, v in cpu_per_kt.items()}
    cpu_cost = cpu_median["on"] / cpu_median["off"] - 1.0
    print(
        f"CPU seconds per 1000 output tokens (services, warm-up included), median: "
        f"off {cpu_median['off']:.2f}, on {cpu_median['on']:.2f}: tracing costs "
        f"{100 * cpu_cost:.1f}% more CPU"
    )
    # What the spans themselves cost, against what the stack spends on a request untraced.
    spans_per_request = max(1, round(len(spans) / max(1, len({s.trace_id for s in spans}))))
    receiver = OtlpReceiver()
    try:
        span_ms = span_cost_ms(receiver.url, spans_per_request)
    finally:
        receiver.close()
    stack_ms = cpu_median["off"] * args.output_len  # CPU ms of an untraced request
    print(
        f"spans alone: {span_ms:.2f} CPU ms per request ({spans_per_request} spans, created and "
        f"exported) = {100 * span_ms / stack_ms:.2f}% of the {stack_ms:.0f} CPU ms the stack "
        f"spends on a request untraced"
    )
    result = {
        "cpu_s_per_1000_tokens": cpu_per_kt,
        "cpu_cost": cpu_cost,
        "span_cpu_ms_per_request": span_ms,
        "spans_per_request": spans_per_request,
        "stack_cpu_ms_per_request": stack_ms,
        "noop_hooks_us_per_request": noop_us,
        "noop_share_of_one_core": noop_share,
        "config": vars(args),
        "output_tps": runs,
        "median_output_tps": median,
        "cost": cost,
        "num_spans_received": len(spans),
        "num_traces_received": len({s.trace_id for s in spans}),
        "summaries": summaries,
        "load_avg": os.getloadavg(),
    }
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
