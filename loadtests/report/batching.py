"""Continuous vs static batching on a mixed short/long trace (``mix.py``'s run of
``bench_engine`` (b)): continuous admits a waiting request whenever one finishes; static runs B
requests to completion before admitting the next B (``static``: a finished member leaves the
forward pass; ``static_padded``: it keeps decoding to the batch's longest, as a fixed-shape batch
does)."""

from __future__ import annotations

from typing import Any

from loadtests.report import mix
from loadtests.report.model import MEASURED, Figure, Section, Series, Table

KEY = "batching"
MODES = ("continuous", "static", "static_padded")


def build(raw: dict[str, Any]) -> Section:
    t = raw["trace"]
    rows = [
        [
            mode,
            raw[mode]["output_tokens_per_s"],
            raw[mode]["elapsed_s"],
            raw[mode]["num_steps"],
            raw[mode]["mean_e2e_short_s"],
            raw[mode]["mean_e2e_long_s"],
            raw[mode]["output_tokens_per_cpu_s"],
        ]
        for mode in MODES
    ]
    table = Table(
        title="Same trace, same engine, three admission policies",
        columns=[
            "mode",
            "output (tokens/s)",
            "elapsed (s)",
            "engine steps",
            "mean E2E, short requests (s)",
            "mean E2E, long requests (s)",
            "output per CPU-second (tokens/CPU-s)",
        ],
        rows=rows,
        source=mix.SOURCE,
    )
    xs = list(range(len(MODES)))
    throughput = Figure(
        title="Output throughput by batching mode",
        x_label="batching mode",
        x_unit="name",
        y_label="output throughput",
        y_unit="tokens/s",
        kind="bar",
        x_ticks=MODES,
        series=[Series("output tokens/s", xs, [raw[m]["output_tokens_per_s"] for m in MODES])],
        source=mix.SOURCE,
    )
    latency = Figure(
        title="Mean end-to-end latency by batching mode and request length",
        x_label="batching mode",
        x_unit="name",
        y_label="mean E2E latency",
        y_unit="s",
        kind="bar",
        x_ticks=MODES,
        series=[
            Series(
                f"short ({t['short_tokens']} output tokens)",
                xs,
                [raw[m]["mean_e2e_short_s"] for m in MODES],
            ),
            Series(
                f"long ({t['long_tokens']} output tokens)",
                xs,
                [raw[m]["mean_e2e_long_s"] for m in MODES],
            ),
        ],
        source=mix.SOURCE,
    )
    return Section(
        key=KEY,
        title="Continuous vs static batching",
        claim="Admitting a new request as soon as one finishes (continuous batching) beats running "
        "batches to completion, in throughput and in short requests' latency, on mixed lengths.",
        status=MEASURED,
        measured=f"the engine offline on {t['num_requests']} requests ({t['num_long']} x "
        f"{t['long_tokens']} + {t['num_requests'] - t['num_long']} x {t['short_tokens']} greedy "
        f"output tokens, prompts {t['prompt_len_range'][0]}-{t['prompt_len_range'][1]} tokens of "
        f"real text), max_num_seqs = B = {t['batch_size']}: output tokens/s, wall s, E2E s from "
        "the start of the run",
        baseline=f"static batching (batches of {t['batch_size']}, no admission until the batch "
        "drains), with and without padding, same engine and prompts in the same run",
        reading=f"continuous {raw['continuous']['output_tokens_per_s']:.1f} tokens/s = "
        f"{raw['throughput_ratio']:.2f}x static, {raw['padded_throughput_ratio']:.2f}x static "
        f"padded (per CPU-second: {raw['cpu_throughput_ratio']:.2f}x, "
        f"{raw['padded_cpu_throughput_ratio']:.2f}x); short requests finish in "
        f"{raw['continuous']['mean_e2e_short_s']:.1f} s vs "
        f"{raw['static']['mean_e2e_short_s']:.1f} s static.",
        tables=[table],
        figures=[throughput, latency],
        commands=[raw["command"]] if "command" in raw else [],
        notes=[
            "Static padded does the most arithmetic but runs fixed-size steps; on a CPU a step's "
            "cost grows with its rows, so the unpadded static run is the harder baseline for "
            "latency and the padded one for steps."
        ],
    )
