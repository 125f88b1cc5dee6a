"""``llmserve bench report``'s pure parts: the memory-ledger section's arithmetic against the
formula, the HTML writer (every figure and table links to its raw JSON), sections for features that
do not exist, the concurrency-at-fixed-memory arithmetic, and the section builders on small
synthetic raw JSON. No model, no engine, no stack."""

from __future__ import annotations

import pathlib
import re

import pytest

from loadtests import bench_disagg
from loadtests.report import absent, batching, disagg, ledger, paged_kv, prefix, serving
from loadtests.report.html import format_cell, render_report, write_report
from loadtests.report.model import ABSENT, MEASURED, Figure, Section, Series, Table
from loadtests.report.plan import FULL, QUICK
from shared.engine.models.known_configs import KNOWN_CONFIGS


def stub_draw(figure: Figure) -> str:
    return f"<svg data-title='{figure.title}'></svg>"


# ---- the memory ledger -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "layers", "kv_heads", "head_dim"),
    [("llama-3-8b", 32, 8, 128), ("llama-2-7b", 32, 32, 128), ("llama-3-70b", 80, 8, 128)],
)
def test_kv_bytes_per_token_is_the_formula(model, layers, kv_heads, head_dim):
    expected = 2 * layers * kv_heads * head_dim * 2  # K and V, bf16
    assert ledger.formula_bytes_per_token(KNOWN_CONFIGS[model], "bfloat16") == expected
    (row,) = ledger.model_rows([model], ["80GiB"], 4096)
    assert row["formula_bytes_per_token"] == row["ledger_bytes_per_token"] == expected


def test_published_kv_sizes():
    """The well-known figures: 128 KiB/token for Llama-3-8B (GQA), 512 KiB for Llama-2-7B, 320 KiB
    for Llama-3-70B, in bf16."""
    rows = {r["model"]: r for r in ledger.model_rows(ledger.MODELS, ["80GiB"], 4096)}
    assert rows["llama-3-8b"]["ledger_bytes_per_token"] == 128 * 1024
    assert rows["llama-2-7b"]["ledger_bytes_per_token"] == 512 * 1024
    assert rows["llama-3-70b"]["ledger_bytes_per_token"] == 320 * 1024


def test_tokens_that_fit_follow_the_formula_up_to_block_rounding():
    for row in ledger.model_rows(ledger.MODELS, ["24GiB", "80GiB", "160GiB"], 4096):
        for plan in row["plans"].values():
            if not plan["fits"]:
                continue
            # the ledger keeps whole 16-token blocks and gives up one as padding
            assert 0 <= plan["formula_kv_tokens"] - plan["num_kv_tokens"] < 2 * 16
            assert plan["max_concurrent_requests"] == plan["num_kv_tokens"] // 4096


def test_seventy_b_does_not_fit_in_80gib_but_fits_in_160gib():
    (row,) = ledger.model_rows(["llama-3-70b"], ["80GiB", "160GiB"], 4096)
    assert row["plans"]["80GiB"] == {"fits": False}
    assert row["plans"]["160GiB"]["fits"]


def test_ledger_section_reads_agreement_and_shows_misfits():
    section = ledger.build(ledger.measure(QUICK))
    assert section.status == MEASURED
    assert "equal the formula for every model" in section.reading
    assert "4x smaller" in section.reading  # Llama-2-7B's MHA vs Llama-3-8B's 8 KV heads
    cells = [c for t in section.tables for row in t.rows for c in row]
    assert "weights do not fit" in cells
    assert all(s == ledger.SOURCE for s in section.sources)


# ---- the section model and the HTML writer ----------------------------------------------------


def test_a_figure_needs_units_on_both_axes():
    with pytest.raises(ValueError, match="unit"):
        Figure("t", "x", "", "y", "ms", [Series("s", [1], [2])], source="raw/a.json")
    with pytest.raises(ValueError, match="source"):
        Figure("t", "x", "s", "y", "ms", [Series("s", [1], [2])], source="")


def test_a_measured_section_says_what_against_what_and_what_it_reads():
    with pytest.raises(ValueError, match="against what"):
        Section(key="k", title="t", claim="c", status=MEASURED, measured="m", reading="r")


def _section(key: str, source: str) -> Section:
    return Section(
        key=key,
        title=f"title {key}",
        claim="claim",
        status=MEASURED,
        measured="measured",
        baseline="baseline",
        reading="reading",
        tables=[Table("table", ["a (ms)", "b"], [[1.23456, "x"]], source=source)],
        figures=[
            Figure(
                f"fig {key}", "x", "tokens", "y", "ms", [Series("s", [1, 2], [3, 4])], source=source
            )
        ],
        commands=["python -m loadtests.something --flag"],
    )


def test_the_report_links_every_figure_and_table_to_its_json(tmp_path):
    sections = [_section("one", "raw/one.json"), _section("two", "raw/two.json")]
    sections += absent.all_absent()
    (tmp_path / "raw").mkdir()
    for name in ("one", "two", "host"):
        (tmp_path / "raw" / f"{name}.json").write_text("{}")
    page = render_report(
        title="report",
        meta={"command": "llmserve bench report --quick"},
        host={"cpu": "x"},
        sections=sections,
        draw=stub_draw,
    )
    path = write_report(str(tmp_path), page)
    text = pathlib.Path(path).read_text()
    figures = re.findall(r"<figure>.*?</figure>", text, flags=re.S)
    assert len(figures) == 2
    for fig in figures:
        (href,) = re.findall(r'href="([^"]+)"', fig)
        assert (tmp_path / href).is_file()
    tables = re.findall(r"<p><b>table</b>.*?</p>", text, flags=re.S)
    assert len(tables) == 2 and all('href="raw/' in t for t in tables)
    # every linked file exists beside the report
    for href in set(re.findall(r'href="(raw/[^"]+)"', text)):
        assert (tmp_path / href).is_file(), href
    assert "x = x (tokens), y = y (ms)" in text
    assert "llmserve bench report --quick" in text
    assert text.count("<section id=") == 4  # three sections + the host


def test_sections_that_do_not_exist_say_so_and_show_nothing():
    for section in absent.all_absent():
        assert section.status == ABSENT
        assert not section.tables and not section.figures and not section.sources
        assert section.reading.startswith("Not ")
    page = render_report(title="r", meta={}, host={}, sections=absent.all_absent(), draw=stub_draw)
    assert "Speculative decoding" in page and "not implemented" in page
    assert "<figure>" not in page
    with pytest.raises(ValueError, match="no numbers"):
        Section(
            key="k",
            title="t",
            claim="c",
            status=ABSENT,
            tables=[Table("t", ["a"], [[1]], source="raw/x.json")],
        )


def test_cells_are_formatted_readably():
    assert format_cell(1234567) == "1,234,567"
    assert format_cell(0.012345) == "0.01235"
    assert format_cell(10.0123) == "10.01"
    assert format_cell(12345.6) == "12,346"
    assert format_cell(None) == "—"
    assert format_cell(float("nan")) == "—"


# ---- paged KV: concurrency at fixed memory ---------------------------------------------------


def test_paged_concurrency_rounds_each_request_up_to_blocks():
    # footprints 20 and 40 tokens take 2 and 3 blocks of 16: 2+3+2+3 = 10 blocks for 4 requests
    assert paged_kv.paged_concurrency(10, [20, 40], 16) == 4
    assert paged_kv.paged_concurrency(9, [20, 40], 16) == 3
    assert paged_kv.paged_concurrency(1, [20], 16) == 0


def test_contiguous_concurrency_reserves_the_whole_maximum():
    assert paged_kv.contiguous_concurrency(8192 * 3 + 100, [8192]) == 3
    assert paged_kv.contiguous_concurrency(100, [60, 30]) == 2


def _mix_raw() -> dict:
    kv_stats = dict(
        util_step_mean=0.9,
        util_slot_weighted=0.9,
        util_min=0.8,
        util_at_peak_reserved=0.9,
        peak_reserved_slots=400,
        mean_reserved_slots=300,
    )
    kv = dict(
        num_steps=40,
        peak_live_tokens=370,
        mean_live_tokens=250,
        paged=kv_stats,
        contiguous={
            "max_model_len": dict(kv_stats, util_step_mean=0.01, mean_reserved_vs_paged=80.0)
        },
    )
    run = dict(
        output_tokens_per_s=5.0,
        elapsed_s=20.0,
        num_steps=40,
        mean_e2e_short_s=9.0,
        mean_e2e_long_s=19.0,
        output_tokens_per_cpu_s=12.0,
        kv=kv,
    )
    return dict(
        trace=dict(
            num_requests=4,
            short_tokens=8,
            long_tokens=32,
            num_long=1,
            prompt_len_range=[32, 64],
            batch_size=2,
            max_model_len=8192,
            block_size=16,
            prompt_lens=[32, 40, 50, 64],
            max_tokens=[8, 8, 32, 8],
            num_kv_blocks=2049,
        ),
        continuous=run,
        static=dict(run, output_tokens_per_s=2.5),
        static_padded=dict(run, output_tokens_per_s=4.0),
        throughput_ratio=2.0,
        cpu_throughput_ratio=1.9,
        padded_throughput_ratio=1.25,
        padded_cpu_throughput_ratio=1.3,
        command="python -m loadtests.bench_engine --skip-offline",
    )


def test_concurrency_at_fixed_memory_of_a_trace():
    conc = paged_kv.concurrency_at_fixed_memory(_mix_raw()["trace"])
    # 2048 usable blocks = 32768 tokens; max_model_len 8192 -> 4 requests
    assert conc["contiguous: max_model_len"] == 4
    # footprints 40, 48, 82, 72 tokens = 3 + 3 + 6 + 5 = 17 blocks per 4 requests
    assert conc["paged (blocks of the final length)"] == 4 * (2048 // 17) + 2


def test_mix_sections_read_their_json():
    raw = _mix_raw()
    b = batching.build(raw)
    assert b.status == MEASURED and "2.00x static" in b.reading
    p = paged_kv.build(raw)
    assert "90.0% utilized vs 1.0%" in p.reading
    assert b.sources == p.sources == ["raw/mix.json"]


# ---- prefix caching and the serving curve ----------------------------------------------------


def test_ideal_prefix_hit_is_whole_blocks():
    assert prefix.ideal_hit_tokens(100, 16) == 96
    assert prefix.ideal_hit_tokens(15, 16) == 0


def test_prefix_section_compares_on_and_off():
    def row(length, ttft, hit):
        return dict(
            prefix_len=length,
            prompt_len=length + 16,
            median_ttft_s=ttft,
            hit_rate=hit,
            ideal_hit_rate=hit,
        )

    raw = dict(
        suffix_len=16,
        requests_per_length=3,
        prefix_lens=[64, 256],
        runs={
            "on": {"rows": [row(64, 0.1, 0.5), row(256, 0.1, 0.9)]},
            "off": {"rows": [row(64, 0.2, 0.0), row(256, 0.4, 0.0)]},
        },
    )
    section = prefix.build(raw)
    assert "100 ms with caching vs 400 ms without (4.0x)" in section.reading
    assert len(section.figures) == 2


def test_serving_section_without_a_ceiling_says_why():
    def point(c, tps):
        lat = {"mean": 10.0, "median": 10.0, "p99": 20.0}
        return dict(
            concurrency=c,
            num_completed=4,
            output_throughput_tps=tps,
            request_throughput_rps=1.0,
            ttft_ms=lat,
            tpot_ms=lat,
            e2e_ms=lat,
        )

    raw = dict(
        input_len=64,
        output_len=16,
        requests_per_slot=2,
        commands=["x"],
        points=[point(1, 10.0), point(4, 30.0)],
        ceiling={"skipped": "no compiler"},
    )
    section = serving.build(raw)
    assert "3.00x one at a time" in section.reading and "no compiler" in section.reading
    assert not section.figures[0].hlines


def test_quick_plan_is_smaller_than_full():
    assert QUICK.expected_minutes < FULL.expected_minutes
    assert QUICK.expected_minutes < 10  # the issue's bound for --quick on 2 cores
    assert QUICK.mix_requests < FULL.mix_requests
    assert max(QUICK.concurrency) < max(FULL.concurrency)
    assert QUICK.disagg_streams < FULL.disagg_streams
    assert QUICK.disagg_num_long < FULL.disagg_num_long
    assert QUICK.disagg_long_len < FULL.disagg_long_len


def test_the_cli_parses_bench_report():
    from loadtests.report.runner import KEYS
    from services.cli.commands.bench import REPORT_SECTIONS
    from services.cli.main import build_parser, main

    args = build_parser().parse_args(["bench", "report", "--quick", "--out", "/tmp/x"])
    assert args.quick and args.out == "/tmp/x"
    assert main(["bench", "report", "--only", "nonsense"]) == 2
    assert list(REPORT_SECTIONS) == KEYS  # --only knows every measurement


def test_a_figure_draws_as_inline_svg_with_its_units():
    pytest.importorskip("matplotlib")
    from loadtests.report import plots

    figure = Figure(
        "throughput", "requests in flight", "requests", "output", "tokens/s",
        [Series("engine", [1, 2, 4], [10.0, 18.0, 30.0])], source="raw/x.json",
        hlines=[("ceiling", 50.0)], log_x=True,
    )  # fmt: skip
    svg = plots.svg(figure)
    assert svg.startswith("<svg") and "<?xml" not in svg
    assert "requests in flight (requests)" in svg and "output (tokens/s)" in svg


# ---- prefill/decode disaggregation -----------------------------------------------------------


def test_full_plan_runs_bench_disagg_at_its_defaults_and_quick_at_the_plans_sizes():
    defaults = bench_disagg.parse_args([])
    assert bench_disagg.parse_args(disagg.disagg_argv(FULL)) == defaults
    quick = bench_disagg.parse_args(disagg.disagg_argv(QUICK))
    assert (quick.streams, quick.long_len, quick.num_long) == (
        QUICK.disagg_streams,
        QUICK.disagg_long_len,
        QUICK.disagg_num_long,
    )
    assert quick.interval == QUICK.disagg_interval_s
    assert quick.long_output == QUICK.disagg_long_output


PAGE_BYTES_PER_TOKEN = 23040  # SmolLM2: 30 layers x K,V x 3 KV heads x 64 x 2 bytes


def _disagg_result(mode: str, itl_p99: float, ttft_p50: float, tok_s: float) -> dict:
    if mode == "disagg":
        executors = {
            "executor-0": {
                "llmserve:kv_transfers_total:sent": 2.0,
                "steps": 16.0,
                "step_ms_mean": 2000.0,
                "transfer_bytes": 2 * 1000 * PAGE_BYTES_PER_TOKEN,
                "transfer_s_mean": 0.25,
            },
            "executor-1": {"llmserve:kv_transfers_total:adopted": 2.0, "steps": 400.0},
        }
    else:
        executors = {"executor-0": {"steps": 300.0, "step_ms_mean": 70.0}, "executor-1": {}}
    return {
        "mode": mode,
        "window_s": 9.5,
        "stream_errors": [],
        "long_errors": [],
        "num_streams_ended_in_window": 0,
        "itl_ms": {"p50": 30.0, "p99": itl_p99, "max": itl_p99 * 2, "count": 900},
        "long_ttft_ms": {"p50": ttft_p50, "p99": ttft_p50 * 1.5},
        "output_tok_s": tok_s,
        "stream_tok_s": tok_s - 2.0,
        "executors": executors,
    }


def _disagg_raw() -> dict:
    """What ``disagg.measure`` writes, its summary computed by bench_disagg itself."""
    args = vars(bench_disagg.parse_args(disagg.disagg_argv(QUICK)))
    results = {
        "disagg": _disagg_result("disagg", 200.0, 15000.0, 150.0),
        "aggregated": _disagg_result("aggregated", 1000.0, 5000.0, 200.0),
    }
    return {
        "args": args,
        "results": results,
        "summary": bench_disagg.summarize(results, args["long_len"]),
        "plan": "quick",
        "command": "python -m loadtests.bench_disagg " + " ".join(disagg.disagg_argv(QUICK)),
    }


def test_disagg_summary_is_per_prompt_token_and_ratios():
    summary = _disagg_raw()["summary"]
    sent = summary["per_mode"]["disagg"]
    assert sent["kv_bytes_per_token"] == PAGE_BYTES_PER_TOKEN  # 2 transfers of 1,000 tokens
    assert sent["kv_transfer_ms_per_token"] == pytest.approx(0.25)  # 250 ms per 1,000 tokens
    moved = summary["per_mode"]["aggregated"]["kv_bytes_per_token"]
    assert moved != moved  # NaN: an aggregated stack moves no KV
    ratios = summary["disagg_vs_aggregated"]
    assert ratios["itl_p99_ratio"] == pytest.approx(0.2)
    assert ratios["ttft_p50_ratio"] == pytest.approx(3.0)
    assert ratios["throughput_ratio"] == pytest.approx(0.75)
    assert not ratios["target_met"]  # ITL met, throughput not


def test_disagg_section_reads_its_json_side_by_side():
    section = disagg.build(_disagg_raw())
    assert section.status == MEASURED
    assert "ITL p99 is 200 ms vs 1000 ms aggregated (0.20x)" in section.reading
    assert "TTFT p50 15,000 vs 5,000 ms (3.00x)" in section.reading
    assert "150.0 vs 200.0 tokens/s (0.75x)" in section.reading
    assert "23,040 bytes and 0.250 ms per prompt token" in section.reading
    assert "not met" in section.reading
    # the workload is stated: the quick plan's sizes
    assert "(quick plan: a reduced workload) 8 streams" in section.measured
    assert "2 prompts of 1,000 random tokens (no prefix hits) arrive 3 s apart" in section.measured
    assert section.sources == [disagg.SOURCE] == ["raw/disaggregation.json"]
    latency, transfer, executors = section.tables
    assert [row[0] for row in latency.rows] == [label for _, label in disagg.MODES]
    assert "ITL p99 (ms)" in latency.columns and "long TTFT p99 (ms)" in latency.columns
    assert transfer.rows[0][1:] == [PAGE_BYTES_PER_TOKEN, pytest.approx(0.25)]
    assert len(executors.rows) == 4  # two per stack
    side_by_side, throughput = section.figures
    assert side_by_side.y_unit == "ms" and side_by_side.log_y
    assert [s.ys[1] for s in side_by_side.series] == [200.0, 1000.0]  # ITL p99
    assert [s.ys[2] for s in side_by_side.series] == [15000.0, 5000.0]  # TTFT p50
    assert throughput.y_unit == "tokens/s"
    assert section.commands == [_disagg_raw()["command"]]


def test_disagg_floor_bounds_the_split_against_the_aggregated_p99():
    raw = _disagg_raw()
    raw["decode_floor"] = {
        "cpus": [1],
        "contexts": [40, 400],
        "step_ms": {"p50": 80.0, "p99": 90.0, "min": 60.0, "count": 360},
    }
    raw["summary"] = bench_disagg.summarize(
        raw["results"], raw["args"]["long_len"], raw["decode_floor"]
    )
    ratios = raw["summary"]["disagg_vs_aggregated"]
    assert ratios["floor_itl_p99_ratio"] == pytest.approx(0.09)  # 90 ms against 1,000 aggregated
    assert ratios["floor_fastest_step_ratio"] == pytest.approx(0.06)
    reading = disagg.build(raw).reading
    assert "(8 streams, contexts 40-400) steps in 80 ms p50, 90 ms p99, 60 ms" in reading
    assert "cannot fall below 0.09x the aggregated one here (0.06x at the fastest step)" in reading
    assert "decode executor" not in disagg.build(_disagg_raw()).reading  # no floor, no sentence


def test_disagg_section_notes_errors_and_short_streams():
    raw = _disagg_raw()
    raw["results"]["aggregated"]["long_errors"] = ["502: executor lost"]
    raw["results"]["disagg"]["num_streams_ended_in_window"] = 3
    notes = " ".join(disagg.build(raw).notes)
    assert "aggregated: errors" in notes and "502" in notes
    assert "disagg: 3 stream(s) ended inside the window" in notes


def test_disagg_figures_draw():
    pytest.importorskip("matplotlib")
    from loadtests.report import plots

    for figure in disagg.build(_disagg_raw()).figures:
        svg = plots.svg(figure)
        assert svg.startswith("<svg") and f"({figure.y_unit})" in svg
