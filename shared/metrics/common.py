"""Metric definitions more than one service keeps, so each declares them the same way."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

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
