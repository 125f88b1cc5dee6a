"""The executor's spans of each traced request, built from what the service sees and from the
engine's step records (shared/engine/step_record.py: the engine itself knows nothing of tracing).

    executor.request (CONSUMER; child of the scheduler's scheduler.route span)
    ├── executor.queue      accepted → the engine first schedules it
    ├── executor.prefill    one per prefill chunk (the step's start and end), with its token range
    └── executor.decode     first token → finished; gen_ai.usage.output_tokens; a preemption is an
                            event on it; the first token is an event on executor.request

Only requests whose ExecuteRequest carried a trace context, in a process whose tracer records, are
tracked: otherwise every hook is one dict lookup that misses. Per-token work is counted, never a
span. No asyncio, no NATS: called by the service's publish loop, in event order.
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from shared.engine.step_record import StepRecord
from shared.tracing import extract
from shared.wire.messages import ExecuteRequest
from shared.wire.outputs import RequestOutput

SPAN_REQUEST = "executor.request"
SPAN_QUEUE = "executor.queue"
SPAN_PREFILL = "executor.prefill"
SPAN_DECODE = "executor.decode"

_tracer = trace.get_tracer("llmserve.executor")


class _RequestSpans:
    __slots__ = ("decode", "finish_reasons", "num_output_tokens", "queue", "root")

    def __init__(self, root: Span, queue: Span) -> None:
        self.root = root
        self.queue: Span | None = queue
        self.decode: Span | None = None
        self.num_output_tokens = 0
        self.finish_reasons: list[str] = []


class ExecutorSpans:
    def __init__(self, executor_id: str, tracer: Tracer | None = None) -> None:
        """``tracer``: default, the global provider's (a no-op one while tracing is off)."""
        self.executor_id = executor_id
        self._tracer = tracer or _tracer
        self._requests: dict[str, _RequestSpans] = {}
        self._last_step_end_ns: int | None = None  # the step whose outputs come next

    def __len__(self) -> int:
        return len(self._requests)

    def accepted(self, req: ExecuteRequest, headers: dict[str, str] | None) -> None:
        ctx = extract(headers)
        if ctx is None:
            return
        now = time.time_ns()
        root = self._tracer.start_span(
            SPAN_REQUEST,
            context=ctx,
            kind=SpanKind.CONSUMER,
            start_time=now,
            attributes={
                "gen_ai.request.model": req.model,
                "gen_ai.request.max_tokens": req.params.max_tokens or 0,
                "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
                "llmserve.request_id": req.request_id,
                "llmserve.executor.id": self.executor_id,
                "llmserve.attempt": req.attempt,
                "llmserve.prefix.expected_cached_tokens": req.num_expected_cached_tokens,
            },
        )
        if not root.is_recording():  # tracing is off here; the context was only passed through
            return
        queue = self._tracer.start_span(
            SPAN_QUEUE, context=trace.set_span_in_context(root), start_time=now
        )
        self._requests[req.request_id] = _RequestSpans(root, queue)

    def on_step(self, record: StepRecord) -> None:
        self._last_step_end_ns = record.end_ns
        if not self._requests:
            return
        for chunk in record.prefill_chunks:
            spans = self._requests.get(chunk.request_id)
            if spans is None:
                continue
            if spans.queue is not None:
                spans.queue.end(end_time=record.start_ns)
                spans.queue = None
            self._tracer.start_span(
                SPAN_PREFILL,
                context=trace.set_span_in_context(spans.root),
                start_time=record.start_ns,
                attributes={
                    "llmserve.prefill.start": chunk.start,
                    "llmserve.prefill.num_tokens": chunk.num_tokens,
                    "llmserve.prefill.num_cached_tokens": chunk.num_cached_tokens,
                },
            ).end(end_time=record.end_ns)
        for rid in record.preempted_request_ids:
            spans = self._requests.get(rid)
            if spans is not None:
                (spans.decode or spans.root).add_event("preempted", timestamp=record.start_ns)

    def on_output(self, out: RequestOutput) -> None:
        spans = self._requests.get(out.request_id)
        if spans is None:
            return
        if spans.decode is None:
            # This output holds the first token: it was sampled at the end of the last step.
            at = self._last_step_end_ns or time.time_ns()
            if spans.queue is not None:  # no step record named it (recording off)
                spans.queue.end(end_time=at)
                spans.queue = None
            spans.root.add_event("first_token", timestamp=at)
            spans.root.set_attribute("gen_ai.usage.cached_input_tokens", out.num_cached_tokens)
            spans.decode = self._tracer.start_span(
                SPAN_DECODE, context=trace.set_span_in_context(spans.root), start_time=at
            )
        for delta in out.deltas:
            spans.num_output_tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                spans.finish_reasons.append(delta.finish_reason)
        if out.finished:
            self.end(out.request_id)

    def end(
        self, request_id: str, error: str | None = None, finish_reason: str | None = None
    ) -> None:
        """The request is over here (finished; aborted: ``finish_reason`` 'abort'; or failed with
        ``error``): end its spans."""
        spans = self._requests.pop(request_id, None)
        if spans is None:
            return
        if finish_reason is not None:
            spans.finish_reasons.append(finish_reason)
        now = time.time_ns()
        if spans.queue is not None:
            spans.queue.end(end_time=now)
        if spans.decode is not None:
            spans.decode.set_attribute("gen_ai.usage.output_tokens", spans.num_output_tokens)
            spans.decode.end(end_time=now)
        root = spans.root
        root.set_attribute("gen_ai.usage.output_tokens", spans.num_output_tokens)
        root.set_attribute("gen_ai.response.finish_reasons", spans.finish_reasons)
        if error is not None:
            root.set_status(Status(StatusCode.ERROR, error))
        root.end(end_time=now)
