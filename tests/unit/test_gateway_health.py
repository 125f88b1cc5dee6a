"""GET /health from the gateway's answers (services/gateway/health.py): the dependency that is down
is named; NATS, the tokenizer, the scheduler and a live executor are needed to serve (503), the
prefix index and Redis only for cache routing (200, reported)."""

from __future__ import annotations

import msgspec

from services.gateway.errors import service_unavailable
from services.gateway.health import health_report, nats_down_report
from shared.wire.messages import (
    ExecutorStatus,
    PrefixIndexStatus,
    SchedulerStatus,
    TokenizerModelStatus,
    TokenizerStatus,
)

EXECUTOR = ExecutorStatus(
    executor_id="executor-0",
    model="m",
    num_free_blocks=1,
    num_total_blocks=1,
    num_running=0,
    num_waiting=0,
    num_in_flight=0,
    last_heartbeat_age_s=0.1,
)
SCHEDULER = SchedulerStatus(executors=[EXECUTOR], num_queued=3, max_queue_len=8)
TOKENIZER = TokenizerStatus(
    models=[TokenizerModelStatus(name="m", max_model_len=64, block_size=16)]
)


def index(redis_ok: bool) -> PrefixIndexStatus:
    return PrefixIndexStatus(
        redis_ok=redis_ok,
        num_executors=1,
        num_block_entries=5,
        num_batches_applied=1,
        num_replays=0,
        num_resyncs=0,
        num_purges=0,
        last_apply_lag_s=0.0,
    )


def test_all_up():
    code, body = health_report(["m"], SCHEDULER, TOKENIZER, index(True))
    assert code == 200 and body["status"] == "ok" and body["num_queued"] == 3
    assert set(body["dependencies"].values()) == {"ok"}
    assert body["models"] == {"m": {"num_executors": 1, "max_model_len": 64}}


def test_redis_or_index_down_still_serves_and_says_so():
    code, body = health_report(["m"], SCHEDULER, TOKENIZER, index(False))
    assert code == 200 and body["dependencies"]["redis"] == "down"
    code, body = health_report(["m"], SCHEDULER, TOKENIZER, service_unavailable("no answer"))
    assert code == 200 and body["dependencies"]["prefix_index"] == "down"
    code, body = health_report(["m"], SCHEDULER, TOKENIZER, None)  # a stack without one
    assert code == 200 and body["dependencies"]["prefix_index"] == "none"


def test_what_is_needed_to_serve_is_named_when_down():
    down = service_unavailable("The scheduler did not answer.")
    code, body = health_report(["m"], down, TOKENIZER, None)
    assert code == 503 and body["reason"] == "The scheduler did not answer."
    assert body["dependencies"]["scheduler"] == "down" and body["dependencies"]["tokenizer"] == "ok"
    code, body = health_report(
        ["m"], SCHEDULER, service_unavailable("The tokenizer did not answer."), None
    )
    assert code == 503 and body["dependencies"]["tokenizer"] == "down"
    empty = SchedulerStatus(executors=[], num_queued=0, max_queue_len=8)
    code, body = health_report(["m"], empty, TOKENIZER, None)
    assert (code, body["reason"], body["dependencies"]["executors"]) == (
        503,
        "no live executor",
        "down",
    )
    body = nats_down_report("disconnected 1.2 s ago, reconnecting")
    assert "NATS" in body["reason"] and body["dependencies"] == {"nats": "down"}


def test_a_prefill_executor_alone_serves_nothing():
    prefill = msgspec.structs.replace(EXECUTOR, executor_id="executor-1", role="prefill")
    code, body = health_report(
        ["m"], SchedulerStatus(executors=[prefill], num_queued=0, max_queue_len=8), TOKENIZER, None
    )
    assert code == 503 and body["reason"] == "no live executor"
    code, body = health_report(
        ["m"],
        SchedulerStatus(executors=[EXECUTOR, prefill], num_queued=0, max_queue_len=8),
        TOKENIZER,
        None,
    )
    assert code == 200 and (body["num_executors"], body["num_prefill_executors"]) == (1, 1)
    assert body["executor_ids"] == ["executor-0", "executor-1"]  # prefill ones too
    assert body["models"]["m"]["num_executors"] == 1
