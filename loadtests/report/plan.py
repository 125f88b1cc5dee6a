"""The sizes each section runs at: ``--quick`` (a smoke run of the whole study, minutes on a
2-core host) and full (the sizes the loadtests use by default). Pure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    name: str
    # Rough wall time on a quiet 2-core host (loading the model, once per engine, dominates a
    # quick run): stated up front so a full run is not started by accident.
    expected_minutes: int
    threads: int = 2
    # continuous vs static batching and paged KV: bench_engine (b)/(c)
    mix_requests: int = 32
    mix_batch: int = 8
    mix_prompt_len: tuple[int, int] = (32, 256)
    mix_short: int = 16
    mix_long: int = 256
    # prefix caching: shared-prefix lengths, requests timed per length, each request's own suffix
    prefix_lens: tuple[int, ...] = (64, 128, 256, 512, 1024)
    prefix_requests: int = 5
    prefix_suffix_len: int = 32
    # quantization: teacher-forced tokens scored; offline decode workload per configuration
    quality_tokens: int = 1500
    quality_unsmoothed: bool = True
    quant_prompts: int = 16
    quant_prompt_len: tuple[int, int] = (64, 256)
    quant_output_len: int = 64
    quant_combined: bool = True  # also int8 weights with an int8 KV cache (one more engine load)
    quant_repeats: int = 2  # each configuration timed this often on its engine, best kept
    # the serving curve: concurrency levels, requests per level (x concurrency), lengths
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    requests_per_slot: int = 3
    serving_input_len: int = 128
    serving_output_len: int = 64
    # the memory ledger: budgets (bytes strings) and the context it plans for
    ledger_memory: tuple[str, ...] = ("24GiB", "80GiB", "160GiB")
    ledger_context: int = 4096
    # prefill/decode disaggregation: bench_disagg's workload (full: its defaults, two stacks of
    # two single-core executors); streams decode throughout, long prompts arrive among them
    disagg_streams: int = 16
    disagg_long_len: int = 2000
    disagg_num_long: int = 4
    disagg_interval_s: float = 4.0
    disagg_long_output: int = 16


FULL = Plan(name="full", expected_minutes=6)

QUICK = Plan(
    name="quick",
    expected_minutes=3,
    mix_requests=8,
    mix_batch=4,
    mix_prompt_len=(16, 64),
    mix_short=4,
    mix_long=16,
    prefix_lens=(32, 128, 384),
    prefix_requests=3,
    prefix_suffix_len=16,
    quality_tokens=192,
    quality_unsmoothed=False,
    quant_prompts=8,
    quant_prompt_len=(32, 128),
    quant_output_len=32,
    quant_combined=False,
    concurrency=(1, 2, 4),
    requests_per_slot=2,
    serving_input_len=64,
    serving_output_len=32,
    # two 1,000-token prompts among 8 streams: each prefill still spans many of the streams'
    # decode steps; the two stacks' starts (model loads) take most of this section's time
    disagg_streams=8,
    disagg_long_len=1000,
    disagg_num_long=2,
    disagg_interval_s=3.0,
    disagg_long_output=8,
)


def plan_for(quick: bool) -> Plan:
    return QUICK if quick else FULL
