"""Cache- and load-aware placement and the admission protocol of the scheduler's router
(services.scheduler.placement, executors, router), synchronously: the cost of uncached prefill
against load, reported load plus what was routed since the report, refusals that re-queue at the
old place, unreachable executors, round robin, and several replicas sharing executors."""

from __future__ import annotations

import collections
import itertools

import msgspec
import pytest
from test_scheduler_router import dispatched, failed, hb, make, progress

from services.scheduler.placement import CostWeights
from services.scheduler.router import Dispatch, Router
from shared.wire.messages import (
    ExecuteReply,
    ExecutorLoad,
    SamplingParams,
    TokenizedRequest,
)

BS = 16


def prompt_req(rid: str, num_tokens: int = 160, n: int = 1) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=rid,
        model="m",
        prompt_token_ids=list(range(num_tokens)),
        block_hashes=list(range(num_tokens // BS)),
        params=SamplingParams(n=n, max_tokens=4),
    )


def load(version: int, admitted: int, max_admitted: int = 4) -> ExecutorLoad:
    return ExecutorLoad(version=version, num_admitted=admitted, max_admitted=max_admitted)


def reply(executor_id: str, accepted: bool, ld: ExecutorLoad, epoch: str = "e1") -> ExecuteReply:
    return ExecuteReply(executor_id=executor_id, epoch=epoch, accepted=accepted, load=ld)


def with_load(executor_id: str, ld: ExecutorLoad, **kw):
    return msgspec.structs.replace(hb(executor_id, **kw), load=ld)


def test_cache_aware_prefers_the_holder_until_load_outweighs_the_prefix():
    r = make(max_queue_len=8, weights=CostWeights(sequence_cost_tokens=64.0))
    for e in ("a", "b"):
        r.on_heartbeat(with_load(e, load(0, 0, max_admitted=8)), 0.0)
    # b holds 8 of the 10 blocks: 32 uncached tokens against a's 160.
    cached = {"b": 8}
    got = [dispatched(r.submit(prompt_req(f"r{i}"), 0.0, 0.0, cached))[0][0] for i in range(4)]
    # b costs 32 + 64 x its load, a 160 + 64 x its load: b takes the first two (32, 96 < 160);
    # the third is a tie at 160 that the lower load (a's) wins; the fourth costs b 160, a 224.
    assert got == ["b", "b", "a", "b"]


def test_without_an_index_answer_it_routes_by_load():
    r = make(max_queue_len=8)
    for e in ("a", "b"):
        r.on_heartbeat(with_load(e, load(0, 0, max_admitted=8)), 0.0)
    got = [dispatched(r.submit(prompt_req(f"r{i}"), 0.0, 0.0, None))[0][0] for i in range(4)]
    assert got == ["a", "b", "a", "b"]


def test_round_robin_ignores_cache_and_load():
    r = make(max_queue_len=8, routing="round_robin")
    for e in ("a", "b", "c"):
        r.on_heartbeat(with_load(e, load(0, 0, max_admitted=8)), 0.0)
    got = [dispatched(r.submit(prompt_req(f"r{i}"), 0.0, 0.0, {"c": 10}))[0][0] for i in range(5)]
    assert got == ["a", "b", "c", "a", "b"]


def test_reported_load_plus_unreported_routed_bounds_the_executor():
    r = make(max_queue_len=8)
    # Another replica already filled 3 of a's 4 places: this one may add one, then must queue.
    r.on_heartbeat(with_load("a", load(7, 3)), 0.0)
    assert dispatched(r.submit(prompt_req("r0"), 0.0, 0.0)) == [("a", "r0")]
    assert dispatched(r.submit(prompt_req("r1"), 0.0, 0.0)) == []
    assert r.num_queued == 1
    # The accepting reply reports 4 held, r0 included: still full, nothing counted twice.
    assert r.on_dispatch_reply("r0", reply("a", True, load(8, 4)), 0.0) == []
    assert r.executors["a"].load_estimate() == 4
    # Another replica's request finishes: the progress report frees a place at once.
    other = msgspec.structs.replace(progress("x", "a", "finished"), load=load(9, 3))
    assert dispatched(r.on_progress(other, 0.0)) == [("a", "r1")]
    # An older report (a heartbeat sent before) does not undo the newer one.
    r.on_heartbeat(with_load("a", load(8, 4)), 0.0)
    assert r.executors["a"].reported == load(9, 3)
    assert r.executors["a"].load_estimate() == 4  # 3 reported + r1 not yet acknowledged


def test_refused_dispatch_waits_again_at_its_old_place():
    r = make(max_queue_len=8)
    r.on_heartbeat(with_load("a", load(0, 0, max_admitted=1)), 0.0)
    assert dispatched(r.submit(prompt_req("first"), 0.0, 0.0)) == [("a", "first")]
    # Another replica's request got there first: a refuses, reporting itself full.
    assert r.on_dispatch_reply("first", reply("a", False, load(1, 1, max_admitted=1)), 0.0) == []
    assert r.num_queued == 1 and r.num_refused_dispatches == 1
    r.submit(prompt_req("second"), 0.0, 0.0)
    # Room again: the refused request goes first.
    freed = msgspec.structs.replace(progress("x", "a", "finished"), load=load(2, 0, 1))
    assert dispatched(r.on_progress(freed, 0.0)) == [("a", "first")]


def test_unreachable_executor_is_skipped_until_it_heartbeats():
    r = make(max_queue_len=8)
    for e in ("a", "b"):
        r.on_heartbeat(with_load(e, load(0, 0)), 0.0)
    assert dispatched(r.submit(prompt_req("r0"), 0.0, 0.0)) == [("a", "r0")]
    rerouted = r.on_dispatch_unreachable("r0", "a", 0.0)
    assert dispatched(rerouted) == [("b", "r0")]
    assert isinstance(rerouted[0], Dispatch) and rerouted[0].request.attempt == 1
    assert dispatched(r.submit(prompt_req("r1"), 0.0, 0.0)) == [("b", "r1")]
    r.on_heartbeat(with_load("a", load(0, 0)), 0.1)
    assert dispatched(r.submit(prompt_req("r2"), 0.1, 0.0)) == [("a", "r2")]


def test_reply_of_a_restarted_executor_is_ignored():
    r = make(max_queue_len=8)
    r.on_heartbeat(with_load("a", load(0, 0)), 0.0)
    r.submit(prompt_req("r0"), 0.0, 0.0)
    assert r.on_dispatch_reply("r0", reply("a", False, load(1, 1), epoch="e2"), 0.0) == []
    assert "r0" in r.executors["a"].in_flight


def _replica_round(
    replicas: list[Router], executor_load: dict[str, int], cap: int, ids: itertools.count
) -> None:
    """Every replica submits a request; the executors answer as the real one does (refuse past
    ``cap``); no executor ever holds more than ``cap``."""
    pending: collections.deque[tuple[Router, Dispatch]] = collections.deque()

    def queue(r: Router, actions) -> None:
        for action in actions:
            assert isinstance(action, Dispatch)
            pending.append((r, action))

    for r in replicas:
        queue(r, r.submit(prompt_req(f"q{next(ids)}"), 0.0, 0.0))
    while pending:  # a refusal may place the request on the other executor: answered in turn
        r, a = pending.popleft()
        held = executor_load[a.executor_id]
        accepted = held + 1 <= cap
        executor_load[a.executor_id] = held + accepted
        answer = reply(a.executor_id, accepted, load(next(ids), executor_load[a.executor_id], cap))
        queue(r, r.on_dispatch_reply(a.request.request_id, answer, 0.0))
        assert executor_load[a.executor_id] <= cap


@pytest.mark.parametrize("rounds", [1, 5])
def test_three_replicas_never_push_an_executor_past_its_cap(rounds):
    cap = 3
    replicas = [make(max_queue_len=64) for _ in range(3)]
    held = {"a": 0, "b": 0}
    for r in replicas:
        for e in held:
            r.on_heartbeat(with_load(e, load(0, 0, cap)), 0.0)
    ids = itertools.count()
    for _ in range(rounds):
        _replica_round(replicas, held, cap, ids)
    # Filled to the cap on both, the rest waits in the replicas' queues.
    assert held == {"a": cap, "b": cap} if rounds * 3 >= 2 * cap else sum(held.values()) == 3
    assert sum(r.num_queued for r in replicas) == max(0, rounds * 3 - 2 * cap)
    assert not any(failed(r.tick(0.0, 0.0)) for r in replicas)


def test_prefill_pending_at_the_holder_can_send_a_request_elsewhere():
    r = make(max_queue_len=8)
    busy = ExecutorLoad(version=1, num_admitted=1, max_admitted=8, num_pending_prefill_tokens=400)
    r.on_heartbeat(with_load("a", busy), 0.0)
    r.on_heartbeat(with_load("b", load(0, 0, max_admitted=8)), 0.0)
    # a holds 8 of the 10 blocks but has 400 tokens to prefill first: 400 + 32 + 64 > 160.
    [action] = r.submit(prompt_req("r0"), 0.0, 0.0, {"a": 8})
    assert isinstance(action, Dispatch) and action.executor_id == "b"
    # The executor is told what the index expected it to hold, here nothing of the prompt.
    assert action.request.num_expected_cached_tokens == 0
    # Without that backlog the holder wins, and is told of its 128 cached tokens.
    r.on_heartbeat(with_load("a", load(2, 1, max_admitted=8)), 0.0)
    [action] = r.submit(prompt_req("r1"), 0.0, 0.0, {"a": 8})
    assert isinstance(action, Dispatch) and action.executor_id == "a"
    assert action.request.num_expected_cached_tokens == 128
    # r0's prefill counts at b until b reports it or it starts.
    assert r.executors["b"].pending_prefill_estimate() == 160
    r.on_progress(progress("r0", "b", "started"), 0.0)
    assert r.executors["b"].pending_prefill_estimate() == 0
