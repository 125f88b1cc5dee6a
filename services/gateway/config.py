"""Gateway configuration: one frozen dataclass, filled once from CLI flags and environment
(``__main__.py``) and passed down explicitly."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    host: str = "127.0.0.1"
    port: int = 8000
    # The model name requests must send and /v1/models lists. None: whatever model names the live
    # executors report in their heartbeats (learnt from the scheduler), so it follows the stack.
    model_name: str | None = None
    api_key: str | None = None                 # None: no auth
    request_timeout_s: float = 600.0           # whole request, first byte to last; then abort + 504
    max_tokens_default: int | None = None      # None: 16 for completions (OpenAI), unlimited for chat
    health_timeout_s: float = 2.0              # scheduler status request of GET /health
    nats_connect_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.nats_url.startswith(("nats://", "tls://", "ws://", "wss://")):
            raise ValueError(f"nats_url must be a nats:// (or tls/ws/wss) URL, got {self.nats_url!r}")
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.model_name is not None and (not self.model_name
                                            or any(c.isspace() for c in self.model_name)):
            raise ValueError(f"model_name must be a non-empty name without spaces, got {self.model_name!r}")
        if self.api_key is not None and (not self.api_key or any(c.isspace() for c in self.api_key)):
            raise ValueError("api_key must be non-empty and contain no whitespace (or be unset)")
        for name in ("request_timeout_s", "health_timeout_s", "nats_connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_tokens_default is not None and self.max_tokens_default < 1:
            raise ValueError(f"max_tokens_default must be >= 1 (or unset), got {self.max_tokens_default}")
