"""``python -m services.gateway``: the OpenAI-compatible HTTP/WebSocket edge.

Config from flags, with environment fallbacks (NATS_URL, LLMSERVE_API_KEY, LLMSERVE_MODEL_NAME,
LLMSERVE_GATEWAY_HOST, LLMSERVE_GATEWAY_PORT). It loads no model files: the executors name logprobs
tokens. SIGTERM/SIGINT: uvicorn stops accepting, lets in-flight
requests finish (up to --drain-timeout), then the app's lifespan drains the NATS connection.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from services.runtime import env_bool, env_int, env_str, setup_logging

from .config import GatewayConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__.split("\n")[0])
    p.add_argument("--nats-url", default=env_str("NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--host", default=env_str("LLMSERVE_GATEWAY_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=env_int("LLMSERVE_GATEWAY_PORT", 8000))
    p.add_argument("--model-name", default=env_str("LLMSERVE_MODEL_NAME", None),
                   help="the model name clients must send and /v1/models lists (default: the "
                        "names the live executors report)")
    p.add_argument("--api-key", default=env_str("LLMSERVE_API_KEY", None),
                   help="require 'Authorization: Bearer <key>' on /v1/* (env LLMSERVE_API_KEY)")
    p.add_argument("--access-log", action="store_true",
                   default=env_bool("LLMSERVE_ACCESS_LOG", False),
                   help="log every HTTP request (env LLMSERVE_ACCESS_LOG=1); off by default, as the "
                        "launcher's readiness polls of /health would fill the log")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="abort a request (504) that has not finished after this long")
    p.add_argument("--max-tokens-default", type=int, default=None,
                   help="max_tokens when a request gives none (default: 16 for completions, "
                        "until the context is full for chat)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests may take to finish")
    p.add_argument("--log-level", default=env_str("LLMSERVE_LOG_LEVEL", "info"))
    return p


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(nats_url=args.nats_url, host=args.host, port=args.port,
                         model_name=args.model_name, api_key=args.api_key,
                         request_timeout_s=args.request_timeout,
                         max_tokens_default=args.max_tokens_default)


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

    uvicorn.run(create_app(config), host=config.host, port=config.port,
                log_level=args.log_level.lower(), timeout_graceful_shutdown=args.drain_timeout,
                access_log=args.access_log,
                # Our SSE stream sends its own bytes often enough; uvicorn's keep-alive is for idle
                # connections between requests.
                timeout_keep_alive=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
