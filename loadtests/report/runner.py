"""Run the study: measure each section, write its raw JSON under ``OUT/raw/``, build the section
from that file as written (so every number shown is one a reader can find there), then write
``OUT/index.html``. A measurement that raises becomes a section that says so; the others still
run."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from loadtests.report import (
    absent,
    batching,
    disagg,
    ledger,
    mix,
    paged_kv,
    prefix,
    quantization,
    serving,
)
from loadtests.report.html import render_report, write_report
from loadtests.report.model import Section, failed
from loadtests.report.plan import Plan, plan_for
from loadtests.results import write_json

RAW_DIR = "raw"

# (key of the raw JSON, measure(plan, log) -> dict, builders: raw -> Section, with their titles
# for a failure) in report order. The mixed trace is measured once and read by two sections.
Builder = tuple[str, str, Callable[[dict[str, Any]], Section]]
MEASUREMENTS: list[
    tuple[str, Callable[[Plan, Callable[[str], None]], dict[str, Any]], list[Builder]]
] = [
    (ledger.KEY, ledger.measure, [(ledger.KEY, "The memory ledger", ledger.build)]),
    (
        mix.KEY,
        mix.measure,
        [
            (paged_kv.KEY, "Paged KV vs contiguous reservation", paged_kv.build),
            (batching.KEY, "Continuous vs static batching", batching.build),
        ],
    ),
    (prefix.KEY, prefix.measure, [(prefix.KEY, "Prefix caching", prefix.build)]),
    (
        quantization.KEY,
        quantization.measure,
        [
            (quantization.KEY, "Weight and KV quantization", quantization.build),
        ],
    ),
    (serving.KEY, serving.measure, [(serving.KEY, "The serving curve", serving.build)]),
    (disagg.KEY, disagg.measure, [(disagg.KEY, "Prefill/decode disaggregation", disagg.build)]),
]
KEYS = [key for key, _, _ in MEASUREMENTS]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _load_average() -> list[float] | None:
    from loadtests.report.host import load_average

    return load_average()


def run_report(
    out_dir: str,
    *,
    quick: bool,
    command: str,
    only: Sequence[str] = (),
    say: Callable[[str], None] = log,
) -> str:
    """Run the sections (``only``: a subset, by raw JSON key) and write the report; returns the
    path of ``index.html``."""
    import torch

    from loadtests import engine_setup
    from loadtests.report import host, plots

    plan = plan_for(quick)
    chosen = [m for m in MEASUREMENTS if not only or m[0] in only]
    say(
        f"bench report ({plan.name}): {len(chosen)} measurements, expected about "
        f"{plan.expected_minutes} min on a quiet 2-core host (longer on a busy one); writing "
        f"{os.path.abspath(out_dir)}"
    )
    malloc_tuned = engine_setup.tune_malloc()  # as bench_engine's own runs do
    torch.set_num_threads(plan.threads)
    raw_dir = os.path.join(out_dir, RAW_DIR)
    os.makedirs(raw_dir, exist_ok=True)
    host_info = host.describe()
    load_start = _load_average()
    t_start = time.perf_counter()
    durations: dict[str, float] = {}
    # the 1-minute load average as each measurement starts: on a shared host, where the noise was
    loads: dict[str, float | None] = {}
    sections: list[Section] = []
    for i, (key, measure, builders) in enumerate(chosen, start=1):
        elapsed = time.perf_counter() - t_start
        say(f"[{i}/{len(chosen)}] {key} (at {elapsed / 60:.1f} of ~{plan.expected_minutes} min)")
        t0 = time.perf_counter()
        load = _load_average()
        loads[key] = load[0] if load else None
        path = os.path.join(raw_dir, f"{key}.json")
        try:
            data = measure(plan, say)
            write_json(path, data)
            with open(path) as f:
                data = json.load(f)  # build from the file as written
        except Exception as exc:  # one broken measurement must not cost the rest of the report
            say(f"{key} failed: {exc!r}")
            err = "".join(traceback.format_exception(exc))
            write_json(path, {"error": repr(exc), "traceback": err})
            sections += [
                failed(skey, title, "", f"the measurement raised {exc!r}; see raw/{key}.json")
                for skey, title, _ in builders
            ]
            durations[key] = time.perf_counter() - t0
            continue
        durations[key] = time.perf_counter() - t0
        for skey, title, build in builders:
            try:
                sections.append(build(data))
            except Exception as exc:
                say(f"{skey}: building the section failed: {exc!r}")
                sections.append(failed(skey, title, "", f"building the section raised {exc!r}"))
    sections += absent.all_absent()
    total = time.perf_counter() - t_start
    host_info.update(
        {
            "load average at start (1, 5, 15 min)": load_start,
            "load average at end (1, 5, 15 min)": _load_average(),
            "glibc malloc thresholds raised": malloc_tuned,
        }
    )
    write_json(
        os.path.join(raw_dir, "host.json"),
        {
            "host": host_info,
            "plan": asdict(plan),
            "command": command,
            "duration_s": total,
            "section_durations_s": durations,
            "section_start_load_average_1min": loads,
        },
    )
    meta = {
        "command": command,
        "mode": f"{plan.name} (expected about {plan.expected_minutes} min)",
        "started": host_info["date"],
        "duration (min)": round(total / 60, 1),
        "per measurement (s)": ", ".join(f"{k} {v:.0f}" for k, v in durations.items()),
        "1-minute load average as each started": ", ".join(f"{k} {v}" for k, v in loads.items()),
        "raw data": f"{RAW_DIR}/*.json beside this file; host and plan: {RAW_DIR}/host.json",
    }
    page = render_report(
        title="llmserve ablation report",
        meta=meta,
        host=host_info,
        sections=sections,
        draw=plots.svg,
    )
    path = write_report(out_dir, page)
    say(f"wrote {path} in {total / 60:.1f} min")
    return path
