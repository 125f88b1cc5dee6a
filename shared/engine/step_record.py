"""What one engine step did, per request, with wall-clock timestamps: the engine's side of tracing.

The engine stays free of any tracing library: when ``Engine.record_steps`` is on it keeps one
``StepRecord`` per step (the last one, like its KV events), and the executor's shell turns records
into spans and span events (services/executor/spans.py). Off, the step pays one attribute check.

Timestamps are ``time.time_ns()`` (wall clock, nanoseconds since the epoch): what OpenTelemetry
spans take, and comparable across the processes of one host.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """``num_tokens`` prompt tokens of ``request_id`` computed from position ``start``. A resumed
    (preempted) sequence's recompute counts as prefill too: it is a chunk of more than one token
    or one that starts inside the prompt."""

    request_id: str
    start: int
    num_tokens: int
    num_cached_tokens: int  # of the prompt, found in the prefix cache when it was admitted


@dataclass(frozen=True, slots=True)
class StepRecord:
    start_ns: int  # the step began (scheduling included)
    end_ns: int  # its tokens were sampled: outputs of this step are ready
    prefill_chunks: tuple[PrefillChunk, ...]
    preempted_request_ids: tuple[str, ...]  # requests whose KV was dropped to make room
