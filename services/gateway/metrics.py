"""Prometheus metrics of the gateway, under the ``llmserve:`` prefix with vLLM's names where they
apply at the API edge, and the exposition of the whole stack's on /metrics.

One registry per app (not the process-global one), so several apps can live in one test process.
That registry is published to the other gateways like any service's (shared/metrics), and
/metrics serves, from ``exposition``: this gateway's registry and the latest report of every live
instance of every service (gateways included), each sample labelled ``service`` and ``replica``,
plus the scheduler's and the prefix index's status (stack_metrics.py). Every gateway thus serves
the same stack-wide series: scrape any one of them (or each, and aggregate by ``replica``).

Latencies are measured here, at the edge, from the moment the request body is parsed:
TTFT = first output carrying tokens, ITL = between consecutive token-carrying outputs,
E2E = until the last output, TPOT = (E2E - TTFT) / (tokens - 1) per successful request with at
least two tokens (vLLM's definition; tokens of every choice when n > 1). Prompt and generation
tokens are the usage the client is told. ``status`` labels: the HTTP status the client got, or the
status of the SSE error event; 499 (nginx's convention) when the client went away first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric

from shared.metrics.book import ReportBook
from shared.metrics.common import (
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    round_trip_histogram,
)
from shared.metrics.publisher import new_instance_id, report_of
from shared.metrics.report import export_families
from shared.wire.messages import METRICS_STALE_AFTER_S, MetricsReport

from .request_log import RequestRecord
from .stack_metrics import StackMetrics

CLIENT_CLOSED = 499


class GatewayMetrics:
    def __init__(self, instance: str | None = None) -> None:
        self.instance = instance or new_instance_id("gateway")
        self.registry = CollectorRegistry()
        r = self.registry
        labels: list[str] = []  # one served model per gateway: no model label
        self.requests = Counter(
            "llmserve:gateway_requests",
            "Requests by endpoint and final status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "llmserve:gateway_requests_in_flight",
            "Generation requests the gateway is waiting on.",
            labels,
            registry=r,
        )
        self.request_success = Counter(
            "llmserve:request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "llmserve:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "llmserve:inter_token_latency_seconds",
            "Time between consecutive token-carrying outputs.",
            labels,
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "llmserve:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "llmserve:time_per_output_token_seconds",
            "Time per output token after the first: (e2e - ttft) / (tokens - 1).",
            labels,
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.round_trip = round_trip_histogram(r)
        self.prompt_tokens = Counter(
            "llmserve:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "llmserve:generation_tokens", "Generated tokens.", labels, registry=r
        )
        # Per API key, labelled by the key's name (never the key).
        self.api_key_requests = Counter(
            "llmserve:api_key_requests",
            "Generation requests admitted, by API key name.",
            ["key_name"],
            registry=r,
        )
        self.api_key_rejected = Counter(
            "llmserve:api_key_rejected",
            "Generation requests refused by a per-key limit, by API key name and limit.",
            ["key_name", "limit"],
            registry=r,
        )
        self.api_key_tokens_reserved = Counter(
            "llmserve:api_key_tokens_reserved",
            "Tokens reserved at admission (prompt estimate + max_tokens x n), by API key name.",
            ["key_name"],
            registry=r,
        )
        self.api_key_tokens_refunded = Counter(
            "llmserve:api_key_tokens_refunded",
            "Reserved tokens given back when a request ended having used fewer, by API key name.",
            ["key_name"],
            registry=r,
        )
        self.api_key_limiter_unavailable = Counter(
            "llmserve:api_key_limiter_unavailable",
            "Requests admitted unchecked because Redis (per-key limits) was unreachable.",
            registry=r,
        )
        # The other instances' reports (a bus subscription fills it) and the services' status.
        self.book = ReportBook(METRICS_STALE_AFTER_S)
        self.stack = StackMetrics()
        self.exposition = CollectorRegistry()
        self.exposition.register(_Exposition(self))

    def own_report(self) -> MetricsReport:
        return report_of("gateway", self.instance, self.registry)

    def receive(self, report: MetricsReport) -> None:
        self.book.put(report, time.monotonic())

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def tracker(
        self, endpoint: str, on_done: Callable[[int, int], None] | None = None
    ) -> RequestTracker:
        return RequestTracker(self, endpoint, on_done)


class RequestTracker:
    """Timing of one generation request; ``done`` records it exactly once."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        endpoint: str,
        on_done: Callable[[int, int], None] | None = None,
    ) -> None:
        # Called once, by done(), with (prompt tokens, 0 when unknown; generated tokens): gives
        # back what the request held of its key's limits.
        self._on_done = on_done
        self._m = metrics
        self._endpoint = endpoint
        self._start = time.monotonic()
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._num_generated_tokens = 0
        self._done = False
        # The console's record of this request (request_log.py), when the gateway keeps one.
        self.record: RequestRecord | None = None
        metrics.in_flight.inc()

    @property
    def started(self) -> float:
        """When the request began (monotonic): TTFT and E2E count from here."""
        return self._start

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self.record is not None:
            self.record.on_tokens(num_tokens, now)
        if self._last_token_at is None:
            self._first_token_at = now
            self._m.ttft.observe(now - self._start)
        else:
            self._m.itl.observe(now - self._last_token_at)
        self._last_token_at = now
        self._num_generated_tokens += num_tokens
        self._m.generation_tokens.inc(num_tokens)

    def done(
        self,
        status: int,
        *,
        num_prompt_tokens: int = 0,
        finish_reasons: list[str | None] | None = None,
    ) -> None:
        if self._done:
            return
        self._done = True
        if self.record is not None:
            self.record.done(status, time.monotonic(), num_prompt_tokens, finish_reasons)
        if self._on_done is not None:
            self._on_done(num_prompt_tokens, self._num_generated_tokens)
        m = self._m
        m.in_flight.dec()
        m.count(self._endpoint, status)
        if status == 200:
            now = time.monotonic()
            m.e2e.observe(now - self._start)
            if self._first_token_at is not None and self._num_generated_tokens > 1:
                m.tpot.observe((now - self._first_token_at) / (self._num_generated_tokens - 1))
            m.prompt_tokens.inc(num_prompt_tokens)
            for reason in finish_reasons or []:
                m.request_success.labels(reason or "unknown").inc()


class _Exposition:
    """What /metrics serves: this gateway's registry as a report of its own (fresh at every
    scrape; within each family its samples come first), the live reports of every other instance,
    and the stack's status metrics."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        others = m.book.live(time.monotonic(), exclude=("gateway", m.instance))
        yield from export_families([m.own_report(), *others])
        yield from m.stack.collect()
