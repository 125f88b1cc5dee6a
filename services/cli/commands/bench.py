"""``llmserve bench report``: run the ablation study on this host and write an HTML report with
its raw JSON (``loadtests/report/``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

# The report's measurement keys, repeated here so building the parser imports nothing heavy.
REPORT_SECTIONS = (
    "memory_ledger",
    "mix",
    "prefix_caching",
    "quantization",
    "serving_curve",
    "disaggregation",
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks of this host (the ablation report)",
        description="Benchmarks run on this host.",
    )
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    report = sub.add_parser(
        "report",
        help="run the ablation study and write a self-contained HTML report",
        description=(
            "Run the ablation study (paged KV, continuous batching, prefix caching, quantization, "
            "the memory ledger, the serving curve, prefill/decode disaggregation) on this host, "
            "each claim against its baseline in the same run, and write OUT/index.html with the "
            "raw JSON under OUT/raw/. The full run states its expected duration when it starts "
            "(under an hour on a quiet 2-core host); --quick finishes in minutes."
        ),
    )
    report.add_argument("--quick", action="store_true", help="small workloads (minutes)")
    report.add_argument(
        "--out", default="bench-report", help="output folder (default: %(default)s)"
    )
    report.add_argument(
        "--only",
        default="",
        help=f"comma-separated subset of the measurements: {', '.join(REPORT_SECTIONS)}",
    )
    report.set_defaults(func=run)
    return parser


def _report_runner():
    """``loadtests.report.runner``. ``loadtests/`` is not an installed package: it lives in the
    checkout beside ``services/``, which an editable install (``make install``) points at."""
    try:
        from loadtests.report import runner
    except ModuleNotFoundError as exc:
        if exc.name not in ("loadtests", "loadtests.report"):
            raise
        root = Path(__file__).resolve().parents[3]
        if not (root / "loadtests" / "report" / "runner.py").is_file():
            raise FileNotFoundError(
                "llmserve bench needs the repository's loadtests/ folder (run it from an "
                "editable install or a checkout)"
            ) from exc
        sys.path.insert(0, str(root))
        from loadtests.report import runner
    return runner


def run(args: argparse.Namespace) -> int:
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(REPORT_SECTIONS))
    if unknown:
        raise ValueError(f"--only: unknown {unknown}; known: {', '.join(REPORT_SECTIONS)}")
    runner = _report_runner()
    argv = ["llmserve", "bench", "report"] + (["--quick"] if args.quick else [])
    argv += ["--out", args.out] + (["--only", args.only] if only else [])
    runner.run_report(args.out, quick=args.quick, command=shlex.join(argv), only=only)
    return 0
