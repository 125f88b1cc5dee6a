"""The stack's /metrics under a small load, the whole stack with the real SmolLM2 and a KV pool of
15 usable blocks: every metric a vLLM user graphs is there, from every service, and moves as it
should (prefix-cache hits on a repeated prefix, KV usage while a request holds blocks, preemptions
when the pool is overcommitted, token counters equal to the usage the clients were told, one
TTFT/TPOT observation per request, nothing running afterwards)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from e2e_harness import wait_for
from prometheus_client.parser import text_string_to_metric_families

from shared.metrics.names import REQUIRED_METRICS

MODEL = "SmolLM2-135M-Instruct"


def scrape(base_url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of /metrics by name."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def total(
    samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float:
    return sum(
        v for got, v in samples.get(name, []) if all(got.get(k) == x for k, x in labels.items())
    )


def complete(base_url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    r = httpx.post(
        base_url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_metrics_of_every_service_move_under_load(stack):
    s = stack(num_kv_blocks=16, max_num_seqs=8)
    url = s.base_url
    wait_for(lambda: "llmserve:kv_cache_usage_perc" in scrape(url), 30, "the executor's report")
    before = scrape(url)
    kv_baseline = total(before, "llmserve:kv_cache_usage_perc")
    usages: list[dict[str, Any]] = []

    # A long request holds blocks: KV usage rises above its baseline while it runs, and back after.
    with ThreadPoolExecutor(4) as pool:
        long = pool.submit(complete, url, "Count slowly from one to a hundred:", 120)
        wait_for(
            lambda: total(scrape(url), "llmserve:kv_cache_usage_perc") > kv_baseline,
            60,
            "KV usage above its baseline while a request runs",
            interval=0.1,
        )
        usages.append(long.result()["usage"])
    wait_for(
        lambda: total(scrape(url), "llmserve:kv_cache_usage_perc") == kv_baseline,
        10,
        "KV usage back to its baseline",
    )

    # A repeated prompt (several full blocks) hits the prefix cache the second time.
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    usages.append(complete(url, prompt, 4)["usage"])
    hits = total(scrape(url), "llmserve:prefix_cache_hits_total")
    usages.append(complete(url, prompt, 4)["usage"])
    assert usages[-1]["prompt_tokens_details"]["cached_tokens"] > 0
    wait_for(
        lambda: total(scrape(url), "llmserve:prefix_cache_hits_total") > hits,
        10,
        "prefix-cache hits to rise",
    )

    # Four requests of 7 blocks each overcommit 15 blocks: the engine preempts.
    with ThreadPoolExecutor(4) as pool:
        prompts = [f"Write a story about robot number {i}." for i in range(4)]
        usages += [
            f.result()["usage"] for f in [pool.submit(complete, url, p, 90) for p in prompts]
        ]
    wait_for(
        lambda: total(scrape(url), "llmserve:num_preemptions_total") > 0, 10, "preemptions counted"
    )

    # Afterwards: nothing running, and the counters add up to exactly what the clients were told.
    wait_for(
        lambda: total(scrape(url), "llmserve:num_requests_running") == 0, 10, "nothing running"
    )
    after = scrape(url)
    gw = {"service": "gateway"}
    assert total(after, "llmserve:prompt_tokens_total", **gw) - total(
        before, "llmserve:prompt_tokens_total", **gw
    ) == sum(u["prompt_tokens"] for u in usages)
    assert total(after, "llmserve:generation_tokens_total", **gw) - total(
        before, "llmserve:generation_tokens_total", **gw
    ) == sum(u["completion_tokens"] for u in usages)
    for name in (
        "llmserve:time_to_first_token_seconds_count",
        "llmserve:time_per_output_token_seconds_count",
        "llmserve:e2e_request_latency_seconds_count",
    ):
        assert total(after, name) - total(before, name) == len(usages), name
    # Queue time: one observation per request, at the executor (its report may lag one interval).
    wait_for(
        lambda: (
            total(scrape(url), "llmserve:request_queue_time_seconds_count")
            - total(before, "llmserve:request_queue_time_seconds_count")
            == len(usages)
        ),
        10,
        "a queue time per request",
    )

    # Every required metric is exported; the per-service ones labelled by where they come from.
    after = scrape(url)
    services = {labels.get("service") for samples in after.values() for labels, _ in samples}
    assert {"executor", "gateway", "prefix_index", "scheduler", "tokenizer"} <= services
    present = {
        name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for name in after
    }
    assert set(REQUIRED_METRICS) <= present, set(REQUIRED_METRICS) - present
    round_trips = {
        (labels["service"], labels["subject"])
        for labels, _ in after["llmserve:nats_round_trip_seconds_count"]
    }
    assert {
        ("gateway", "tokenizer.generate"),
        ("tokenizer", "scheduler.submit"),
        ("scheduler", "executor.decode"),
    } <= round_trips
    [(labels, _)] = after["llmserve:kv_cache_usage_perc"]
    assert labels["executor"] == "executor-0" and labels["model_name"] == MODEL
    assert total(after, "llmserve:engine_step_seconds_count") > 0
    assert total(after, "llmserve:kv_events_apply_lag_seconds_count") > 0
