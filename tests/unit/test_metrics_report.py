"""The cross-process metrics, synchronously: a registry to a MetricsReport and back (histograms of
several replicas stay exact), the report book (stale replicas drop out), the executor's and the
gateway's metrics, and the Grafana dashboard against what the stack exports."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from helpers.stats import engine_stats
from services.executor.metrics import ExecutorMetrics
from services.gateway.metrics import GatewayMetrics
from services.prefix_index.logic import Counters
from services.prefix_index.metrics import IndexMetrics
from shared.metrics.book import ReportBook
from shared.metrics.common import round_trip_histogram
from shared.metrics.names import REQUIRED_METRICS
from shared.metrics.publisher import report_of
from shared.metrics.report import export_families
from shared.wire.messages import METRICS_REPORT, MetricsReport

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "compose/grafana/llmserve-dashboard.json"


def _exposition(reports: list[MetricsReport]) -> str:
    class Collector:
        def collect(self):
            return export_families(reports)

    registry = CollectorRegistry()
    registry.register(Collector())
    return generate_latest(registry).decode()


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _replica(name: str, observations: list[float], count: int) -> MetricsReport:
    registry = CollectorRegistry()
    h = Histogram("llmserve:x_seconds", "x", buckets=(0.1, 1.0), registry=registry)
    for v in observations:
        h.observe(v)
    Counter("llmserve:things", "things", registry=registry).inc(count)
    Gauge("llmserve:level", "level", ["executor"], registry=registry).labels(name).set(0.5)
    # Through the wire codec, as a gateway gets it.
    return METRICS_REPORT.decode(METRICS_REPORT.encode(report_of("executor", name, registry)))


def test_reports_of_two_replicas_reexport_exactly_with_service_and_replica_labels():
    a = _replica("e0", [0.05, 0.5, 5.0], 3)
    b = _replica("e1", [0.05], 1)
    text = _exposition([a, b])
    samples = _samples(text)

    def value(name: str, replica: str, **labels: str) -> float:
        key = frozenset({"service": "executor", "replica": replica, **labels}.items())
        return samples[(name, key)]

    assert value("llmserve:x_seconds_bucket", "e0", le="0.1") == 1
    assert value("llmserve:x_seconds_bucket", "e0", le="1.0") == 2
    assert value("llmserve:x_seconds_bucket", "e0", le="+Inf") == 3
    assert value("llmserve:x_seconds_count", "e0") == 3
    assert value("llmserve:x_seconds_sum", "e0") == pytest.approx(5.55)
    assert value("llmserve:x_seconds_count", "e1") == 1
    assert value("llmserve:things_total", "e0") == 3 and value("llmserve:things_total", "e1") == 1
    # A service's own labels are kept beside ours.
    assert value("llmserve:level", "e1", executor="e1") == 0.5
    # One family per name (one TYPE line each), no _created samples.
    assert text.count("# TYPE llmserve:x_seconds histogram") == 1
    assert "_created" not in text


def test_a_family_whose_type_differs_from_the_first_report_is_left_out():
    a = _replica("e0", [0.05], 1)
    registry = CollectorRegistry()
    Gauge("llmserve:things", "now a gauge", registry=registry).set(7)
    b = report_of("executor", "e1", registry)
    text = _exposition([a, b])
    assert 'llmserve:things_total{replica="e0",service="executor"} 1.0' in text
    assert 'replica="e1"' not in text


def test_report_book_keeps_the_newest_report_and_drops_silent_replicas():
    book = ReportBook(stale_after_s=5.0)
    old = MetricsReport(service="executor", instance="e0", sent_at=10.0, families=[])
    new = MetricsReport(service="executor", instance="e0", sent_at=11.0, families=[])
    other = MetricsReport(service="tokenizer", instance="t0", sent_at=10.0, families=[])
    book.put(new, now=100.0)
    book.put(old, now=100.5)  # delivered late: does not replace the newer one
    book.put(other, now=103.0)
    assert book.live(now=104.0) == [new, other]
    assert book.live(now=104.0, exclude=("tokenizer", "t0")) == [new]
    assert book.live(now=106.0) == [other]  # e0 silent for 6 s: gone
    assert book.live(now=200.0) == []
    with pytest.raises(ValueError):
        ReportBook(stale_after_s=0)


def test_executor_metrics_follow_the_engine_stats_and_observe_batches():
    stats = engine_stats(
        num_running=2,
        num_waiting=1,
        kv_cache_usage=0.25,
        prefix_cache_queries_tokens=64,
        prefix_cache_hits_tokens=32,
        num_preemptions=3,
        spec_num_drafts=5,
        spec_num_draft_tokens=20,
        spec_num_accepted_tokens=12,
    )
    m = ExecutorMetrics("executor-0", "m", lambda: stats)
    m.on_step(0.02, engine_stats(last_step_num_tokens=40, last_step_num_seqs=3))
    m.on_step(0.01, engine_stats(last_step_num_tokens=0))  # nothing ran: not observed
    m.on_first_scheduled(0.7)
    m.on_first_scheduled(-0.1)  # clock skew: counts as 0
    samples = _samples(generate_latest(m.registry).decode())
    labels = frozenset({"executor": "executor-0", "model_name": "m"}.items())

    def value(name: str, **extra: str) -> float:
        return samples[(name, labels | frozenset(extra.items()))]

    assert value("llmserve:num_requests_running") == 2
    assert value("llmserve:num_requests_waiting") == 1
    assert value("llmserve:kv_cache_usage_perc") == 0.25
    assert value("llmserve:prefix_cache_queries_total") == 64
    assert value("llmserve:prefix_cache_hits_total") == 32
    assert value("llmserve:num_preemptions_total") == 3
    assert value("llmserve:spec_decode_num_drafts_total") == 5
    assert value("llmserve:spec_decode_num_draft_tokens_total") == 20
    assert value("llmserve:spec_decode_num_accepted_tokens_total") == 12
    assert value("llmserve:engine_step_seconds_count") == 1
    assert value("llmserve:engine_step_seconds_sum") == pytest.approx(0.02)
    assert value("llmserve:engine_batch_size_sum") == 3
    assert value("llmserve:iteration_tokens_total_sum") == 40
    assert value("llmserve:request_queue_time_seconds_count") == 2
    assert value("llmserve:request_queue_time_seconds_sum") == pytest.approx(0.7)
    assert value("llmserve:request_queue_time_seconds_bucket", le="0.3") == 1


def test_gateway_tpot_is_vllms_definition_and_skips_single_token_requests():
    m = GatewayMetrics(instance="gateway-test")
    t = m.tracker("completions")
    t._start -= 1.0  # arrived a second ago
    t.on_tokens(1)
    assert t._first_token_at is not None
    t._first_token_at -= 0.5  # first token half a second ago
    t.on_tokens(2)
    t.on_tokens(2)
    t.done(200, num_prompt_tokens=7)
    single = m.tracker("completions")
    single.on_tokens(1)
    single.done(200, num_prompt_tokens=7)
    samples = _samples(generate_latest(m.exposition).decode())
    own = frozenset({"service": "gateway", "replica": "gateway-test"}.items())
    assert samples[("llmserve:time_per_output_token_seconds_count", own)] == 1
    # (e2e - ttft) / (5 tokens - 1): ~0.5 s over 4.
    tpot = samples[("llmserve:time_per_output_token_seconds_sum", own)]
    assert 0.5 / 4 <= tpot < 0.6 / 4
    assert samples[("llmserve:time_to_first_token_seconds_count", own)] == 2
    assert samples[("llmserve:generation_tokens_total", own)] == 6
    assert samples[("llmserve:prompt_tokens_total", own)] == 14


def _exported_names() -> set[str]:
    """Every metric name the services declare, as /metrics shows it (counters with _total)."""
    registries = [
        GatewayMetrics(instance="gateway-test").registry,
        ExecutorMetrics("executor-0", "m", lambda: engine_stats()).registry,
        IndexMetrics(Counters()).registry,
    ]
    rt = CollectorRegistry()
    round_trip_histogram(rt)
    registries.append(rt)
    names = set()
    for registry in registries:
        for family in registry.collect():
            names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def _dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    found = set()
    for expr in exprs:
        for name in re.findall(r"llmserve:[a-z0-9_]+", expr):
            found.add(re.sub(r"_(bucket|sum|count)$", "", name))
    return found


def test_the_required_metrics_are_exported():
    assert set(REQUIRED_METRICS) <= _exported_names()


def test_dashboard_is_valid_and_queries_exactly_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    [datasource] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert datasource["query"] == "prometheus"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${" + datasource["name"] + "}"
        assert panel["targets"]
    queried = _dashboard_metrics()
    assert queried <= _exported_names(), queried - _exported_names()
    assert set(REQUIRED_METRICS) <= queried, set(REQUIRED_METRICS) - queried
