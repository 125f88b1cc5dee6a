"""Gateway configuration: one frozen dataclass, filled once from CLI flags over the environment
(``build_parser``, ``config_from_args``) and passed down explicitly."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from services.connections import (
    RedisAuth,
    add_nats_auth_arguments,
    add_redis_auth_arguments,
    nats_auth_from_args,
    redis_auth_from_args,
)
from services.runtime import (
    env_bool,
    env_float,
    env_int,
    env_str,
    read_secret_file,
    refuse_secret_flag,
)
from services.served_models import split_names
from shared.field_checks import require_at_least, require_positive
from shared.wire.bus_auth import BusAuth
from shared.wire.messages import KEEPALIVE_INTERVAL_S

from .api_keys import ApiKey, parse_api_keys

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class GatewayConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    host: str = "127.0.0.1"
    port: int = 8000
    # The model names requests may send and /v1/models lists. Empty: whatever model names the live
    # executors report in their heartbeats (learnt from the scheduler), so it follows the stack.
    model_names: tuple[str, ...] = ()
    bus_auth: BusAuth = field(default_factory=BusAuth)  # who it is on NATS (services.connections)
    api_key: str | None = field(default=None, repr=False)  # None: no auth; never printed
    # Keys of --api-keys-file, each with its limits (api_keys.py). Auth is on when any key is
    # configured; ``api_key`` (no limits) is accepted alongside them, named "default".
    api_keys: tuple[ApiKey, ...] = field(default=(), repr=False)
    # Where per-key limits are kept, shared by every replica (limiter.py). Needed when a key has
    # limits; None: no key may have any.
    redis_url: str | None = None
    redis_auth: RedisAuth = field(default_factory=RedisAuth)
    limits_key_prefix: str = "llmserve:gw"  # every Redis key of the limits starts with it
    # A concurrency slot not renewed for this long (its gateway died) is freed.
    limits_lease_ttl_s: float = 30.0
    limits_redis_timeout_s: float = 0.5  # a Redis call slower than this fails open
    request_timeout_s: float = 600.0  # whole request, first byte to last; then abort + 504
    # A request's stream silent this long (no output, error or keepalive: whoever holds it sends
    # one every KEEPALIVE_INTERVAL_S) is failed and aborted: 503 before its first output, 502
    # after. The bound on how long a client waits for anything once the process holding its
    # request died, whichever it was.
    progress_timeout_s: float = 10.0
    # How long a tokenizer may take to acknowledge a request (it does so on receipt): past it,
    # 503 and abort.
    ack_timeout_s: float = 5.0
    max_tokens_default: int | None = None  # None: 16 for completions (OpenAI), unlimited for chat
    health_timeout_s: float = 2.0  # scheduler status request of GET /health
    nats_connect_timeout_s: float = 30.0
    # A request body (or WebSocket message) over this is refused with 413 while it is being read,
    # never read whole. Below the bus's max_payload (8 MiB in `llmserve up`), so a request that
    # passes it also fits one NATS message; one that does not is a 413 too (generation.py).
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # The whole body must arrive within this long once its head has (408 otherwise, body.py).
    body_timeout_s: float = 30.0
    # An idle connection is closed after this long: between requests, and before its first
    # request's head is complete (server.py).
    keep_alive_timeout_s: float = 30.0
    # On SIGTERM: new requests get 503 at once; running ones get this long to finish, then end
    # with an error event (SSE) or message (WebSocket). See server.py.
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.nats_url.startswith(("nats://", "tls://", "ws://", "wss://")):
            raise ValueError(
                f"nats_url must be a nats:// (or tls/ws/wss) URL, got {self.nats_url!r}"
            )
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in self.model_names:
            if not name or any(c.isspace() for c in name):
                raise ValueError(f"a model name must be non-empty without spaces, got {name!r}")
        if len(set(self.model_names)) != len(self.model_names):
            raise ValueError(f"model names must be distinct, got {list(self.model_names)}")
        if self.api_key is not None and (
            not self.api_key or any(c.isspace() for c in self.api_key)
        ):
            raise ValueError("api_key must be non-empty and contain no whitespace (or be unset)")
        if any(k.limited for k in self.api_keys) and self.redis_url is None:
            raise ValueError(
                "API keys with limits need Redis to keep them in (--redis-url or REDIS_URL)"
            )
        if self.api_key is not None and any(k.name == "default" for k in self.api_keys):
            raise ValueError("the single API key is named 'default': no keys-file key may be")
        if not self.limits_lease_ttl_s > 0 or not self.limits_redis_timeout_s > 0:
            raise ValueError("limits_lease_ttl_s and limits_redis_timeout_s must be > 0")
        if not self.limits_key_prefix or any(c in self.limits_key_prefix for c in " {}*?"):
            raise ValueError(f"limits_key_prefix {self.limits_key_prefix!r}: no spaces, {{}}, *, ?")
        require_at_least(self, 1024, "max_body_bytes")
        require_at_least(self, 0, "drain_timeout_s")
        if self.progress_timeout_s < 3 * KEEPALIVE_INTERVAL_S:
            raise ValueError(
                f"progress_timeout_s must be >= {3 * KEEPALIVE_INTERVAL_S:g} (three keepalive "
                f"intervals), got {self.progress_timeout_s}"
            )
        require_positive(
            self,
            "request_timeout_s",
            "ack_timeout_s",
            "health_timeout_s",
            "nats_connect_timeout_s",
            "keep_alive_timeout_s",
            "body_timeout_s",
        )
        if self.max_tokens_default is not None and self.max_tokens_default < 1:
            raise ValueError(
                f"max_tokens_default must be >= 1 (or unset), got {self.max_tokens_default}"
            )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.gateway",
        description="The OpenAI-compatible HTTP/WebSocket edge of llmserve.",
    )
    p.add_argument("--nats-url", default=env_str("NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--host", default=env_str("LLMSERVE_GATEWAY_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=env_int("LLMSERVE_GATEWAY_PORT", 8000))
    p.add_argument(
        "--model-name",
        action="append",
        default=None,
        help="a model name clients may send and /v1/models lists; repeat it for several models "
        "(default: $LLMSERVE_MODEL_NAME, comma-separated, else the names the live executors "
        "report)",
    )
    add_nats_auth_arguments(p)
    add_api_key_arguments(p)
    p.add_argument(
        "--api-keys-file",
        default=env_str("LLMSERVE_API_KEYS_FILE", None),
        metavar="PATH",
        help='API keys with per-key limits, one JSON object a line: {"key": ..., "name": '
        '..., "requests_per_minute": 60, "tokens_per_minute": 20000, "max_concurrent": '
        "4} (limits optional; env LLMSERVE_API_KEYS_FILE); limits are kept in Redis",
    )
    p.add_argument(
        "--redis-url",
        default=env_str("REDIS_URL", None),
        help="Redis holding the per-key limits, shared by every gateway replica (env REDIS_URL)",
    )
    add_redis_auth_arguments(p)
    p.add_argument(
        "--limits-lease-ttl",
        type=float,
        default=env_float("LLMSERVE_LIMITS_LEASE_TTL", 30.0),
        metavar="SECONDS",
        help="a concurrency slot its gateway stopped renewing is freed after this long "
        "(env LLMSERVE_LIMITS_LEASE_TTL)",
    )
    p.add_argument(
        "--access-log",
        action="store_true",
        default=env_bool("LLMSERVE_ACCESS_LOG", False),
        help="log every HTTP request (env LLMSERVE_ACCESS_LOG=1); off by default, as the "
        "launcher's readiness polls of /health would fill the log",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="abort a request (504) that has not finished after this long",
    )
    p.add_argument(
        "--progress-timeout",
        type=float,
        default=env_float("LLMSERVE_PROGRESS_TIMEOUT", 10.0),
        metavar="SECONDS",
        help="fail (503, or 502 once output began) and abort a request whose stream has been "
        "silent this long: no output, error or keepalive from whoever holds it "
        f"(keepalives come every {KEEPALIVE_INTERVAL_S:g} s; env LLMSERVE_PROGRESS_TIMEOUT)",
    )
    p.add_argument(
        "--ack-timeout",
        type=float,
        default=env_float("LLMSERVE_ACK_TIMEOUT", 5.0),
        metavar="SECONDS",
        help="503 when no tokenizer acknowledges a request within this long "
        "(env LLMSERVE_ACK_TIMEOUT)",
    )
    p.add_argument(
        "--max-tokens-default",
        type=int,
        default=None,
        help="max_tokens when a request gives none (default: 16 for completions, "
        "until the context is full for chat)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long in-flight requests may take to finish before they are ended "
        "with an error (new requests get 503 meanwhile)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=env_int("LLMSERVE_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES),
        metavar="BYTES",
        help="refuse (413) a request body or WebSocket message larger than this "
        "(env LLMSERVE_MAX_BODY_BYTES; default 4 MiB)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=env_float("LLMSERVE_BODY_TIMEOUT", 30.0),
        metavar="SECONDS",
        help="answer 408 when a request body takes longer than this to arrive "
        "(env LLMSERVE_BODY_TIMEOUT)",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=env_float("LLMSERVE_KEEP_ALIVE_TIMEOUT", 30.0),
        metavar="SECONDS",
        help="close a connection idle this long, between requests or before its first one "
        "(env LLMSERVE_KEEP_ALIVE_TIMEOUT)",
    )
    p.add_argument("--log-level", default=env_str("LLMSERVE_LOG_LEVEL", "info"))
    return p


ENV_API_KEY = "LLMSERVE_API_KEY"


def add_api_key_arguments(p: argparse.ArgumentParser) -> None:
    """The API key comes from the environment or a file, never from argv (the gateway's and
    ``llmserve up``'s)."""
    p.add_argument(
        "--api-key-file",
        default=env_str("LLMSERVE_API_KEY_FILE", None),
        metavar="PATH",
        help=f"require 'Authorization: Bearer <key>' on /v1/*, the key being this file's first "
        f"line [env LLMSERVE_API_KEY_FILE; or the key itself in env {ENV_API_KEY}]",
    )
    refuse_secret_flag(p, "--api-key", f"set {ENV_API_KEY} or use --api-key-file")


def api_key_from_args(args: argparse.Namespace) -> str | None:
    """The key of --api-key-file, else of $LLMSERVE_API_KEY, else None (no auth). ValueError for
    an unreadable or empty file."""
    if args.api_key_file is not None:
        return read_secret_file(args.api_key_file, "API key")
    return env_str(ENV_API_KEY, None)


def api_keys_from_args(args: argparse.Namespace) -> tuple[ApiKey, ...]:
    """The keys of --api-keys-file (none without it); ValueError naming the line at fault."""
    if args.api_keys_file is None:
        return ()
    try:
        with open(args.api_keys_file) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the API keys file: {e.strerror or e}") from None
    return parse_api_keys(text, args.api_keys_file)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    # The flag's list, else the variable's names (an appending flag cannot default to them:
    # argparse would append to the default).
    names = args.model_name or split_names(env_str("LLMSERVE_MODEL_NAME", None))
    return GatewayConfig(
        nats_url=args.nats_url,
        host=args.host,
        port=args.port,
        model_names=tuple(names),
        bus_auth=nats_auth_from_args(args),
        api_key=api_key_from_args(args),
        api_keys=api_keys_from_args(args),
        redis_url=args.redis_url,
        redis_auth=redis_auth_from_args(args),
        limits_lease_ttl_s=args.limits_lease_ttl,
        request_timeout_s=args.request_timeout,
        progress_timeout_s=args.progress_timeout,
        ack_timeout_s=args.ack_timeout,
        max_tokens_default=args.max_tokens_default,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        drain_timeout_s=args.drain_timeout,
    )
