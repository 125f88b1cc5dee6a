"""The scheduler's spans of each traced request (its submit carried a W3C ``traceparent``):

    tokenizer.tokenize (the submit's context)
    ├── scheduler.index_lookup (CLIENT)   the prefix-index round trip; its context goes in the
    │                                      request's headers → prefix_index.match (SERVER)
    ├── scheduler.queue                    submit → dispatched (or failed); zero-length when an
    │                                      executor had room at once
    └── scheduler.route (PRODUCER)         one per dispatch: the routing decision (policy, chosen
                                           executor, matched prefix in blocks and tokens, attempt)
                                           and the executor's answer; its context goes in the
                                           ExecuteRequest's headers → executor.request

A request is tracked from its submit until an executor accepts it, it fails here or is aborted.
With tracing off in this process but a context on the message, the spans are non-recording and
the context is passed on unchanged (W3C). No asyncio, no NATS.
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from services.scheduler.router import Dispatch
from shared.tracing import extract, headers_for

SPAN_INDEX_LOOKUP = "scheduler.index_lookup"
SPAN_QUEUE = "scheduler.queue"
SPAN_ROUTE = "scheduler.route"

_tracer = trace.get_tracer("llmserve.scheduler")


class _Traced:
    __slots__ = ("ctx", "matched_blocks", "queue", "routes")

    def __init__(self, ctx: Context, queue: Span) -> None:
        self.ctx = ctx
        self.queue: Span | None = queue
        self.matched_blocks: dict[str, int] | None = None  # the index's answer
        self.routes: dict[str, Span] = {}  # executor id → its dispatch's route span


class SchedulerSpans:
    def __init__(self, policy: str, tracer: Tracer | None = None) -> None:
        """``tracer``: default, the global provider's (a no-op one while tracing is off)."""
        self.policy = policy
        self._tracer = tracer or _tracer
        self._requests: dict[str, _Traced] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def submitted(self, request_id: str, headers: dict[str, str] | None) -> Context | None:
        """Start tracking a submit; its context (None: not traced)."""
        ctx = extract(headers)
        if ctx is None:
            return None
        queue = self._tracer.start_span(
            SPAN_QUEUE, context=ctx, attributes={"llmserve.request_id": request_id}
        )
        self._requests[request_id] = _Traced(ctx, queue)
        return ctx

    def index_lookup(self, ctx: Context | None, model: str, num_blocks: int) -> Span | None:
        """The span of one prefix-index round trip (the caller ends it), or None."""
        if ctx is None:
            return None
        return self._tracer.start_span(
            SPAN_INDEX_LOOKUP,
            context=ctx,
            kind=SpanKind.CLIENT,
            attributes={
                "gen_ai.request.model": model,
                "llmserve.prefix.num_query_blocks": num_blocks,
            },
        )

    def matched(self, request_id: str, matched_blocks: dict[str, int] | None) -> None:
        traced = self._requests.get(request_id)
        if traced is not None:
            traced.matched_blocks = matched_blocks

    def route(self, action: Dispatch) -> dict[str, str] | None:
        """A dispatch is about to be sent: the trace headers it carries (None: not traced)."""
        rid = action.request.request_id
        traced = self._requests.get(rid)
        if traced is None:
            return None
        now = time.time_ns()
        if traced.queue is not None:
            traced.queue.end(end_time=now)
            traced.queue = None
        matched = traced.matched_blocks
        span = self._tracer.start_span(
            SPAN_ROUTE,
            context=traced.ctx,
            kind=SpanKind.PRODUCER,
            start_time=now,
            attributes={
                "llmserve.request_id": rid,
                "gen_ai.request.model": action.request.model,
                "llmserve.route.policy": self.policy,
                "llmserve.route.executor_id": action.executor_id,
                "llmserve.route.attempt": action.request.attempt,
                "llmserve.route.index_answered": matched is not None,
                "llmserve.prefix.matched_blocks": (matched or {}).get(action.executor_id, 0),
                "llmserve.prefix.matched_tokens": action.request.num_expected_cached_tokens,
            },
        )
        traced.routes[action.executor_id] = span
        return headers_for(span)

    def answered(self, request_id: str, executor_id: str, outcome: str) -> None:
        """The dispatch to ``executor_id`` got its outcome: 'accepted' (the trace goes on in the
        executor: stop tracking), 'refused' (full: routed again), 'unreachable' or 'no answer'."""
        traced = self._requests.get(request_id)
        span = traced.routes.pop(executor_id, None) if traced is not None else None
        if span is None:
            return
        span.set_attribute("llmserve.route.outcome", outcome)
        span.end()
        if outcome in ("accepted", "no answer"):
            self.forget(request_id)

    def failed(self, request_id: str, status: int, message: str) -> None:
        traced = self._requests.get(request_id)
        if traced is None:
            return
        for span in (traced.queue, *traced.routes.values()):
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, f"{status}: {message}"))
        self.forget(request_id)

    def forget(self, request_id: str) -> None:
        """End whatever is still open of the request's spans and stop tracking it."""
        traced = self._requests.pop(request_id, None)
        if traced is None:
            return
        for span in (traced.queue, *traced.routes.values()):
            if span is not None:
                span.end()
