"""The executor process's config: its engine's settings (declared once, in ``shared.engine.config``)
and its own, from flags over the environment (a flag beats its variable)."""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass, field

from services.connections import add_nats_auth_arguments, nats_auth_from_args
from services.runtime import env_bool, env_int, env_str, env_value
from services.served_models import default_model_name
from shared.engine.config import EngineConfig, add_engine_arguments
from shared.field_checks import require_at_least, require_positive
from shared.wire.bus_auth import BusAuth

# The engine defaults of a served executor, here and in ``llmserve up``: the same as the engine's
# (``LLM``, ``llmserve generate``) but a 2GiB budget, as a server's KV cache is its capacity.
SERVED_ENGINE_DEFAULTS = EngineConfig(memory_budget="2GiB")


@dataclass(frozen=True)
class ExecutorProcessConfig:
    nats_url: str
    executor_id: str
    model_name: str | None
    engine: EngineConfig
    heartbeat_interval_s: float
    drain_timeout_s: float
    kv_events: bool = True  # publish each step's KV cache events (off: they are dropped)
    max_queued: int | None = None  # accepted beyond max_num_seqs (None: max_num_seqs more)
    bus_auth: BusAuth = field(default_factory=BusAuth)  # who it is on NATS (services.connections)
    role: str = "both"  # see services.executor.service.ROLES
    cpus: tuple[int, ...] = ()  # pin the process to these cores (empty: no pinning)
    kv_transfer_timeout_s: float = 10.0
    mock_step_ms: float | None = None  # serve a MockEngine stepping this long instead of the model

    def __post_init__(self) -> None:
        if not self.nats_url:
            raise ValueError("nats_url must not be empty")
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if any(c < 0 for c in self.cpus):
            raise ValueError(f"cpus must be core numbers >= 0, got {self.cpus}")
        require_positive(self, "heartbeat_interval_s")
        require_at_least(self, 0, "drain_timeout_s")
        if self.mock_step_ms is not None:
            if self.mock_step_ms <= 0:
                raise ValueError(f"mock_step_ms must be > 0, got {self.mock_step_ms}")
            if self.role != "both":
                raise ValueError(
                    f"a mock engine holds no KV pages to hand over: role both, not {self.role}"
                )
        if self.max_queued is not None and self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.executor",
        description="One engine (role 'both') serving ExecuteRequests over NATS.",
    )
    p.add_argument("--nats-url", default=env_str("NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument(
        "--executor-id",
        default=env_str("LLMSERVE_EXECUTOR_ID", None),
        help="unique id (default: a random one)",
    )
    p.add_argument(
        "--model-name",
        default=env_str("LLMSERVE_MODEL_NAME", None),
        help="the model name advertised to the gateway (default: the model file's name without "
        ".gguf, as the tokenizer and llmserve up name it)",
    )
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=5.0,
        help="on SIGTERM, seconds in-flight requests may take to finish",
    )
    p.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=env_bool("LLMSERVE_KV_EVENTS", True),
        help="publish each step's KV cache events for the prefix index (off: they are dropped) "
        "[env LLMSERVE_KV_EVENTS]",
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=env_int("LLMSERVE_MAX_QUEUED", None),
        help="requests (sequences) accepted beyond max_num_seqs, waiting in the engine; more are "
        "refused and routed elsewhere (default: max_num_seqs) [env LLMSERVE_MAX_QUEUED]",
    )
    p.add_argument(
        "--role",
        choices=("prefill", "decode", "both"),
        default=env_str("LLMSERVE_ROLE", "both"),
        help="prefill: run prompts and hand them to decode executors; decode: take handoffs; "
        "both: whole requests (and handoffs) [env LLMSERVE_ROLE]",
    )
    p.add_argument(
        "--cpus",
        default=env_str("LLMSERVE_CPUS", ""),
        help="cores to pin this process to, e.g. '0,1' or '2-3' (default: all) [env LLMSERVE_CPUS]",
    )
    p.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=10.0,
        help="seconds a KV handoff may take, offer to last ack, before it is given up",
    )
    p.add_argument(
        "--mock-step-ms",
        type=float,
        default=env_value("LLMSERVE_MOCK_STEP_MS", float),
        help="load no model: serve a mock engine whose every step takes this long and yields one "
        "token per running request, to load-test the other services "
        "[env LLMSERVE_MOCK_STEP_MS]",
    )
    add_nats_auth_arguments(p)
    add_engine_arguments(p, SERVED_ENGINE_DEFAULTS)
    return p


def parse_config(argv: list[str] | None = None) -> ExecutorProcessConfig:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        engine = EngineConfig.from_args(a, EngineConfig.from_env(env_value, SERVED_ENGINE_DEFAULTS))
        return ExecutorProcessConfig(
            nats_url=a.nats_url,
            executor_id=a.executor_id or f"executor-{uuid.uuid4().hex[:8]}",
            # The one naming rule of the stack, so a tokenizer started without names agrees.
            model_name=a.model_name or default_model_name(engine.model),
            engine=engine,
            heartbeat_interval_s=a.heartbeat_interval,
            drain_timeout_s=a.drain_timeout,
            kv_events=a.kv_events,
            max_queued=a.max_queued,
            bus_auth=nats_auth_from_args(a),
            role=a.role,
            cpus=parse_cpu_list(a.cpus),
            kv_transfer_timeout_s=a.kv_transfer_timeout,
            mock_step_ms=a.mock_step_ms,
        )
    except ValueError as e:
        p.error(str(e))
        raise


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0,2-3' -> (0, 2, 3); '' -> () (no pinning)."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"not a CPU list: {text!r} (e.g. '0,2-3')") from None
        if first < 0 or last < first:
            raise ValueError(f"not a CPU list: {text!r} (e.g. '0,2-3')")
        cpus.extend(range(first, last + 1))
    return tuple(dict.fromkeys(cpus))
