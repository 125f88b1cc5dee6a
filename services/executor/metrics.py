"""The executor's metrics, under vLLM's names where vLLM has one (labels ``executor``,
``model_name``); published as MetricsReports for the gateways' /metrics (shared/metrics).

From the engine's latest stats, read at collection: ``num_requests_running`` /
``num_requests_waiting`` (sequences in the engine's batch / queue), ``kv_cache_usage_perc``
(0..1, used / usable blocks, as vLLM), ``num_free_kv_blocks``, and the counters
``prefix_cache_queries`` / ``prefix_cache_hits`` (prompt tokens looked up / found) and
``num_preemptions`` (the engine's cumulative values), and speculative decoding's
``spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens`` (sequence steps that
carried proposals, proposals run, proposals accepted).

Observed by the engine thread (prometheus-client histograms are thread-safe), per step that ran a
batch: ``engine_step_seconds`` (wall time of one step: schedule, forward, sample, detokenize),
``engine_batch_size`` (sequences in it), ``iteration_tokens_total`` (tokens in it: vLLM's name and
meaning, so its panels carry over); per request, once, ``request_queue_time_seconds``: from the
gateway's arrival stamp to the engine's first step that runs it, so it spans the tokenizer, the
scheduler's queue and the executor's own wait (wall clocks of two processes: on two hosts their
skew is in it; a negative value counts as 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shared.metrics.common import REQUEST_LATENCY_BUCKETS
from shared.wire.kv_transport import TransferStats
from shared.wire.outputs import EngineStats

LABELS = ["executor", "model_name"]

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# vLLM's buckets for iteration_tokens_total (request_queue_time_seconds: REQUEST_LATENCY_BUCKETS).
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ExecutorMetrics:
    """``stats``: the engine's latest stats (called at every collection, from the event loop)."""

    def __init__(self, executor_id: str, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self._labels = [executor_id, model_name]
        self._stats = stats
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r)

        self.step_seconds = histogram(
            "llmserve:engine_step_seconds", "Wall time of one engine step.", _STEP_BUCKETS
        ).labels(*self._labels)
        self.batch_size = histogram(
            "llmserve:engine_batch_size", "Sequences in one engine step's batch.", _BATCH_BUCKETS
        ).labels(*self._labels)
        self.iteration_tokens = histogram(
            "llmserve:iteration_tokens_total", "Tokens in one engine step.", _TOKEN_BUCKETS
        ).labels(*self._labels)
        self.queue_time = histogram(
            "llmserve:request_queue_time_seconds",
            "From the gateway's arrival to the engine's first step that runs the request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*self._labels)
        self._kv_transfers = Counter(
            "llmserve:kv_transfers",
            "KV handoffs by outcome: sent, peer_gone, timeout, refused (prefill side); received, "
            "expired, cancelled (by the prefill side or an abort), bad_chunk (decode side).",
            [*LABELS, "outcome"],
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "llmserve:kv_transfer_bytes", "KV page bytes sent.", LABELS, registry=r
        ).labels(*self._labels)
        self.kv_transfer_chunks = Counter(
            "llmserve:kv_transfer_chunks",
            "KV page messages sent (a transfer is split into chunks that fit max_payload).",
            LABELS,
            registry=r,
        ).labels(*self._labels)
        self.kv_transfer_seconds = histogram(
            "llmserve:kv_transfer_seconds",
            "Wall time of one KV page transfer (first chunk to last ack).",
            _STEP_BUCKETS,
        ).labels(*self._labels)
        r.register(self)

    # -- the engine thread's observer (services/executor/worker.py) -------------------------------

    def on_step(self, duration_s: float, stats: EngineStats) -> None:
        if stats.last_step_num_tokens <= 0:
            return  # nothing ran (all waiting): not a batch
        self.step_seconds.observe(duration_s)
        self.batch_size.observe(stats.last_step_num_seqs)
        self.iteration_tokens.observe(stats.last_step_num_tokens)

    def on_kv_transfer(self, outcome: str, stats: TransferStats | None) -> None:
        self._kv_transfers.labels(*self._labels, outcome).inc()
        if stats is not None:
            self.kv_transfer_bytes.inc(stats.num_bytes)
            self.kv_transfer_chunks.inc(stats.num_chunks)
            self.kv_transfer_seconds.observe(stats.seconds)

    def on_first_scheduled(self, queue_time_s: float) -> None:
        self.queue_time.observe(max(0.0, queue_time_s))

    # -- a custom collector: the engine's gauges and cumulative counters ---------------------------

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        v = self._labels
        gauges = [
            ("llmserve:num_requests_running", "Sequences in the engine's batch.", s.num_running),
            ("llmserve:num_requests_waiting", "Sequences waiting in the engine.", s.num_waiting),
            ("llmserve:kv_cache_usage_perc", "KV cache usage (1 = full).", s.kv_cache_usage),
            ("llmserve:num_free_kv_blocks", "Free KV blocks.", s.num_free_blocks),
        ]
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            gauge.add_metric(v, float(value))
            yield gauge
        counters = [
            (
                "llmserve:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_cache_queries_tokens,
            ),
            (
                "llmserve:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                s.prefix_cache_hits_tokens,
            ),
            ("llmserve:num_preemptions", "Sequences preempted.", s.num_preemptions),
            (
                "llmserve:spec_decode_num_drafts",
                "Steps of a sequence that verified speculative proposals.",
                s.spec_num_drafts,
            ),
            (
                "llmserve:spec_decode_num_draft_tokens",
                "Speculative proposals verified.",
                s.spec_num_draft_tokens,
            ),
            (
                "llmserve:spec_decode_num_accepted_tokens",
                "Speculative proposals accepted.",
                s.spec_num_accepted_tokens,
            ),
        ]
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            counter.add_metric(v, float(value))
            yield counter
