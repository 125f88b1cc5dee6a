"""``python -m services.gateway``: the OpenAI-compatible HTTP/WebSocket edge.

Config from flags, with environment fallbacks (NATS_URL, LLMSERVE_MODEL_NAME, LLMSERVE_GATEWAY_HOST,
LLMSERVE_GATEWAY_PORT, LLMSERVE_MAX_BODY_BYTES, LLMSERVE_KEEP_ALIVE_TIMEOUT); secrets from the
environment or a file only: the API key (LLMSERVE_API_KEY, --api-key-file) and the NATS password
(NATS_USER / NATS_PASSWORD, --nats-password-file).
It loads no model files: the executors name logprobs tokens. SIGTERM/SIGINT: new requests get 503,
running ones get up to --drain-timeout, then end with an error event (server.py); then the app's
lifespan drains the NATS connection.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from services.runtime import service_name, setup_logging
from shared.tracing import setup_tracing

from .config import build_parser, config_from_args


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("LLMSERVE_LOG_LEVEL", args.log_level)
    setup_logging("gateway")
    try:
        tracer_provider = setup_tracing(service_name("gateway"))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import uvicorn

    from .app import create_app
    from .server import UVICORN_GRACE_S, GatewayServer, IdleClosingHttpProtocol

    app = create_app(config)
    uvicorn_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=args.log_level.lower(),
        access_log=args.access_log,
        # Our drain (server.py) ends every request first; uvicorn's is only a backstop.
        timeout_graceful_shutdown=UVICORN_GRACE_S,
        # Idle connections, and connections that never complete a request head, are closed
        # after this (an SSE stream sends its own bytes; this is for the gaps between requests).
        timeout_keep_alive=config.keep_alive_timeout_s,  # type: ignore[arg-type]
        http=IdleClosingHttpProtocol,
        ws_max_size=config.max_body_bytes,  # a bigger WebSocket message: close 1009
    )
    try:
        GatewayServer(uvicorn_config, app.state.gateway, config.drain_timeout_s).run()
    finally:
        if tracer_provider is not None:
            tracer_provider.shutdown()  # exports the spans still buffered
    return 0


if __name__ == "__main__":
    sys.exit(main())
