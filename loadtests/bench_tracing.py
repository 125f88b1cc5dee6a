"""The cost of tracing: stack throughput with every request traced (each service exporting over
OTLP/HTTP to a receiver in this process) against the same stack with OTEL_* unset.

    python -m loadtests.bench_tracing [--rounds 3 --num-prompts 48 --concurrency 16 \\
        --input-len 128 --output-len 32]

Both stacks are started once and kept up (the idle one costs a heartbeat every 0.5 s); the runs
alternate off, on, off, on, ... so a drift of the host's load falls on both alike. Each run is
bench_serving's fixed-concurrency client (token-id prompts, greedy, ignore_eos) after a warm-up
request. Reports each run's output tokens/s, the medians and the cost (1 − on/off), the spans the
receiver got, and writes loadtests/results/bench_tracing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
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


def serving_namespace(args: argparse.Namespace, base_url: str) -> argparse.Namespace:
    return serving_args(
        [
            *("--base-url", base_url),
            *("--num-prompts", str(args.num_prompts)),
            *("--concurrency", str(args.concurrency)),
            *("--input-len", str(args.input_len)),
            *("--output-len", str(args.output_len)),
            *("--prompt-mode", "ids"),
            *("--warmup", "1"),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    from services.cli.launcher import StackConfig, launch

    args = parse_args(argv)
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
    summaries: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        for i in range(args.rounds):
            for label, stack in (("off", off), ("on", on)):
                assert stack.base_url is not None
                summary = asyncio.run(run_serving(serving_namespace(args, stack.base_url)))
                if summary["num_failed"]:
                    raise SystemExit(f"{label}: {summary['num_failed']} requests failed")
                tps = summary["output_throughput_tps"]
                runs[label].append(tps)
                summaries[label].append(summary)
                print(f"round {i + 1} {label:>3}: {tps:7.1f} output tokens/s", file=sys.stderr)
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
    result = {
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
