"""The FastAPI app: OpenAI-compatible routes, health, metrics.

    POST /v1/completions         POST /v1/chat/completions     (JSON, or SSE with "stream": true)
    GET  /v1/models              GET  /v1/models/{model}
    WS   /v1/ws                  (see websocket.py)
    GET  /health                 200 iff NATS is connected, a tokenizer answers and the scheduler
                                 reports >= 1 executor, else 503 naming what is down, with
                                 Retry-After; "dependencies" says which of NATS, tokenizer,
                                 scheduler, executors, prefix index and Redis are up, "models"
                                 per model how many executors serve it and the context the
                                 tokenizer checks (null: no tokenizer serves it; see health.py)
    GET  /metrics                Prometheus text: the whole stack's metrics (metrics.py)
    GET  /console/               the browser console: playground, live ledgers, capacity planner
                                 (console_routes.py)

Every error is an OpenAI error body (errors.py). Auth (when an API key is configured) guards /v1/*
and /console/api/*; /health, /metrics and the console's static files stay open. Generation bodies
must be JSON (``Content-Type: application/json``, else 415) and at most ``max_body_bytes`` (413,
refused while being read; body.py). There is no CORS: no preflight is answered, no Allow-Origin
header sent. While draining (server.py) new generation requests and /health get 503.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.prefix_index.store import connect_redis
from shared.metrics.publisher import MetricsPublisher
from shared.tracing import headers_for
from shared.wire import subjects
from shared.wire.bus import Bus
from shared.wire.bus_auth import redact_url
from shared.wire.outputs import RequestOutput

from . import protocol
from .body import read_body, require_json
from .config import GatewayConfig
from .console_routes import register_console
from .errors import UNAVAILABLE_RETRY_AFTER_S, APIError, route_not_found
from .generation import ClientDisconnected, Gateway, Prepared
from .health import health_report, nats_down_report
from .limiter import Limiter
from .metrics import CLIENT_CLOSED, GatewayMetrics, RequestTracker
from .sse import DONE, EventStreamResponse, sse_event
from .streams import GenerationStream
from .tracing import describe, end_request_span, start_request_span, tracker_for
from .websocket import register_websocket

log = logging.getLogger("llmserve.gateway")


# A refused body may still be arriving: closing the connection after the answer is the only way
# not to read (and discard) the rest of it.
_CLOSE = {"Connection": "close"}


def error_response(e: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers={**e.headers(), **(headers or {})})


def create_app(config: GatewayConfig, *, bus: Bus | None = None) -> FastAPI:
    """The app. With ``bus`` given (tests), it is used as is and not closed by the app."""
    gw = Gateway(config, GatewayMetrics())
    started_at = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gw.bus = bus or await Bus.connect(
            config.nats_url,
            "gateway",
            auth=config.bus_auth,
            connect_timeout_s=config.nats_connect_timeout_s,
        )
        gw.bus.on_connection_lost(gw.on_bus_lost)
        await gw.bus.subscribe(subjects.METRICS_ALL, gw.on_metrics_report)
        await gw.bus.subscribe(subjects.EXECUTOR_STATS_ALL, gw.on_heartbeat)
        publisher = MetricsPublisher(gw.bus, "gateway", gw.metrics.instance, gw.metrics.registry)
        publisher.start()
        if any(k.limited for k in config.api_keys):
            assert config.redis_url is not None  # GatewayConfig checks it
            gw.limiter = Limiter(
                connect_redis(config.redis_url, config.limits_redis_timeout_s, config.redis_auth),
                gw.metrics,
                key_prefix=config.limits_key_prefix,
                lease_ttl_s=config.limits_lease_ttl_s,
            )
            gw.limiter.start()
        log.info(
            "gateway serving %s on %s:%d (nats %s, auth %s)",
            ", ".join(config.model_names) or "(the executors' models)",
            config.host,
            config.port,
            redact_url(config.nats_url),
            f"on, {len(gw.keys)} key(s)" if len(gw.keys) else "off",
        )
        if gw.limiter is not None:
            log.info(
                "per-key limits in redis %s (%s)",
                redact_url(config.redis_url or ""),
                config.redis_auth.describe(),
            )
        try:
            yield
        finally:
            await publisher.stop()
            if gw.limiter is not None:
                await gw.limiter.close()
            if bus is None:
                await gw.bus.drain()

    app = FastAPI(
        title="llmserve",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        # FastAPI's own spans are off: the request span is ours (tracing.py), lasting until the
        # stream ends and carrying the GenAI attributes; its per-dependency spans and a span per
        # /health probe would only add cost and noise to each trace.
        telemetry={"tracing": False, "operation_spans": False, "auto_configure": False},
    )
    app.state.gateway = gw

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # Unknown routes, wrong methods: OpenAI-shaped too, so clients parse every error one way.
        if e.status_code == 404:
            return error_response(route_not_found(request.method, request.url.path))
        return error_response(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"Internal server error: {type(e).__name__}"))

    @app.get("/health")
    async def health() -> JSONResponse:
        retry_after = {"Retry-After": str(math.ceil(UNAVAILABLE_RETRY_AFTER_S))}
        if gw.draining.is_set():  # a load balancer must stop sending requests here
            return JSONResponse(
                {"status": "draining", "reason": "shutting down"},
                status_code=503,
                headers=retry_after,
            )
        if gw.bus is None or not gw.bus.is_connected:
            return JSONResponse(
                nats_down_report(gw.bus_down_detail()), status_code=503, headers=retry_after
            )
        # All asked at once; an answer that is an APIError is that service's failure.
        status, tokenizer, index = await asyncio.gather(
            gw.scheduler_status(),
            gw.tokenizer_status(),
            gw.prefix_index_probe(),
            return_exceptions=True,
        )
        for answer in (status, tokenizer, index):
            if isinstance(answer, BaseException) and not isinstance(answer, APIError):
                raise answer
        if not gw.bus.is_connected:  # lost while asking: the services' silence is NATS's
            return JSONResponse(
                nats_down_report(gw.bus_down_detail()), status_code=503, headers=retry_after
            )
        code, body = health_report(config.model_names, status, tokenizer, index)
        return JSONResponse(body, status_code=code, headers=retry_after if code != 200 else None)

    @app.get("/metrics")
    async def metrics() -> Response:
        await gw.refresh_stack_metrics()
        return Response(generate_latest(gw.metrics.exposition), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": started_at, "owned_by": "llmserve"}

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        gw.authenticate(request.headers.get("authorization"))
        return {"object": "list", "data": [model_card(m) for m in await gw.served_models()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> dict[str, Any]:
        gw.authenticate(request.headers.get("authorization"))
        await gw.check_model(model)
        return model_card(model)

    async def generate(api: protocol.Api, endpoint: str, request: Request) -> Response:
        # The trace's root here (or the client's traceparent continued); ended by the tracker.
        span = start_request_span(request.method, request.url.path, request.headers)
        try:
            key = gw.authenticate(request.headers.get("authorization"))
            gw.check_admission()
            require_json(request)
            body = await read_body(request, config.max_body_bytes, config.body_timeout_s)
            p = await gw.prepare(api, body)
            lease = await gw.admit(key, p)
        except APIError as e:
            gw.metrics.count(endpoint, e.status)
            end_request_span(span, e.status)
            return error_response(e, _CLOSE if e.status in (408, 413) else None)
        except BaseException:
            end_request_span(span, 500)
            raise
        describe(span, p)
        if (trace_headers := headers_for(span)) is not None:
            p = replace(p, trace_headers=trace_headers)
        # From here the request is in flight until tracker.done(), which every path below reaches
        # (the SSE body's, or its on_close when the body never ran); done() gives the lease back.
        tracker = tracker_for(gw.metrics, endpoint, gw.releaser(lease, p), span)
        gw.record(p, endpoint, tracker)
        headers = {"X-Request-Id": p.generate.request_id}

        async def disconnected() -> None:
            # The body is read, so the next ASGI message can only be the disconnect.
            while (await request.receive())["type"] != "http.disconnect":
                pass

        try:
            if not p.stream:
                return JSONResponse(await gw.collect(p, tracker, disconnected), headers=headers)
            stream, first = await gw.start(p, disconnected)
        except APIError as e:
            tracker.done(e.status)
            return error_response(e, headers)
        except ClientDisconnected:
            log.info("%s: client disconnected before the response; aborted", p.generate.request_id)
            tracker.done(CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        except BaseException as e:  # answered by on_unexpected (500), or cancelled
            tracker.done(CLIENT_CLOSED if isinstance(e, asyncio.CancelledError) else 500)
            raise

        async def on_close() -> None:
            # Both idempotent: no-ops once the body has run to its end.
            await gw.close_stream(stream)
            tracker.done(CLIENT_CLOSED)

        return EventStreamResponse(
            sse_body(gw, p, stream, first, tracker), headers=headers, on_close=on_close
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate("completion", "completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate("chat", "chat_completions", request)

    register_websocket(app, gw)
    register_console(app, gw)
    return app


async def sse_body(
    gw: Gateway,
    p: Prepared,
    stream: GenerationStream,
    first: RequestOutput,
    tracker: RequestTracker,
) -> AsyncIterator[bytes]:
    """SSE framing of chunk_events: every item as ``data: {...}``, always ending with [DONE] (also
    after an error event), unless the client is gone."""
    events = gw.chunk_events(p, stream, first, tracker)
    try:
        async for item in events:
            yield sse_event(item)
        yield DONE
    finally:
        with anyio.CancelScope(shield=True):
            await events.aclose()
