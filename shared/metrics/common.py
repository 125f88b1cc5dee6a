"""Metric definitions more than one service keeps, so each declares them the same way."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

# vLLM's buckets, so dashboards built for it read ours the same way.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
# inter-token latency and time per output token
TOKEN_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# e2e request latency and queue time
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

# A NATS request/reply on one host takes ~0.1-1 ms; seconds mean a slow or overloaded responder.
ROUND_TRIP_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)


def round_trip_histogram(registry: CollectorRegistry) -> Histogram:
    """``llmserve:nats_round_trip_seconds{subject}``: request sent → reply received, of a
    request/reply the service makes anyway (``subject``: the subject's name without its prefix and
    ids, e.g. 'prefix_index.match', 'executor.decode': bounded cardinality)."""
    return Histogram(
        "llmserve:nats_round_trip_seconds",
        "Round trip of a NATS request/reply, by subject.",
        ["subject"],
        buckets=ROUND_TRIP_BUCKETS,
        registry=registry,
    )
