"""The console's pure parts: the request table (request_log.py), the executors' heartbeats
(executor_board.py), the state they assemble (console_state.py), the planner's arguments, and the
executor's memory ledger (services/executor/memory_status.py)."""

from __future__ import annotations

import fnmatch
import json
import tomllib
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

from services.cli import main
from services.executor.memory_status import memory_status, planned_ledger
from services.gateway.console_routes import _plan_args
from services.gateway.console_state import console_state
from services.gateway.errors import APIError
from services.gateway.executor_board import ExecutorBoard
from services.gateway.request_log import RequestLog, RequestRecord
from shared.engine.config import EngineConfig
from shared.engine.memory import plan_memory, weight_bytes
from shared.engine.models.known_configs import KNOWN_CONFIGS, resolve_model
from shared.engine.plan_report import plan_report
from shared.wire.messages import (
    EXECUTOR_HEARTBEAT,
    ExecutorHeartbeat,
    ExecutorMemory,
    ExecutorStatus,
    PrefixIndexStatus,
    SchedulerStatus,
)
from shared.wire.outputs import EngineStats


def record(rid: str = "r1", started: float = 100.0) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        endpoint="chat_completions",
        model="m",
        stream=True,
        max_tokens=8,
        created_at=1.7e9,
        started=started,
    )


def stats(**overrides) -> EngineStats:
    base = dict(
        num_running=2,
        num_waiting=1,
        num_total_blocks=100,
        num_free_blocks=70,
        kv_cache_usage=0.3,
        prefix_cache_queries_tokens=0,
        prefix_cache_hits_tokens=0,
        num_preemptions=0,
        num_prompt_tokens=0,
        num_computed_tokens=0,
        num_generated_tokens=0,
        num_steps=0,
        last_step_num_tokens=0,
    )
    return EngineStats(**{**base, **overrides})


def heartbeat(sent_at: float, epoch: str = "e1", **stat_overrides) -> ExecutorHeartbeat:
    return ExecutorHeartbeat(
        executor_id="executor-0",
        epoch=epoch,
        role="both",
        model="m",
        max_model_len=2048,
        block_size=16,
        stats=stats(**stat_overrides),
        sent_at=sent_at,
    )


# -- the request table -----------------------------------------------------------------------------


def test_a_record_follows_its_request_from_dispatch_to_done():
    r = record()
    assert r.state == "dispatched" and not r.ended
    r.on_accepted()
    assert (r.state, r.holder) == ("accepted", "tokenizer")
    r.on_keepalive("scheduler-0", "queued")
    assert (r.state, r.holder) == ("queued", "scheduler-0")
    r.on_keepalive("executor-0", "waiting")
    r.on_tokens(0, 100.5)  # an output without tokens: no first token yet
    assert r.ttft_s is None and r.state == "waiting"
    r.on_tokens(1, 100.75)
    assert (r.state, r.ttft_s, r.num_tokens) == ("streaming", 0.75, 1)
    r.on_keepalive("executor-0", "running")  # trails the first token: not a state change
    assert r.state == "streaming"
    r.on_tokens(3, 101.0)
    r.done(200, 102.0, num_prompt_tokens=12, finish_reasons=[None, "length"])
    assert (r.state, r.status, r.e2e_s, r.num_tokens) == ("done", 200, 2.0, 4)
    assert (r.num_prompt_tokens, r.finish_reason) == (12, "length")
    r.done(499, 103.0)  # once only
    r.on_tokens(5, 103.0)
    r.on_keepalive("x", "queued")
    assert (r.state, r.status, r.num_tokens, r.holder) == ("done", 200, 4, "executor-0")
    row = r.as_json(now=110.0)
    assert row["age_s"] == 10.0 and row["request_id"] == "r1" and json.dumps(row)


@pytest.mark.parametrize("status, state", [(499, "cancelled"), (504, "error"), (429, "error")])
def test_a_record_ends_as_what_its_status_says(status, state):
    r = record()
    r.done(status, 101.0)
    assert r.state == state and r.ttft_s is None


def test_the_request_table_is_bounded_and_newest_first():
    log = RequestLog(capacity=3)
    for i in range(5):
        log.add(record(f"r{i}"))
    assert len(log) == 3
    assert [r.request_id for r in log.newest_first()] == ["r4", "r3", "r2"]
    assert log.get("r0") is None and log.get("r4") is not None
    with pytest.raises(ValueError):
        RequestLog(capacity=0)


# -- the executors' heartbeats ---------------------------------------------------------------------


def test_the_board_keeps_two_heartbeats_per_epoch_and_forgets_the_silent():
    board = ExecutorBoard(stale_after_s=5.0)
    board.put(heartbeat(1000.0), now=10.0)
    [s] = board.live(now=11.0)
    assert s.previous is None
    board.put(heartbeat(1000.5), now=10.5)
    [s] = board.live(now=11.0)
    assert s.previous is not None and s.previous.sent_at == 1000.0
    board.put(heartbeat(1001.0, epoch="e2"), now=11.0)  # restarted: its old counters mean nothing
    [s] = board.live(now=11.0)
    assert s.previous is None and s.heartbeat.epoch == "e2"
    assert board.live(now=16.5) == []
    with pytest.raises(ValueError):
        ExecutorBoard(stale_after_s=0)


def test_state_of_an_executor_with_rates_memory_and_the_schedulers_view():
    board = ExecutorBoard()
    board.put(
        heartbeat(1000.0, num_steps=10, num_computed_tokens=100, num_generated_tokens=40), 10.0
    )
    memory = ExecutorMemory(
        memory_budget_bytes=2 << 30,
        weight_dtype="float32",
        kv_dtype="float32",
        planned_weight_bytes=500,
        planned_activation_bytes=200,
        planned_kv_cache_bytes=300,
        planned_num_kv_blocks=3,
        weight_bytes=510,
        kv_cache_bytes=300,
        num_kv_blocks=3,
        kv_bytes_per_block=100,
        process_rss_bytes=4096,
    )
    later = msgspec.structs.replace(
        heartbeat(
            1000.5,
            num_steps=14,
            num_computed_tokens=120,
            num_generated_tokens=44,
            prefix_cache_queries_tokens=64,
            prefix_cache_hits_tokens=48,
            num_preemptions=1,
            num_cached_blocks=9,
        ),
        memory=memory,
    )
    board.put(later, 10.5)
    routed = ExecutorStatus(
        executor_id="executor-0",
        model="m",
        num_free_blocks=70,
        num_total_blocks=100,
        num_running=2,
        num_waiting=1,
        num_in_flight=3,
        last_heartbeat_age_s=0.1,
    )
    scheduler = SchedulerStatus(executors=[routed], num_queued=2, max_queue_len=256)
    log = RequestLog()
    log.add(record("r1", started=10.0))
    state = console_state(
        now=11.0,
        wall_time=1.7e9,
        gateway={"instance": "gateway-x"},
        executors=board.live(11.0),
        scheduler=scheduler,
        prefix_index=None,
        requests=log.newest_first(),
    )
    assert json.loads(json.dumps(state)) == state  # JSON as it is
    [e] = state["executors"]
    assert e["heartbeat_age_s"] == 0.5
    assert e["kv"] == {
        "num_total_blocks": 100,
        "num_used_blocks": 30,
        "num_free_blocks": 70,
        "num_cached_blocks": 9,
        "usage": 0.3,
    }
    assert e["batch"]["tokens_per_step"] == 5.0  # 20 tokens over 4 steps
    assert e["batch"]["generated_tokens_per_s"] == 8.0  # 4 tokens in 0.5 s
    assert e["batch"]["num_preemptions"] == 1
    assert e["prefix_cache"]["hit_rate"] == 0.75
    assert e["scheduler_view"]["num_in_flight"] == 3
    rows = {r["item"]: (r["planned"], r["actual"]) for r in e["memory"]["rows"]}
    assert rows == {"weights": (500, 510), "activations": (200, None), "kv cache": (300, 300)}
    assert e["memory"]["planned_total_bytes"] == 1000
    assert state["scheduler"]["available"] and state["scheduler"]["num_queued"] == 2
    assert "executors" not in state["scheduler"]
    assert state["prefix_index"] == {"available": False, "error": "not running"}
    assert [r["request_id"] for r in state["requests"]] == ["r1"]


def test_state_before_any_rate_and_with_services_down():
    board = ExecutorBoard()
    board.put(heartbeat(1000.0), 10.0)
    index = PrefixIndexStatus(
        redis_ok=True,
        num_executors=1,
        num_block_entries=12,
        num_batches_applied=3,
        num_replays=0,
        num_resyncs=0,
        num_purges=0,
        last_apply_lag_s=0.01,
    )
    state = console_state(
        now=10.0,
        wall_time=0.0,
        gateway={},
        executors=board.live(10.0),
        scheduler="The scheduler did not answer.",
        prefix_index=index,
        requests=[],
    )
    [e] = state["executors"]
    assert e["batch"]["tokens_per_step"] is None and e["batch"]["generated_tokens_per_s"] is None
    assert e["prefix_cache"]["hit_rate"] is None and e["memory"] is None
    assert e["scheduler_view"] is None
    assert state["scheduler"] == {"available": False, "error": "The scheduler did not answer."}
    assert state["prefix_index"]["available"] and state["prefix_index"]["num_block_entries"] == 12


def test_a_heartbeat_from_before_the_ledger_still_decodes():
    old = msgspec.msgpack.encode(
        {k: v for k, v in msgspec.structs.asdict(heartbeat(1.0)).items() if k != "memory"}
    )
    hb = EXECUTOR_HEARTBEAT.decode(old)
    assert hb.memory is None and hb.stats.num_cached_blocks == 0


# -- the planner -----------------------------------------------------------------------------------


def test_the_console_plans_what_llmserve_plan_prints(capsys):
    query = {
        "model": "llama-3-8b",
        "memory": "24GB",
        "dtype": "bfloat16",
        "kv_dtype": "fp8",
        "block_size": "32",
        "max_num_batched_tokens": "512",
        "max_num_seqs": "64",
        "context": "8192",
    }
    console = plan_report(**_plan_args(query))
    argv = ["plan", "--model", "llama-3-8b", "--memory", "24GB", "--dtype", "bfloat16"]
    argv += ["--kv-dtype", "fp8", "--block-size", "32", "--max-num-batched-tokens", "512"]
    argv += ["--max-num-seqs", "64", "--context", "8192", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == console
    assert console["readable"]["memory_budget_bytes"] == "22.35 GiB"


def test_the_default_model_is_the_bundled_one():
    args = _plan_args({"memory": "2GiB"})
    assert args["model"] is None and "block_size" not in args
    report = plan_report(**args)
    assert report["num_params"] > 100_000_000 and report["shape"]["num_layers"] == 30


@pytest.mark.parametrize(
    "query, param",
    [
        ({"memory": "1GiB", "model": "/etc/passwd"}, "model"),
        ({"memory": "1GiB", "model": "../x.gguf"}, "model"),
        ({}, "memory"),
        ({"memory": "9" * 40}, "memory"),
        ({"memory": "1GiB", "block_size": "0"}, "block_size"),
        ({"memory": "1GiB", "max_num_seqs": "-1"}, "max_num_seqs"),
        ({"memory": "1GiB", "context": "1e9"}, "context"),
        ({"memory": "1GiB", "context": "9" * 13}, "context"),
        ({"memory": "1GiB", "quantization": "int3"}, "quantization"),
    ],
)
def test_planner_arguments_are_bounded(query, param):
    with pytest.raises(APIError) as err:
        _plan_args(query)
    assert err.value.status == 400 and err.value.param == param


# -- the executor's ledger -------------------------------------------------------------------------


class FakeEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = KNOWN_CONFIGS["smollm2-135m"]
        self.max_model_len = 2048

    def resident_weight_bytes(self) -> int:
        return 123_456_789

    def kv_cache_bytes(self) -> int:
        return 50 * 4096

    def num_kv_blocks(self) -> int:
        return 50


def test_the_executor_reports_the_plan_for_its_settings_and_what_it_holds():
    config = EngineConfig(memory_budget="1GiB", dtype="float32", max_num_batched_tokens=256)
    m = memory_status(FakeEngine(config))
    plan = plan_memory(
        KNOWN_CONFIGS["smollm2-135m"],
        memory_budget_bytes=1 << 30,
        weight_dtype="float32",
        kv_dtype="float32",
        block_size=config.block_size,
        max_num_batched_tokens=256,
        max_num_seqs=config.max_num_seqs,
        context_len=2048,
    )
    assert (m.planned_weight_bytes, m.planned_activation_bytes) == (
        plan.weight_bytes,
        plan.activation_bytes,
    )
    assert (m.planned_kv_cache_bytes, m.planned_num_kv_blocks) == (
        plan.kv_cache_bytes,
        plan.num_kv_blocks,
    )
    assert (m.weight_bytes, m.kv_cache_bytes, m.num_kv_blocks) == (123_456_789, 204800, 50)
    assert m.kv_bytes_per_block == 4096 and m.memory_budget_bytes == 1 << 30
    assert m.max_num_batched_tokens == 256
    # Sized by a block count: nothing was planned.
    by_count = memory_status(FakeEngine(replace(config, num_kv_blocks=50)))
    assert by_count.memory_budget_bytes == 0 and by_count.planned_kv_cache_bytes == 0
    too_small = replace(config, memory_budget="1MiB")
    assert planned_ledger(too_small, KNOWN_CONFIGS["smollm2-135m"], 2048) is None


def test_a_gguf_executor_plans_with_its_files_block_formats():
    """``quantization="gguf"`` weighs each linear by its format in the file: the executor reads
    the formats from its model's header, as ``llmserve plan`` does."""
    config = EngineConfig(memory_budget="1GiB", quantization="gguf")
    model = resolve_model(None)
    plan = planned_ledger(config, model.config, 2048)
    assert plan is not None
    assert plan.weight_bytes == weight_bytes(
        model.config, "bfloat16", None, "gguf", model.gguf_formats, "q8_0"
    )


def test_every_console_file_is_package_data():
    """An installed wheel serves the same page: each file under services/gateway/console/ matches
    one of pyproject's package-data globs."""
    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["services.gateway"]
    package = root / "services" / "gateway"
    files = [p.relative_to(package).as_posix() for p in (package / "console").rglob("*")]
    assert "console/index.html" in files
    assert [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)] == []
