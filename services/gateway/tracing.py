"""The gateway's spans: the root of each request's trace (or a child of the client's
``traceparent``, which is continued, not replaced).

    POST /v1/chat/completions (SERVER)     the HTTP request, until its response ends; GenAI
    │                                      attributes (gen_ai.request.*, gen_ai.usage.*,
    │                                      gen_ai.response.finish_reasons); event first_token
    ├── tokenizer.tokenize → scheduler.* → executor.*   (the other services' spans; the request's
    │                                      GenerateRequest carries this span's context)
    └── gateway.stream                     first token → the last byte back to the client;
                                           output tokens and chunks counted, never one span each

With tracing off the request span is non-recording and the plain metrics tracker is used: the
untraced path pays one span object and one ``is_recording`` check per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from shared.tracing import extract

from .generation import Prepared
from .metrics import GatewayMetrics, RequestTracker

SPAN_STREAM = "gateway.stream"

_tracer = trace.get_tracer("llmserve.gateway")
_OPERATIONS = {"chat": "chat", "completion": "text_completion"}


def start_request_span(method: str, route: str, headers: Mapping[str, str]) -> Span:
    """The span of one HTTP request, child of the client's ``traceparent`` if it sent one."""
    return _tracer.start_span(
        f"{method} {route}",
        context=extract(headers),
        kind=SpanKind.SERVER,
        attributes={"http.request.method": method, "http.route": route},
    )


def describe(span: Span, p: Prepared) -> None:
    """The request's GenAI attributes, once it is parsed."""
    if not span.is_recording():
        return
    params = p.generate.params
    span.set_attributes(
        {
            "gen_ai.operation.name": _OPERATIONS[p.api],
            "gen_ai.request.model": p.generate.model,
            "gen_ai.request.max_tokens": params.max_tokens or 0,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.choice.count": params.n,
            "gen_ai.response.id": p.generate.request_id,
            "llmserve.request_id": p.generate.request_id,
            "llmserve.stream": p.stream,
        }
    )


def end_request_span(span: Span, status: int) -> None:
    """End a request span that got no further than an error answer."""
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))
    span.end()


class TracedRequestTracker(RequestTracker):
    """The metrics tracker that also ends the request's span (and its stream span) when the
    request is done, with its usage."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        endpoint: str,
        on_done: Callable[[int, int], None] | None,
        span: Span,
    ) -> None:
        super().__init__(metrics, endpoint, on_done)
        self._span = span
        self._stream: Span | None = None
        self._num_outputs = 0
        self._ended = False

    def on_tokens(self, num_tokens: int) -> None:
        super().on_tokens(num_tokens)
        self._num_outputs += 1
        if num_tokens <= 0:
            return
        if self._stream is None:
            now = time.time_ns()
            self._span.add_event("first_token", timestamp=now)
            self._stream = _tracer.start_span(
                SPAN_STREAM, context=trace.set_span_in_context(self._span), start_time=now
            )

    def done(
        self,
        status: int,
        *,
        num_prompt_tokens: int = 0,
        finish_reasons: list[str | None] | None = None,
    ) -> None:
        super().done(status, num_prompt_tokens=num_prompt_tokens, finish_reasons=finish_reasons)
        if self._ended:
            return
        self._ended = True
        if self._stream is not None:
            self._stream.set_attribute("gen_ai.usage.output_tokens", self._num_generated_tokens)
            self._stream.set_attribute("llmserve.stream.num_outputs", self._num_outputs)
            self._stream.end()
        self._span.set_attribute("gen_ai.usage.output_tokens", self._num_generated_tokens)
        if num_prompt_tokens:
            self._span.set_attribute("gen_ai.usage.input_tokens", num_prompt_tokens)
        if finish_reasons:
            self._span.set_attribute(
                "gen_ai.response.finish_reasons", [r or "unknown" for r in finish_reasons]
            )
        end_request_span(self._span, status)


def tracker_for(
    metrics: GatewayMetrics,
    endpoint: str,
    on_done: Callable[[int, int], None] | None,
    span: Span,
) -> RequestTracker:
    """The request's tracker: the traced one when its span records, else the plain one."""
    if span.is_recording():
        return TracedRequestTracker(metrics, endpoint, on_done, span)
    return metrics.tracker(endpoint, on_done)
