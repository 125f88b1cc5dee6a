"""OpenTelemetry tracing: set up from the standard ``OTEL_*`` variables, and W3C trace context
carried in NATS message headers.

Off unless configured: with neither ``OTEL_TRACES_EXPORTER`` (other than ``none``) nor an OTLP
endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) set,
``setup_tracing`` installs nothing and does not even import the SDK: the API's global provider stays
the no-op proxy, every span is a non-recording one, and a span context is valid only when a client
sent a ``traceparent`` (which is then still passed on, as W3C asks of a hop that does not trace).

On: one ``TracerProvider`` per process (service.name from ``OTEL_SERVICE_NAME``, else the
service's default, e.g. ``llmserve-gateway``), the sampler from ``OTEL_TRACES_SAMPLER`` /
``OTEL_TRACES_SAMPLER_ARG`` (the SDK reads them; default parent-based always-on), a
``BatchSpanProcessor`` (``OTEL_BSP_*``) per exporter named in ``OTEL_TRACES_EXPORTER`` (default
``otlp``: OTLP over HTTP/protobuf, its endpoint, headers and timeout from ``OTEL_EXPORTER_OTLP_*``;
``console`` prints spans to stdout).

Context travels explicitly: a shell extracts a ``Context`` from a message's headers, starts its
spans with ``context=`` and injects a span into the headers of what it sends on. Nothing here reads
a global beyond the API's own provider.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = [
    "TRACEPARENT",
    "Context",
    "extract",
    "headers_for",
    "setup_tracing",
    "tracing_configured",
]

TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()
_OTLP_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def tracing_configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment turns tracing on (see the module's docstring)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return any(environ.get(name, "").strip() for name in _OTLP_ENDPOINTS)


def setup_tracing(
    default_service_name: str, environ: Mapping[str, str] = os.environ
) -> TracerProvider | None:
    """Install the process's tracer provider from the environment; None (nothing installed) when
    tracing is off. Call once, at start-up; ``shutdown()`` the provider on exit so the last spans
    are exported. ValueError for an exporter or protocol this build does not have."""
    if not tracing_configured(environ):
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )

    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    names = [
        n.strip()
        for n in (environ.get("OTEL_TRACES_EXPORTER") or "otlp").lower().split(",")
        if n.strip() and n.strip() != "none"
    ]
    exporters: list[SpanExporter] = []
    for name in names:
        if name == "otlp":
            if protocol.strip() != "http/protobuf":
                raise ValueError(
                    f"OTLP protocol {protocol!r} is not supported: llmserve exports OTLP over "
                    "http/protobuf (unset OTEL_EXPORTER_OTLP_PROTOCOL or set it to that)"
                )
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        else:
            raise ValueError(
                f"OTEL_TRACES_EXPORTER names {name!r}; llmserve has 'otlp', 'console' and 'none'"
            )
    # OTEL_SERVICE_NAME (and OTEL_RESOURCE_ATTRIBUTES) win over the default; Resource.create reads
    # them, and attributes passed here would override them.
    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: default_service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def extract(headers: Mapping[str, str] | None) -> Context | None:
    """The trace context a message (or an HTTP request) carries, or None when it carries none: the
    check the untraced path pays is one dict lookup."""
    if not headers or TRACEPARENT not in headers:
        return None
    ctx = _PROPAGATOR.extract(headers)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def headers_for(
    span: trace.Span | None, headers: dict[str, str] | None = None
) -> dict[str, str] | None:
    """``headers`` plus ``span``'s W3C trace context (``traceparent``, ``tracestate``), for a
    message sent on its behalf; ``headers`` unchanged when the span carries no valid context (no
    span, tracing off and no client context)."""
    if span is None or not span.get_span_context().is_valid:
        return headers
    carrier = dict(headers) if headers else {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier
