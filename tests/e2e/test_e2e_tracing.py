"""One OpenTelemetry trace per request across the whole stack, received over real OTLP/HTTP.

The stack (``llmserve up``'s launcher, real nats-server and redis-server, the real SmolLM2, two
executors so the scheduler asks the prefix index) exports to a receiver in the test
(helpers/otlp.py) through the standard OTEL_* variables alone. A streamed chat request makes one
trace whose spans come from the gateway, the tokenizer, the scheduler, the prefix index and an
executor, each its own service.name, in causal parent/child order; a client's ``traceparent`` is
continued; with OTEL_* unset nothing is exported at all."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from helpers.otlp import OtlpReceiver, ReceivedSpan

MODEL = "SmolLM2-135M-Instruct"
# Long enough for full 16-token blocks: the scheduler asks the index about them.
PROMPT = "Tell me, in a few words, why the sky is blue and why sunsets are red. " * 2
MAX_TOKENS = 6
CLIENT_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"

SERVICES = (
    "llmserve-gateway",
    "llmserve-tokenizer",
    "llmserve-scheduler",
    "llmserve-prefix-index",
    "llmserve-executor",
)


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def chat(base_url: str, headers: dict[str, str] | None = None) -> tuple[str, str]:
    """Stream one chat completion; (its request id, the text)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        rid = r.headers["x-request-id"]
        text = "".join(
            json.loads(line[6:])["choices"][0]["delta"].get("content", "")
            for line in r.iter_lines()
            if line.startswith("data: {") and json.loads(line[6:])["choices"]
        )
    return rid, text


def trace_of(spans: list[ReceivedSpan], request_id: str) -> list[ReceivedSpan]:
    """Every span of the trace the gateway's span of ``request_id`` belongs to."""
    roots = [s for s in spans if s.attributes.get("llmserve.request_id") == request_id]
    trace_ids = {s.trace_id for s in roots}
    assert len(trace_ids) == 1, trace_ids  # one trace per request, whoever recorded it
    return [s for s in spans if s.trace_id in trace_ids]


def complete(spans: list[ReceivedSpan], request_id: str) -> bool:
    """The request's trace holds every span it must (the services export on their own clocks)."""
    mine = [s for s in spans if s.attributes.get("llmserve.request_id") == request_id]
    if not mine:
        return False
    names = {s.name for s in spans if s.trace_id == mine[0].trace_id}
    return {
        "POST /v1/chat/completions",
        "gateway.stream",
        "tokenizer.tokenize",
        "scheduler.index_lookup",
        "prefix_index.match",
        "scheduler.queue",
        "scheduler.route",
        "executor.request",
        "executor.queue",
        "executor.prefill",
        "executor.decode",
    } <= names


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, found)
    return found[0]


def check_tree(spans: list[ReceivedSpan], num_prompt_tokens_min: int) -> ReceivedSpan:
    """The request's spans, service by service, in causal order; returns the gateway's span."""
    gateway = one(spans, "POST /v1/chat/completions")
    tokenize = one(spans, "tokenizer.tokenize")
    lookup = one(spans, "scheduler.index_lookup")
    match = one(spans, "prefix_index.match")
    queue = one(spans, "scheduler.queue")
    route = one(spans, "scheduler.route")
    executor = one(spans, "executor.request")
    decode = one(spans, "executor.decode")
    stream = one(spans, "gateway.stream")
    prefills = [s for s in spans if s.name == "executor.prefill"]
    exec_queue = one(spans, "executor.queue")

    by_service = {s.name: s.service for s in spans}
    assert by_service["POST /v1/chat/completions"] == "llmserve-gateway"
    assert by_service["gateway.stream"] == "llmserve-gateway"
    assert by_service["tokenizer.tokenize"] == "llmserve-tokenizer"
    assert by_service["scheduler.route"] == "llmserve-scheduler"
    assert by_service["scheduler.index_lookup"] == "llmserve-scheduler"
    assert by_service["prefix_index.match"] == "llmserve-prefix-index"
    assert by_service["executor.request"] == "llmserve-executor"
    assert {s.service for s in spans} == set(SERVICES)

    # parent links: gateway → tokenizer → scheduler → (prefix index | executor)
    assert tokenize.parent_span_id == gateway.span_id
    assert stream.parent_span_id == gateway.span_id
    assert {lookup.parent_span_id, queue.parent_span_id, route.parent_span_id} == {tokenize.span_id}
    assert match.parent_span_id == lookup.span_id
    assert executor.parent_span_id == route.span_id
    assert {exec_queue.parent_span_id, decode.parent_span_id} == {executor.span_id}
    assert prefills and all(p.parent_span_id == executor.span_id for p in prefills)
    # and in time: queue wait, then prefill chunks, then decode
    assert exec_queue.end_ns <= prefills[0].start_ns <= prefills[-1].end_ns <= decode.start_ns
    assert gateway.start_ns <= tokenize.start_ns and executor.end_ns <= gateway.end_ns

    # attributes (GenAI semantic conventions where they exist)
    assert gateway.attributes["gen_ai.request.model"] == MODEL
    assert gateway.attributes["gen_ai.operation.name"] == "chat"
    assert gateway.attributes["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert gateway.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    num_prompt_tokens = gateway.attributes["gen_ai.usage.input_tokens"]
    assert num_prompt_tokens >= num_prompt_tokens_min
    assert gateway.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert gateway.attributes["http.response.status_code"] == 200
    assert "first_token" in gateway.events
    assert tokenize.attributes["gen_ai.usage.input_tokens"] == num_prompt_tokens
    assert route.attributes["llmserve.route.policy"] == "cache"
    assert (
        route.attributes["llmserve.route.executor_id"]
        == executor.attributes["llmserve.executor.id"]
    )
    assert route.attributes["llmserve.route.outcome"] == "accepted"
    assert route.attributes["llmserve.route.index_answered"] is True
    assert "llmserve.prefix.matched_blocks" in route.attributes
    assert "llmserve.prefix.matched_tokens" in route.attributes
    assert lookup.attributes["llmserve.prefix.num_query_blocks"] == num_prompt_tokens // 16
    assert executor.attributes["gen_ai.usage.input_tokens"] == num_prompt_tokens
    assert executor.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert "first_token" in executor.events
    assert decode.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert sum(p.attributes["llmserve.prefill.num_tokens"] for p in prefills) == (
        num_prompt_tokens - prefills[0].attributes["llmserve.prefill.start"]
    )
    assert stream.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    return gateway


@pytest.mark.timeout(600)
def test_one_trace_per_request_across_every_service(stack, receiver):
    s = stack(
        num_executors=2,
        extra_env=(
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),  # ms: spans reach the receiver promptly
            ("OTEL_SERVICE_NAME", "ignored-by-up"),  # `up` names each service itself
        ),
    )
    # A request of our own: the gateway's span is the trace's root.
    rid, text = chat(s.base_url)
    assert text
    spans = receiver.wait_for(lambda spans: complete(spans, rid), timeout=30)
    mine = trace_of(spans, rid)
    gateway = check_tree(mine, num_prompt_tokens_min=32)
    assert gateway.parent_span_id == ""

    # A client's traceparent is continued: same trace id, the gateway's span its child.
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    rid2, _ = chat(s.base_url, {"traceparent": traceparent})
    spans = receiver.wait_for(lambda spans: complete(spans, rid2), timeout=30)
    theirs = trace_of(spans, rid2)
    assert {sp.trace_id for sp in theirs} == {CLIENT_TRACE_ID}
    gateway2 = check_tree(theirs, num_prompt_tokens_min=32)
    assert gateway2.parent_span_id == CLIENT_SPAN_ID
    # the two requests' traces share no span; no other span (FastAPI's own are off)
    assert not {sp.span_id for sp in mine} & {sp.span_id for sp in theirs}
    assert not [sp for sp in receiver.spans() if sp.name.startswith(("fastapi", "GET "))]


def _bind_default_otlp_port() -> OtlpReceiver | None:
    """A receiver on the OTLP/HTTP default port (localhost:4318), where an exporter left at its
    defaults would send; None if something else holds the port."""
    try:
        return OtlpReceiver(port=4318)
    except OSError:
        return None


@pytest.mark.timeout(300)
def test_no_trace_is_exported_without_otel_settings(stack, receiver, monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    default_port = _bind_default_otlp_port()
    try:
        s = stack(extra_env=(("OTEL_BSP_SCHEDULE_DELAY", "100"),))
        # Even a client's context (passed on, W3C) makes no service record or export a span.
        chat(s.base_url, {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"})
        chat(s.base_url)
        time.sleep(1.5)  # many export intervals
        assert receiver.num_requests == 0
        if default_port is not None:
            assert default_port.num_requests == 0
        # no exporter thread in any service: the SDK was never imported (checked in-process by
        # tests/unit/test_tracing.py); here, no socket of any service reaches an OTLP port
        assert _connections_to(4318) == 0
    finally:
        if default_port is not None:
            default_port.close()


def _connections_to(port: int) -> int:
    """Established TCP connections to ``port`` on this host (from /proc/net/tcp)."""
    count = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[3] == "01":
                count += 1
    return count
