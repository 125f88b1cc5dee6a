"""The scheduler process's config, from flags over the environment (a flag beats its variable)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.runtime import env_float, env_int, env_str
from services.scheduler.router import RouterConfig


@dataclass(frozen=True)
class SchedulerConfig:
    nats_url: str
    router: RouterConfig
    tick_interval_s: float = 0.25
    name: str = "scheduler"

    def __post_init__(self) -> None:
        if not self.nats_url:
            raise ValueError("nats_url must not be empty")
        if self.tick_interval_s <= 0:
            raise ValueError(f"tick_interval_s must be > 0, got {self.tick_interval_s}")


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
    p.add_argument("--retry-after", type=float, default=1.0, help="Retry-After seconds on 429")
    p.add_argument("--name", default="scheduler", help="connection name")
    a = p.parse_args(argv)
    try:
        router = RouterConfig(
            max_queue_len=a.max_queue_len,
            heartbeat_timeout_s=a.heartbeat_timeout,
            no_executor_timeout_s=a.no_executor_timeout,
            max_in_flight_per_executor=a.max_in_flight,
            retry_after_s=a.retry_after,
        )
        return SchedulerConfig(nats_url=a.nats_url, router=router, name=a.name)
    except ValueError as e:
        p.error(str(e))
        raise
