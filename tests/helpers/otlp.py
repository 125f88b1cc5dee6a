"""A real OTLP/HTTP trace receiver for tests: an HTTP server on a loopback port that accepts
``POST /v1/traces`` (an ``ExportTraceServiceRequest`` in protobuf, gzip-compressed or not, as the
OpenTelemetry exporters send it) and keeps every span it decodes.

    with OtlpReceiver() as receiver:            # port 0: a free one; OtlpReceiver(port=4318) too
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
        ...
        spans = receiver.wait_for(lambda spans: len(spans) >= 5, timeout=10)
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    trace_id: str  # hex, 32 digits
    span_id: str  # hex, 16 digits
    parent_span_id: str  # hex; "" for a root span
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: tuple[str, ...]
    status_code: int  # 0 unset, 1 ok, 2 error


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return _attributes(v.kvlist_value.values)
    return getattr(v, which) if which else None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs if isinstance(kv, KeyValue)}


def decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for rs in request.resource_spans:
        service = str(_attributes(rs.resource.attributes).get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(
                    ReceivedSpan(
                        service=service,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        name=s.name,
                        kind=s.kind,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attributes(s.attributes),
                        events=tuple(e.name for e in s.events),
                        status_code=s.status.code,
                    )
                )
    return spans


class OtlpReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.num_requests = 0  # POSTs received, whatever their content
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with receiver._lock:
                    receiver.num_requests += 1
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = decode(body)
                with receiver._lock:
                    receiver._spans.extend(spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(
        self, cond: Callable[[list[ReceivedSpan]], bool], timeout: float
    ) -> list[ReceivedSpan]:
        """The spans received once ``cond(spans)`` holds; AssertionError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if cond(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted(f"{s.service}:{s.name}" for s in spans)
                raise AssertionError(f"timed out after {timeout}s; received {names}")
            time.sleep(0.05)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
