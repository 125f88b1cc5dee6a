"""The scheduler's routing state and the prefix index's size and apply lag, from their status
replies, on the gateway's /metrics (every service's own metrics, executors' included, come in
their MetricsReports instead: metrics.py). Fetched at scrape time
(``Gateway.refresh_stack_metrics``); a service that does not answer leaves its metrics out of that
scrape instead of failing it.

These are those of the replica that answered (one per scrape, queue group).
Counters that a service keeps (prefix-cache tokens, fallbacks) are exported as counters with the
service's own cumulative value; they restart at 0 when that process restarts, as Prometheus
counters may.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shared.wire.messages import PrefixIndexStatus, SchedulerStatus


class StackMetrics:
    """Yields whatever the last refresh brought (metrics.py collects it with the rest)."""

    def __init__(self) -> None:
        self.scheduler: SchedulerStatus | None = None
        self.index: PrefixIndexStatus | None = None

    def update(self, scheduler: SchedulerStatus | None, index: PrefixIndexStatus | None) -> None:
        self.scheduler, self.index = scheduler, index

    def collect(self) -> Iterator[Metric]:
        if self.scheduler is not None:
            yield from _routing_metrics(self.scheduler)
        if self.index is not None:
            yield from _index_metrics(self.index)


def _routing_metrics(status: SchedulerStatus) -> Iterator[Metric]:
    available = GaugeMetricFamily(
        "llmserve:routing_index_available",
        "1 while the scheduler gets answers from the prefix index, 0 while it routes by load "
        "alone.",
    )
    available.add_metric([], 1.0 if status.index_available else 0.0)
    fallbacks = CounterMetricFamily(
        "llmserve:routing_index_fallbacks",
        "Requests routed without the prefix index's answer because it was unavailable.",
    )
    fallbacks.add_metric([], status.num_index_fallbacks)
    refused = CounterMetricFamily(
        "llmserve:routing_refused_dispatches",
        "Dispatches an executor refused as full (the request was placed again).",
    )
    refused.add_metric([], status.num_refused_dispatches)
    queued = GaugeMetricFamily(
        "llmserve:scheduler_queue_length", "Requests waiting in the scheduler for an executor."
    )
    queued.add_metric([], status.num_queued)
    yield from (available, fallbacks, refused, queued)


def _index_metrics(status: PrefixIndexStatus) -> Iterator[Metric]:
    gauges = [
        ("llmserve:prefix_index_up", "1 while the prefix index reaches Redis.", status.redis_ok),
        (
            "llmserve:prefix_index_executors",
            "Executors with entries in the prefix index.",
            status.num_executors,
        ),
        (
            "llmserve:prefix_index_block_entries",
            "(block hash, executor) entries in the prefix index.",
            status.num_block_entries,
        ),
        (
            "llmserve:prefix_index_apply_lag_seconds",
            "From an executor's publish of a KV event batch to its application, of the last one.",
            status.last_apply_lag_s,
        ),
    ]
    for name, doc, value in gauges:
        gauge = GaugeMetricFamily(name, doc)
        gauge.add_metric([], float(value))
        yield gauge
    counters = [
        ("llmserve:prefix_index_batches_applied", "KV event batches applied.", "applied"),
        ("llmserve:prefix_index_replays", "KV event batches found already applied.", "replays"),
        ("llmserve:prefix_index_resyncs", "Executor snapshots installed after a gap.", "resyncs"),
        ("llmserve:prefix_index_purges", "Executors purged from the index.", "purges"),
    ]
    values = {
        "applied": status.num_batches_applied,
        "replays": status.num_replays,
        "resyncs": status.num_resyncs,
        "purges": status.num_purges,
    }
    for name, doc, key in counters:
        counter = CounterMetricFamily(name, doc)
        counter.add_metric([], values[key])
        yield counter
