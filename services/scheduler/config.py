"""The scheduler process's config, from flags over the environment (a flag beats its variable)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from services.connections import add_nats_auth_arguments, nats_auth_from_args
from services.runtime import env_float, env_int, env_str
from services.scheduler.disagg import DisaggConfig
from services.scheduler.placement import ROUTING_POLICIES, CostWeights
from services.scheduler.router import RouterConfig
from shared.field_checks import require_positive
from shared.wire.bus_auth import BusAuth


@dataclass(frozen=True)
class SchedulerConfig:
    nats_url: str
    router: RouterConfig
    tick_interval_s: float = 0.25
    name: str = "scheduler"
    index_timeout_s: float = 0.05  # a prefix-index lookup slower than this is routed without it
    index_retry_s: float = 1.0  # after a failed lookup, route by load alone this long
    dispatch_timeout_s: float = 5.0  # an executor's answer to a dispatch
    bus_auth: BusAuth = field(default_factory=BusAuth)  # who it is on NATS (services.connections)

    def __post_init__(self) -> None:
        if not self.nats_url:
            raise ValueError("nats_url must not be empty")
        require_positive(
            self, "tick_interval_s", "index_timeout_s", "index_retry_s", "dispatch_timeout_s"
        )


def parse_config(argv: list[str] | None = None) -> SchedulerConfig:
    p = argparse.ArgumentParser(
        prog="python -m services.scheduler",
        description="Admission control and routing of tokenized requests.",
    )
    p.add_argument("--nats-url", default=env_str("NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument(
        "--max-queue-len",
        type=int,
        default=env_int("LLMSERVE_MAX_QUEUE_LEN", 256),
        help="requests waiting for an executor beyond this get 429",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=env_float("LLMSERVE_HEARTBEAT_TIMEOUT", 2.0),
        help="seconds without a heartbeat after which an executor is declared dead",
    )
    p.add_argument(
        "--no-executor-timeout",
        type=float,
        default=env_float("LLMSERVE_NO_EXECUTOR_TIMEOUT", 10.0),
        help="seconds with no live executor after which waiting requests get 503",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=env_int("LLMSERVE_MAX_IN_FLIGHT", None),
        help="sequences routed to one executor at once (default: its max_num_seqs)",
    )
    p.add_argument(
        "--retry-after",
        type=float,
        default=1.0,
        help="Retry-After seconds on 429 until the queue's drain rate is measured (then: the "
        "queue's length over that rate)",
    )
    p.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default=env_str("LLMSERVE_ROUTING", "cache"),
        help="placement: 'cache' (uncached prefill tokens plus load, from the prefix index), "
        "'load' (least loaded) or 'round_robin' [env LLMSERVE_ROUTING]",
    )
    p.add_argument(
        "--prefill-token-cost",
        type=float,
        default=env_float("LLMSERVE_PREFILL_TOKEN_COST", 1.0),
        help="cache routing: cost of one uncached prompt token [env LLMSERVE_PREFILL_TOKEN_COST]",
    )
    p.add_argument(
        "--sequence-cost-tokens",
        type=float,
        default=env_float("LLMSERVE_SEQUENCE_COST_TOKENS", 64.0),
        help="cache routing: cost of one sequence an executor holds, in prompt tokens "
        "[env LLMSERVE_SEQUENCE_COST_TOKENS]",
    )
    p.add_argument(
        "--index-timeout",
        type=float,
        default=env_float("LLMSERVE_INDEX_TIMEOUT", 0.05),
        help="seconds a prefix-index lookup may take before the request is routed by load alone",
    )
    p.add_argument(
        "--disagg-min-uncached-tokens",
        type=int,
        default=env_int("LLMSERVE_DISAGG_MIN_UNCACHED_TOKENS", 256),
        help="with prefill executors: prefill a prompt on its decode executor when fewer of its "
        "tokens than this are uncached there [env LLMSERVE_DISAGG_MIN_UNCACHED_TOKENS]",
    )
    p.add_argument(
        "--disagg-max-prefill-queue-tokens",
        type=int,
        default=env_int("LLMSERVE_DISAGG_MAX_PREFILL_QUEUE_TOKENS", 16384),
        help="with prefill executors: prefill locally when every prefill executor has more "
        "unstarted prefill tokens than this [env LLMSERVE_DISAGG_MAX_PREFILL_QUEUE_TOKENS]",
    )
    p.add_argument("--name", default="scheduler", help="connection name")
    add_nats_auth_arguments(p)
    a = p.parse_args(argv)
    try:
        router = RouterConfig(
            max_queue_len=a.max_queue_len,
            heartbeat_timeout_s=a.heartbeat_timeout,
            no_executor_timeout_s=a.no_executor_timeout,
            max_in_flight_per_executor=a.max_in_flight,
            retry_after_s=a.retry_after,
            routing=a.routing,
            weights=CostWeights(
                prefill_token_cost=a.prefill_token_cost,
                sequence_cost_tokens=a.sequence_cost_tokens,
            ),
            disagg=DisaggConfig(
                min_uncached_tokens=a.disagg_min_uncached_tokens,
                max_prefill_queue_tokens=a.disagg_max_prefill_queue_tokens,
            ),
        )
        return SchedulerConfig(
            nats_url=a.nats_url,
            router=router,
            name=a.name,
            index_timeout_s=a.index_timeout,
            bus_auth=nats_auth_from_args(a),
        )
    except ValueError as e:
        p.error(str(e))
        raise
