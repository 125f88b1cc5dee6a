"""The prefix index replica's metrics, published as its MetricsReport (shared/metrics): its apply
counters (this replica's, so with several replicas each is its own series) and
``kv_events_apply_lag_seconds``, a histogram of publish (the KV event batch's JetStream timestamp,
the executor's clock) → applied in Redis, per batch applied. The status reply keeps the last lag
alone (``prefix_index_apply_lag_seconds``)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from services.prefix_index.logic import Counters

_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class IndexMetrics:
    def __init__(self, counters: Counters) -> None:
        self.registry = CollectorRegistry()
        self._counters = counters
        self.apply_lag = Histogram(
            "llmserve:kv_events_apply_lag_seconds",
            "From an executor's publish of a KV event batch to its application in Redis.",
            buckets=_LAG_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        c = self._counters
        for name, doc, value in (
            (
                "llmserve:kv_events_batches_applied",
                "KV event batches applied.",
                c.num_batches_applied,
            ),
            (
                "llmserve:kv_events_replays",
                "KV event batches found already applied.",
                c.num_replays,
            ),
            (
                "llmserve:kv_events_resyncs",
                "Executor snapshots installed after a gap.",
                c.num_resyncs,
            ),
        ):
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], float(value))
            yield counter
