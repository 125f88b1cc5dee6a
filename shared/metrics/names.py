"""The metrics the stack exports that a vLLM user expects (docs, dashboard and tests check this
list): vLLM's names under ``llmserve:``, as they appear on /metrics (counters with ``_total``,
histograms by their family name)."""

from __future__ import annotations

REQUIRED_METRICS = (
    "llmserve:num_requests_running",
    "llmserve:num_requests_waiting",
    "llmserve:kv_cache_usage_perc",
    "llmserve:prefix_cache_queries_total",
    "llmserve:prefix_cache_hits_total",
    "llmserve:num_preemptions_total",
    "llmserve:prompt_tokens_total",
    "llmserve:generation_tokens_total",
    "llmserve:time_to_first_token_seconds",
    "llmserve:time_per_output_token_seconds",
    "llmserve:inter_token_latency_seconds",
    "llmserve:e2e_request_latency_seconds",
    "llmserve:request_queue_time_seconds",
    "llmserve:engine_step_seconds",
    "llmserve:engine_batch_size",
    "llmserve:iteration_tokens_total",
    "llmserve:nats_round_trip_seconds",
    "llmserve:kv_events_apply_lag_seconds",
)
