"""Prefill/decode disaggregation: ``bench_disagg.measure`` run as it is (two stacks in turn, each
with two executors pinned to one core apiece: one prefill + one decode, then two ``both``), on the
plan's workload: decode streams whose inter-token latency is measured while long prompts arrive.
The section shows the streams' ITL, the long prompts' TTFT and the output throughput of both
stacks side by side, and what moving the KV cache cost per prompt token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loadtests.report.model import MEASURED, Figure, Section, Series, Table
from loadtests.report.plan import Plan

KEY = "disaggregation"
SOURCE = f"raw/{KEY}.json"
# bench_disagg's mode names, in the order they run and are shown, with their labels
MODES = (
    ("disagg", "disaggregated (1 prefill + 1 decode)"),
    ("aggregated", "aggregated (2 x both)"),
)


def disagg_argv(plan: Plan) -> list[str]:
    """``bench_disagg``'s flags for this plan's workload (also the command that reproduces it)."""
    return [
        "--streams",
        str(plan.disagg_streams),
        "--long-len",
        str(plan.disagg_long_len),
        "--num-long",
        str(plan.disagg_num_long),
        "--interval",
        f"{plan.disagg_interval_s:g}",
        "--long-output",
        str(plan.disagg_long_output),
    ]


def measure(plan: Plan, log: Callable[[str], None]) -> dict[str, Any]:
    from loadtests import bench_disagg

    args = bench_disagg.parse_args(disagg_argv(plan))
    args.modes = ",".join(mode for mode, _ in MODES)
    data = bench_disagg.measure(args, log)
    data["plan"] = plan.name
    data["command"] = "python -m loadtests.bench_disagg " + " ".join(disagg_argv(plan))
    return data


def workload(plan: str, args: dict[str, Any]) -> str:
    sizes = "bench_disagg's defaults" if plan == "full" else "a reduced workload"
    return (
        f"({plan} plan: {sizes}) {args['streams']} streams of {args['stream_prompt_len']}-token "
        "prompts decoding greedily (ignore_eos) throughout; once all stream, "
        f"{args['num_long']} prompts of {args['long_len']:,} random tokens (no prefix hits) "
        f"arrive {args['interval']:g} s apart, {args['long_output']} output tokens each; the "
        "window runs from the first long arrival to the last long prompt's end"
    )


def build(raw: dict[str, Any]) -> Section:
    args, results, summary = raw["args"], raw["results"], raw["summary"]
    modes = [(m, label) for m, label in MODES if m in results]
    latency = Table(
        title="Decode ITL, long-prompt TTFT and throughput in the window, per stack",
        columns=[
            "stack",
            "ITL p50 (ms)",
            "ITL p99 (ms)",
            "ITL max (ms)",
            "ITL gaps (count)",
            "long TTFT p50 (ms)",
            "long TTFT p99 (ms)",
            "output (tokens/s)",
            "streams' output (tokens/s)",
            "window (s)",
            "errors (requests)",
        ],
        rows=[
            [
                label,
                results[m]["itl_ms"]["p50"],
                results[m]["itl_ms"]["p99"],
                results[m]["itl_ms"]["max"],
                results[m]["itl_ms"]["count"],
                results[m]["long_ttft_ms"]["p50"],
                results[m]["long_ttft_ms"]["p99"],
                results[m]["output_tok_s"],
                results[m]["stream_tok_s"],
                results[m]["window_s"],
                len(results[m]["stream_errors"]) + len(results[m]["long_errors"]),
            ]
            for m, label in modes
        ],
        source=SOURCE,
    )
    transfer = Table(
        title="KV cache moved from the prefill to the decode executor, per prompt token",
        columns=["stack", "KV transfer (bytes/token)", "KV transfer time (ms/token)"],
        rows=[
            [
                label,
                summary["per_mode"][m]["kv_bytes_per_token"],
                summary["per_mode"][m]["kv_transfer_ms_per_token"],
            ]
            for m, label in modes
        ],
        source=SOURCE,
    )
    executors = Table(
        title="Each executor's engine steps in the window",
        columns=["stack", "executor", "steps (count)", "mean step (ms)", "KV transfers (count)"],
        rows=[
            [
                label,
                name,
                e.get("steps", 0.0),
                e.get("step_ms_mean", float("nan")),
                ", ".join(
                    f"{k.rsplit(':', 1)[-1]} {v:g}" for k, v in e.items() if "kv_transfers" in k
                )
                or "none",
            ]
            for m, label in modes
            for name, e in results[m]["executors"].items()
        ],
        source=SOURCE,
    )
    stats = ("decode ITL p50", "decode ITL p99", "long TTFT p50", "long TTFT p99")
    side_by_side = Figure(
        title="Decode ITL and long-prompt TTFT, both stacks (log scale: TTFT is seconds, ITL ms)",
        x_label="statistic",
        x_unit="name",
        y_label="latency",
        y_unit="ms",
        kind="bar",
        x_ticks=stats,
        series=[
            Series(
                label,
                list(range(len(stats))),
                [
                    results[m]["itl_ms"]["p50"],
                    results[m]["itl_ms"]["p99"],
                    results[m]["long_ttft_ms"]["p50"],
                    results[m]["long_ttft_ms"]["p99"],
                ],
            )
            for m, label in modes
        ],
        log_y=True,
        source=SOURCE,
    )
    throughput = Figure(
        title="Output throughput in the window (streams and long prompts together)",
        x_label="stack",
        x_unit="name",
        y_label="output throughput",
        y_unit="tokens/s",
        kind="bar",
        x_ticks=[label for _, label in modes],
        series=[
            Series(
                "output", list(range(len(modes))), [results[m]["output_tok_s"] for m, _ in modes]
            )
        ],
        source=SOURCE,
    )
    return Section(
        key=KEY,
        title="Prefill/decode disaggregation",
        claim="Running prefill and decode on separate executors (shipping the KV cache between "
        "them) removes prefill's interference with decode latency.",
        status=MEASURED,
        measured=f"the whole stack over HTTP, each executor pinned to one core (cpus "
        f"{args['cpus']!r}), {args['dtype'] or 'the served default dtype (bfloat16)'}. Workload "
        f"{workload(raw['plan'], args)}. Per stack: "
        "the streams' inter-token latency (gaps inside the window) p50/p99 in ms, the long "
        "prompts' TTFT p50/p99 in ms, output tokens/s over the window, and the executors' KV "
        "transfer counters: bytes and ms per prompt token moved",
        baseline="the same workload on an aggregated stack of two 'both' executors pinned the "
        "same way (each prefills and decodes), started after the disaggregated one",
        reading=reading(raw),
        tables=[latency, transfer, executors],
        figures=[side_by_side, throughput],
        commands=[raw["command"]],
        notes=notes(raw),
    )


def reading(raw: dict[str, Any]) -> str:
    results = raw["results"]
    ratios = raw["summary"].get("disagg_vs_aggregated")
    if ratios is None:
        return f"only {', '.join(results)} measured: no comparison."
    d, a = results["disagg"], results["aggregated"]
    per = raw["summary"]["per_mode"]["disagg"]
    return (
        f"disaggregated, the streams' ITL p99 is {d['itl_ms']['p99']:.0f} ms vs "
        f"{a['itl_ms']['p99']:.0f} ms aggregated ({ratios['itl_p99_ratio']:.2f}x); the long "
        f"prompts' TTFT p50 {d['long_ttft_ms']['p50']:,.0f} vs {a['long_ttft_ms']['p50']:,.0f} ms "
        f"({ratios['ttft_p50_ratio']:.2f}x), p99 {ratios['ttft_p99_ratio']:.2f}x; output "
        f"{d['output_tok_s']:.1f} vs {a['output_tok_s']:.1f} tokens/s "
        f"({ratios['throughput_ratio']:.2f}x); the KV transfer cost "
        f"{per['kv_bytes_per_token']:,.0f} bytes and {per['kv_transfer_ms_per_token']:.3f} ms per "
        f"prompt token. Target (ITL p99 <= 0.5x at >= 1x throughput): "
        f"{'met' if ratios['target_met'] else 'not met'}."
    ) + floor_reading(raw)


def floor_reading(raw: dict[str, Any]) -> str:
    """What the split's decode floor (``bench_disagg.decode_floor``) leaves it, where measured."""
    floor, ratios = raw.get("decode_floor"), raw["summary"]["disagg_vs_aggregated"]
    if floor is None:
        return ""
    step = floor["step_ms"]
    return (
        f" The decode executor's engine alone on its core ({raw['args']['streams']} streams, "
        f"contexts {floor['contexts'][0]}-{floor['contexts'][1]}) steps in {step['p50']:.0f} ms "
        f"p50, {step['p99']:.0f} ms p99, {step['min']:.0f} ms at the fastest: every token waits "
        f"for a step, so the split's ITL p99 cannot fall below "
        f"{ratios['floor_itl_p99_ratio']:.2f}x the aggregated one here "
        f"({ratios['floor_fastest_step_ratio']:.2f}x at the fastest step)."
    )


def notes(raw: dict[str, Any]) -> list[str]:
    out = [
        "Two single-core executors per stack on a 2-core host: the unpinned services (NATS, "
        "gateway, tokenizer, scheduler) and the client share those cores. Disaggregated, one core "
        "decodes every stream and the other only prefills (idle between long prompts); "
        "aggregated, each core does both.",
        "Each stack's window ends when its last long prompt ends, so the two windows differ in "
        "length (table); throughput is each stack's tokens over its own window.",
        "Bytes and ms per token: the prefill executor's KV transfer counters over the window, "
        "divided by the prompt tokens it sent (prompt length x transfers). Whole KV blocks (16 "
        "tokens by default) move, so bytes/token is a little above the page size per token when "
        "the prompt is not a multiple of 16. The aggregated stack moves no KV, hence no numbers.",
    ]
    for mode, r in raw["results"].items():
        if r["stream_errors"] or r["long_errors"]:
            out.append(f"{mode}: errors {r['stream_errors'][:3]} {r['long_errors'][:3]}")
        if r.get("num_streams_ended_in_window"):
            out.append(
                f"{mode}: {r['num_streams_ended_in_window']} stream(s) ended inside the window "
                "(their max_tokens ran out): fewer gaps were measured than the window held."
            )
    return out
