"""Tracing's pure parts: when the environment turns it on, W3C context in and out of NATS headers,
the untraced path importing no SDK at all, and the scheduler's and executor's spans built from
their events (an in-memory exporter of the SDK; no global provider is installed here)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanKind

from services.executor.spans import ExecutorSpans
from services.scheduler.router import Dispatch
from services.scheduler.spans import SchedulerSpans
from shared.engine.step_record import PrefillChunk, StepRecord
from shared.tracing import extract, headers_for, setup_tracing, tracing_configured
from shared.wire.messages import ExecuteRequest
from shared.wire.outputs import CompletionDelta, RequestOutput
from shared.wire.sampling_params import SamplingParams

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h"}, False),
    ],
)
def test_tracing_is_off_unless_the_environment_turns_it_on(env, on):
    assert tracing_configured(env) is on


def test_setup_refuses_what_it_cannot_export():
    with pytest.raises(ValueError, match="grpc"):
        setup_tracing("x", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    with pytest.raises(ValueError, match="zipkin"):
        setup_tracing("x", {"OTEL_TRACES_EXPORTER": "zipkin"})


def test_off_installs_nothing_and_imports_no_sdk():
    # A fresh interpreter: every service's shell imported, setup run with tracing off. (The redis
    # client imports the SDK's metrics for its own observability; no trace SDK, no exporter.)
    code = """
import sys
import services.gateway.app, services.tokenizer.service, services.scheduler.service
import services.prefix_index.service, services.executor.service, services.runtime
from shared.tracing import setup_tracing
from opentelemetry import trace
assert setup_tracing("llmserve-x", {}) is None
assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
loaded = [m for m in sys.modules if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exp"))]
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_context_in_and_out_of_headers():
    assert extract(None) is None
    assert extract({}) is None
    assert extract({"traceparent": "00-abc-def-01"}) is None  # malformed: as if absent
    ctx = extract({"traceparent": TRACEPARENT, "other": "x"})
    assert ctx is not None
    span = trace.get_current_span(ctx)
    assert f"{span.get_span_context().trace_id:032x}" == TRACE_ID
    # A hop that does not trace passes the context on unchanged (W3C), other headers kept.
    assert headers_for(span, {"a": "b"}) == {"a": "b", "traceparent": TRACEPARENT}
    assert headers_for(None, {"a": "b"}) == {"a": "b"}
    assert headers_for(NonRecordingSpan(trace.INVALID_SPAN_CONTEXT)) is None


def in_memory() -> tuple[trace.Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def attrs(span: ReadableSpan) -> dict:
    return dict(span.attributes or {})


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def execute_request(rid: str = "r1", num_prompt_tokens: int = 40) -> ExecuteRequest:
    return ExecuteRequest(
        request_id=rid,
        model="m",
        prompt_token_ids=list(range(num_prompt_tokens)),
        block_hashes=[],
        params=SamplingParams(max_tokens=3),
        num_expected_cached_tokens=16,
    )


def output(rid: str, tokens: list[int], finish_reason: str | None = None) -> RequestOutput:
    delta = CompletionDelta(index=0, token_ids=tokens, text="x", finish_reason=finish_reason)
    return RequestOutput(
        request_id=rid,
        deltas=[delta],
        num_prompt_tokens=40,
        num_cached_tokens=16,
        finished=finish_reason is not None,
    )


def test_executor_spans_from_step_records():
    tracer, exporter = in_memory()
    spans = ExecutorSpans("e0", tracer)
    spans.accepted(execute_request("r1"), {"traceparent": TRACEPARENT})
    spans.accepted(execute_request("untraced"), None)
    assert len(spans) == 1  # the untraced request costs nothing more
    # Two prefill chunks (16 cached: 24 to compute, budget 16 a step), then decodes.
    spans.on_step(StepRecord(1_000, 2_000, (PrefillChunk("r1", 16, 16, 16),), ()))
    spans.on_step(StepRecord(3_000, 4_000, (PrefillChunk("r1", 32, 8, 16),), ()))
    spans.on_output(output("r1", [7]))
    spans.on_step(StepRecord(5_000, 6_000, (), ("r1",)))  # preempted while decoding
    spans.on_output(output("r1", [8]))
    spans.on_output(output("r1", [9], "length"))
    assert len(spans) == 0

    got = by_name(exporter.get_finished_spans())
    [root] = got["executor.request"]
    [queue] = got["executor.queue"]
    prefills = got["executor.prefill"]
    [decode] = got["executor.decode"]
    assert root.kind is SpanKind.CONSUMER
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert parent_id(root) == int(PARENT_ID, 16)
    assert {parent_id(s) for s in (queue, *prefills, decode)} == {root.context.span_id}
    assert queue.end_time == 1_000  # waited until the engine first scheduled it
    assert [(p.start_time, p.end_time) for p in prefills] == [(1_000, 2_000), (3_000, 4_000)]
    assert [attrs(p)["llmserve.prefill.num_tokens"] for p in prefills] == [16, 8]
    assert decode.start_time == 4_000  # the first token was sampled at the end of that step
    assert attrs(decode)["gen_ai.usage.output_tokens"] == 3
    assert [e.name for e in decode.events] == ["preempted"]
    assert [e.name for e in root.events] == ["first_token"]
    assert attrs(root)["gen_ai.usage.input_tokens"] == 40
    assert attrs(root)["gen_ai.usage.output_tokens"] == 3
    assert attrs(root)["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs(root)["llmserve.executor.id"] == "e0"


def test_executor_spans_of_a_failed_request_end_with_an_error():
    tracer, exporter = in_memory()
    spans = ExecutorSpans("e0", tracer)
    spans.accepted(execute_request("r1"), {"traceparent": TRACEPARENT})
    spans.end("r1", error="500: the engine failed")
    got = by_name(exporter.get_finished_spans())
    [root] = got["executor.request"]
    assert not root.status.is_ok and "engine failed" in (root.status.description or "")
    assert len(got["executor.queue"]) == 1 and "executor.decode" not in got


def test_scheduler_spans_queue_lookup_and_route():
    tracer, exporter = in_memory()
    spans = SchedulerSpans("cache", tracer)
    ctx = spans.submitted("r1", {"traceparent": TRACEPARENT})
    assert spans.submitted("untraced", None) is None
    lookup = spans.index_lookup(ctx, "m", 2)
    assert lookup is not None
    lookup_headers = headers_for(lookup)
    assert lookup_headers is not None
    assert (
        lookup_headers["traceparent"].split("-")[2] == f"{lookup.get_span_context().span_id:016x}"
    )
    lookup.end()
    spans.matched("r1", {"e1": 2})
    request = ExecuteRequest(
        request_id="r1",
        model="m",
        prompt_token_ids=list(range(40)),
        block_hashes=[1, 2],
        params=SamplingParams(),
        num_expected_cached_tokens=32,
    )
    headers = spans.route(Dispatch("e1", request))
    assert headers is not None and TRACE_ID in headers["traceparent"]
    spans.answered("r1", "e1", "refused")  # full: routed again, still tracked
    assert len(spans) == 1
    spans.route(Dispatch("e0", request))
    spans.answered("r1", "e0", "accepted")
    assert len(spans) == 0

    got = by_name(exporter.get_finished_spans())
    [queue] = got["scheduler.queue"]
    routes = got["scheduler.route"]
    [lookup_span] = got["scheduler.index_lookup"]
    assert {parent_id(s) for s in (queue, *routes, lookup_span)} == {int(PARENT_ID, 16)}
    assert lookup_span.kind is SpanKind.CLIENT
    assert [attrs(r)["llmserve.route.executor_id"] for r in routes] == ["e1", "e0"]
    assert [attrs(r)["llmserve.route.outcome"] for r in routes] == ["refused", "accepted"]
    assert attrs(routes[0])["llmserve.prefix.matched_blocks"] == 2
    assert attrs(routes[1])["llmserve.prefix.matched_blocks"] == 0
    assert attrs(routes[0])["llmserve.prefix.matched_tokens"] == 32
    assert attrs(routes[0])["llmserve.route.policy"] == "cache"
    assert queue.end_time is not None and queue.end_time <= (routes[0].start_time or 0)
