"""``python -m services.gateway``: the OpenAI-compatible HTTP/WebSocket edge.

Config from flags, with environment fallbacks (NATS_URL, LLMSERVE_API_KEY, LLMSERVE_MODEL_NAME,
LLMSERVE_GATEWAY_HOST, LLMSERVE_GATEWAY_PORT). It loads no model files: the executors name logprobs
tokens. SIGTERM/SIGINT: uvicorn stops accepting, lets in-flight
requests finish (up to --drain-timeout), then the app's lifespan drains the NATS connection.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from services.runtime import setup_logging

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

    import uvicorn

    from .app import create_app

    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=args.drain_timeout,
        access_log=args.access_log,
        # Our SSE stream sends its own bytes often enough; uvicorn's keep-alive is for idle
        # connections between requests.
        timeout_keep_alive=30,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
