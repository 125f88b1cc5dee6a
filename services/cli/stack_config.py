"""What a stack runs (``StackConfig``) and each service's command line derived from it.

The launcher (``launcher.py``) starts processes with these command lines; nothing here starts
anything. No secret and no server URL is part of a command line (``ps`` shows argv to every user):
the launcher passes those by environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from services.cli.credentials import StackCredentials
from services.cli.servers import LOOPBACK, free_port
from services.executor.config import SERVED_ENGINE_DEFAULTS
from services.scheduler.placement import ROUTING_POLICIES
from services.served_models import ServedModel, check_unique, default_model_name
from services.tokenizer.config import TOKENIZER_LIMIT_SETTINGS
from shared.engine.config import EngineConfig
from shared.field_checks import require_at_least, require_positive


@dataclass(frozen=True)
class StackConfig:
    # Every executor's engine; its model (and max_model_len, block_size) also the tokenizers' and
    # the gateway's. num_threads None: the cores divided among the executors
    # (``_executor_threads``).
    engine: EngineConfig = SERVED_ENGINE_DEFAULTS
    model_name: str | None = None  # name served at /v1/models (default: from the model)
    # Several models at once: each gets num_executors executors running ``engine`` with its path.
    # Empty: the one model of engine.model / model_name. Given: those two stay None, so a stack
    # names its models one way only (``served_models``).
    models: tuple[ServedModel, ...] = ()
    host: str = LOOPBACK
    # The first gateway's port (0 = a free port for each); gateway i listens on port + i.
    port: int = 8000
    num_gateways: int = 1
    num_executors: int = 1  # role 'both', per model
    num_prefill: int = 0  # role 'prefill' executors per model (disaggregation)
    num_decode: int = 0  # role 'decode' executors per model
    # Cores of each executor, by executor index (empty: no pinning); e.g. ((0,), (1,)).
    executor_cpus: tuple[tuple[int, ...], ...] = ()
    # Disaggregation (with num_prefill > 0): each executor's KV handoff limit, offer to last ack
    # (services/executor/handoff.py), and the schedulers' thresholds (services/scheduler/disagg.py).
    kv_transfer_timeout_s: float = 10.0
    disagg_min_uncached_tokens: int = 256
    disagg_max_prefill_queue_tokens: int = 16384
    num_tokenizers: int = 1
    num_schedulers: int = 1
    num_prefix_indexes: int = 1  # prefix index replicas (0: none; the schedulers route by load)
    max_queue_len: int = 256
    routing: str = "cache"  # the schedulers' placement policy (services/scheduler/placement.py)
    max_queued: int | None = None  # each executor accepts max_num_seqs + this (None: twice)
    heartbeat_timeout_s: float = 2.0
    no_executor_timeout_s: float = 10.0  # queued requests get 503 after this long without executors
    api_key: str | None = field(default=None, repr=False)  # never printed
    # The servers' users (``llmserve credentials DIR``), each service getting its kind's, also on
    # servers given by URL. None: fresh ones for the servers started here; one given by URL
    # keeps its own rules, and the services find its credentials in the environment.
    credentials: StackCredentials | None = field(default=None, repr=False)
    request_timeout_s: float | None = None
    nats_url: str | None = None  # use these servers instead of starting our own
    redis_url: str | None = None
    log_dir: str | None = None  # children's stderr to <log_dir>/<name>.log; None = ours
    ready_timeout_s: float = 180.0
    drain_timeout_s: float = 5.0  # in-flight requests get this long on shutdown
    extra_env: tuple[tuple[str, str], ...] = ()
    # Start a local Prometheus (scraping every gateway) and trace backend where installed
    # (observability.py); the services then export their traces to it.
    observability: bool = False

    def __post_init__(self) -> None:
        require_at_least(self, 1, "num_gateways", "num_tokenizers", "num_schedulers")
        if min(self.num_executors, self.num_prefill, self.num_decode) < 0:
            raise ValueError("num_executors, num_prefill and num_decode must be >= 0")
        if self.num_executors + self.num_decode < 1:
            raise ValueError("a stack needs at least one executor that decodes (both or decode)")
        if self.executor_cpus and len(self.executor_cpus) != num_executors_total(self):
            raise ValueError(
                f"executor_cpus names {len(self.executor_cpus)} executors' cores; the stack runs "
                f"{num_executors_total(self)} executors"
            )
        require_at_least(self, 0, "num_prefix_indexes", "max_queue_len", "drain_timeout_s")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.port and self.port + self.num_gateways > 65536:
            raise ValueError(
                f"{self.num_gateways} gateways from port {self.port} run past port 65535"
            )
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if self.max_queued is not None and self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if min(self.disagg_min_uncached_tokens, self.disagg_max_prefill_queue_tokens) < 0:
            raise ValueError(
                "disagg_min_uncached_tokens and disagg_max_prefill_queue_tokens must be >= 0"
            )
        require_positive(
            self,
            "heartbeat_timeout_s",
            "no_executor_timeout_s",
            "ready_timeout_s",
            "kv_transfer_timeout_s",
        )
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.models:
            if self.engine.model is not None or self.model_name is not None:
                raise ValueError(
                    "give the served models either as models or as engine.model / model_name, "
                    "not both"
                )
            # A tokenizer's command line pairs paths and names by position: no path may be left
            # out unless it is the only model (then the default, resolved by each service).
            if len(self.models) > 1 and any(m.path is None for m in self.models):
                raise ValueError("with several models, every model needs its path")
            check_unique(self.models)

    @property
    def executors_per_model(self) -> int:
        return self.num_executors + self.num_prefill + self.num_decode

    def executor_role(self, local_index: int) -> str:
        """The role of a model's executor ``local_index``: 'both' ones, then prefill, then
        decode."""
        if local_index < self.num_executors:
            return "both"
        return "prefill" if local_index < self.num_executors + self.num_prefill else "decode"

    @classmethod
    def of(cls, **settings: Any) -> StackConfig:
        """A StackConfig from the keywords of StackConfig and EngineConfig alike (tests,
        benchmarks): ``StackConfig.of(port=0, num_kv_blocks=128)``; engine settings not given keep
        the served defaults."""
        engine_names = {f.name for f in fields(EngineConfig)}
        engine = {k: settings.pop(k) for k in list(settings) if k in engine_names}
        return cls(engine=replace(SERVED_ENGINE_DEFAULTS, **engine), **settings)


def served_models(config: StackConfig) -> tuple[ServedModel, ...]:
    """Every model the stack serves, in order: ``config.models``, else the one model of
    ``engine.model`` named ``model_name`` (or after its file)."""
    if config.models:
        return config.models
    name = config.model_name or default_model_name(config.engine.model)
    return (ServedModel(name, config.engine.model),)


def served_model_name(config: StackConfig) -> str:
    """The name clients send in ``model`` for the stack's (first) model."""
    return served_models(config)[0].name


def num_executors_total(config: StackConfig) -> int:
    return config.executors_per_model * len(served_models(config))


def _executor_threads(config: StackConfig) -> int:
    if config.engine.num_threads is not None:
        return config.engine.num_threads
    # Executors on one machine share its cores; they must not each take all of them.
    return max(1, (os.cpu_count() or 1) // num_executors_total(config))


def executor_args(config: StackConfig, index: int) -> list[str]:
    """Executor ``index``'s command line (the NATS URL comes by environment): its whole engine
    config included.
    Indices run over every model's executors in turn (model k has ``k * num_executors`` to
    ``(k + 1) * num_executors - 1``), so ids are unique across models and carry no model name (a
    name may hold a '.', which an id, part of NATS subjects, must not)."""
    models = served_models(config)
    if not 0 <= index < num_executors_total(config):
        raise ValueError(f"executor index {index} out of range for {len(models)} model(s)")
    model = models[index // config.executors_per_model]
    cpus = config.executor_cpus[index] if config.executor_cpus else ()
    threads = len(cpus) if cpus and config.engine.num_threads is None else None
    engine = replace(
        config.engine, model=model.path, num_threads=threads or _executor_threads(config)
    )
    return [
        "--executor-id",
        f"executor-{index}",
        "--role",
        config.executor_role(index % config.executors_per_model),
        *(["--cpus", ",".join(map(str, cpus))] if cpus else []),
        "--model-name",
        model.name,
        "--drain-timeout",
        str(config.drain_timeout_s),
        "--kv-transfer-timeout",
        str(config.kv_transfer_timeout_s),
        *([] if config.max_queued is None else ["--max-queued", str(config.max_queued)]),
        *engine.to_argv(),
    ]


def scheduler_args(config: StackConfig) -> list[str]:
    """A scheduler's command line (the NATS URL comes by environment)."""
    return [
        "--max-queue-len",
        str(config.max_queue_len),
        "--heartbeat-timeout",
        str(config.heartbeat_timeout_s),
        "--no-executor-timeout",
        str(config.no_executor_timeout_s),
        "--routing",
        config.routing,
        "--disagg-min-uncached-tokens",
        str(config.disagg_min_uncached_tokens),
        "--disagg-max-prefill-queue-tokens",
        str(config.disagg_max_prefill_queue_tokens),
    ]


def tokenizer_args(config: StackConfig) -> list[str]:
    """A tokenizer's command line (the NATS URL comes by environment): every served model (paths
    and names, paired by position) and the prompt limits of the executors' engine."""
    argv: list[str] = []
    for m in served_models(config):
        # No path only for a lone default model: the tokenizer resolves it as the executors do.
        argv += ["--model", m.path] if m.path is not None else []
        argv += ["--model-name", m.name]
    return argv + config.engine.to_argv(include=TOKENIZER_LIMIT_SETTINGS)


def gateway_name(index: int) -> str:
    """The first gateway is "gateway" (as with one), the others "gateway-1", "gateway-2"..."""
    return "gateway" if index == 0 else f"gateway-{index}"


def gateway_ports(config: StackConfig) -> list[int]:
    """Each gateway's port: consecutive from ``config.port``, or free ones when it is 0. Separate
    ports rather than one shared with SO_REUSEPORT: each gateway stays addressable (its /health,
    its /metrics for Prometheus, a request to a chosen one), and a load balancer in front spreads
    clients over them."""
    if config.port:
        return [config.port + i for i in range(config.num_gateways)]
    ports: list[int] = []
    while len(ports) < config.num_gateways:
        port = free_port(config.host)
        if port not in ports:
            ports.append(port)
    return ports


def gateway_model_args(config: StackConfig) -> list[str]:
    return [arg for m in served_models(config) for arg in ("--model-name", m.name)]
