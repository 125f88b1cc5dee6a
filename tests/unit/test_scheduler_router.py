"""The scheduler's pure routing logic (services.scheduler.router), synchronously: least-loaded
choice, in-flight caps, the bounded queue (429), no executor (503), fail-over of a dead or restarted
executor (re-route before the first token, 502 after), aborts, deadlines and status."""

from __future__ import annotations

import pytest

from helpers.stats import engine_stats
from services.scheduler.router import Dispatch, Fail, Router, RouterConfig
from shared.wire.messages import (
    ExecutorHeartbeat,
    RequestProgress,
    SamplingParams,
    TokenizedRequest,
)


def hb(
    executor_id: str,
    *,
    epoch: str = "e1",
    free: int = 100,
    max_num_seqs: int = 2,
    draining: bool = False,
    role: str = "both",
    model: str = "m",
) -> ExecutorHeartbeat:
    stats = engine_stats(num_free_blocks=free)
    return ExecutorHeartbeat(
        executor_id=executor_id,
        epoch=epoch,
        role=role,
        model=model,
        max_model_len=2048,
        block_size=16,
        stats=stats,
        sent_at=0.0,
        max_num_seqs=max_num_seqs,
        draining=draining,
    )


def req(
    rid: str, *, priority: int = 0, n: int = 1, deadline: float | None = None, model: str = "m"
) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=rid,
        model=model,
        prompt_token_ids=[1, 2, 3],
        block_hashes=[7],
        params=SamplingParams(n=n, max_tokens=4),
        priority=priority,
        deadline=deadline,
    )


def progress(rid: str, executor_id: str, state: str) -> RequestProgress:
    return RequestProgress(request_id=rid, executor_id=executor_id, state=state)


def make(now: float = 0.0, **kw) -> Router:
    return Router(
        RouterConfig(
            **{"max_queue_len": 2, "heartbeat_timeout_s": 2.0, "no_executor_timeout_s": 5.0, **kw}
        ),
        now,
    )


def dispatched(actions) -> list[tuple[str, str]]:
    return [(a.executor_id, a.request.request_id) for a in actions if isinstance(a, Dispatch)]


def failed(actions) -> list[tuple[str, int]]:
    return [(a.error.request_id, a.error.status) for a in actions if isinstance(a, Fail)]


def test_least_loaded_then_most_free_blocks():
    r = make()
    r.on_heartbeat(hb("a", free=10), 0)
    r.on_heartbeat(hb("b", free=50), 0)
    assert dispatched(r.submit(req("1"), 0, 0)) == [("b", "1")]  # tie on load: more free blocks
    assert dispatched(r.submit(req("2"), 0, 0)) == [("a", "2")]  # b has one in flight now
    assert dispatched(r.submit(req("3"), 0, 0)) == [("b", "3")]
    # Load is counted from routing, before any heartbeat reflects it.
    assert {e.executor_id: e.num_in_flight for e in r.status(0).executors} == {"a": 1, "b": 2}


def test_routes_only_to_executors_serving_the_model():
    r = make()
    r.on_heartbeat(hb("a", model="m", free=10), 0)
    r.on_heartbeat(hb("b", model="other", free=99), 0)
    [d1] = r.submit(req("1"), 0, 0)
    assert isinstance(d1, Dispatch)
    assert (d1.executor_id, d1.request.model, d1.request.block_hashes) == ("a", "m", [7])
    assert dispatched(r.submit(req("2", model="other"), 0, 0)) == [("b", "2")]
    # a is full (cap 2): the next "m" request waits, and does not hold up "other"'s.
    assert dispatched(r.submit(req("3"), 0, 0)) == [("a", "3")]
    assert r.submit(req("4"), 0, 0) == [] and r.num_queued == 1
    assert dispatched(r.submit(req("5", model="other"), 0, 0)) == [("b", "5")]
    # Nobody serves "ghost": 404 model_not_found at once, naming what is served.
    [fail] = r.submit(req("6", model="ghost"), 0, 0)
    assert isinstance(fail, Fail) and (fail.error.status, fail.error.param) == (404, "model")
    assert "'ghost' does not exist" in fail.error.message and "'m, other'" in fail.error.message
    # "m" frees up: its queued request goes to a, never to b.
    assert dispatched(r.on_progress(progress("1", "a", "finished"), 1)) == [("a", "4")]
    # a stops reporting: queued "m" requests get 503 after the grace period, "other" keeps serving.
    assert r.submit(req("7"), 1, 1) == []
    r.on_heartbeat(hb("b", model="other"), 4)
    r.tick(4, 4)  # a is gone (silent > 2 s); its started-or-not requests fail over
    r.on_heartbeat(hb("b", model="other"), 9)
    assert ("7", 503) in failed(r.tick(9.5, 9.5))
    assert dispatched(r.on_progress(progress("2", "b", "finished"), 9.5)) == []
    assert dispatched(r.submit(req("8", model="other"), 9.5, 9.5)) == [("b", "8")]


def test_cap_queue_bound_429_and_drain_on_finish():
    r = make()
    r.on_heartbeat(hb("a", max_num_seqs=2), 0)
    assert dispatched(r.submit(req("1"), 0, 0)) == [("a", "1")]
    assert dispatched(r.submit(req("2"), 0, 0)) == [("a", "2")]
    assert r.submit(req("3"), 0, 0) == [] and r.submit(req("4"), 0, 0) == []  # queued (max 2)
    out = r.submit(req("5"), 0, 0)
    assert failed(out) == [("5", 429)]
    assert isinstance(out[0], Fail)
    assert out[0].error.retry_after_s == 1.0 and "max_queue_len=2" in out[0].error.message
    assert r.num_queued == 2
    assert r.on_progress(progress("1", "a", "started"), 0) == []
    assert dispatched(r.on_progress(progress("1", "a", "finished"), 0)) == [("a", "3")]
    assert dispatched(r.on_progress(progress("2", "a", "finished"), 0)) == [("a", "4")]
    assert r.num_queued == 0


def test_priority_orders_the_queue_and_n_weighs():
    r = make(max_queue_len=10)
    r.on_heartbeat(hb("a", max_num_seqs=4), 0)
    assert dispatched(r.submit(req("big", n=4), 0, 0)) == [("a", "big")]
    r.submit(req("low", priority=5), 0, 0)
    r.submit(req("high", priority=-1), 0, 0)
    assert dispatched(r.on_progress(progress("big", "a", "finished"), 0)) == [
        ("a", "high"),
        ("a", "low"),
    ]


def test_idle_executor_takes_a_request_heavier_than_its_cap():
    r = make()
    r.on_heartbeat(hb("a", max_num_seqs=2), 0)
    assert dispatched(r.submit(req("1", n=8), 0, 0)) == [("a", "1")]


def test_no_executor_queues_during_grace_then_503():
    r = make(now=0.0)
    assert r.submit(req("1"), 1.0, 0) == []  # executors may still be loading
    assert failed(r.tick(4.0, 0)) == []
    assert failed(r.tick(5.5, 0)) == [("1", 503)]
    out = r.submit(req("2"), 6.0, 0)
    assert failed(out) == [("2", 503)]
    assert isinstance(out[0], Fail) and "no executor" in out[0].error.message
    # An executor arriving clears the condition.
    r.on_heartbeat(hb("a"), 7.0)
    assert dispatched(r.submit(req("3"), 7.0, 0)) == [("a", "3")]


def test_queued_request_is_dispatched_when_executor_arrives():
    r = make()
    assert r.submit(req("1"), 0, 0) == []
    assert dispatched(r.on_heartbeat(hb("a"), 1.0)) == [("a", "1")]


def test_dead_executor_reroutes_unstarted_and_fails_started():
    r = make()
    r.on_heartbeat(hb("a", max_num_seqs=8), 0)
    r.submit(req("started"), 0, 0)
    r.submit(req("routed"), 0, 0)
    r.on_progress(progress("started", "a", "started"), 0)
    r.on_heartbeat(hb("b", max_num_seqs=8), 2.5)
    out = r.tick(2.5, 0)  # a silent for 2.5 s > 2 s
    assert failed(out) == [("started", 502)]
    assert isinstance(out[0], Fail) and "executor a" in out[0].error.message
    assert dispatched(out) == [("b", "routed")]
    retry = next(a for a in out if isinstance(a, Dispatch)).request
    assert retry.attempt == 1 and retry.prompt_token_ids == [1, 2, 3]
    assert [e.executor_id for e in r.status(2.5).executors] == ["b"]
    # A late 'finished' from the dead executor must not free b's slot.
    r.on_progress(progress("routed", "a", "finished"), 2.6)
    assert r.status(2.6).executors[0].num_in_flight == 1


def test_reroute_gives_up_after_max_attempts():
    r = make(max_attempts=2)
    r.on_heartbeat(hb("a"), 0)
    r.submit(req("1"), 0, 0)
    r.on_heartbeat(hb("b"), 2.5)
    assert dispatched(r.tick(2.5, 0)) == [("b", "1")]  # attempt 1
    assert failed(r.tick(5.0, 0)) == [("1", 503)]  # b silent too: attempts exhausted


def test_restarted_executor_new_epoch_loses_its_requests():
    r = make()
    r.on_heartbeat(hb("a", epoch="e1"), 0)
    r.submit(req("1"), 0, 0)
    r.submit(req("2"), 0, 0)
    r.on_progress(progress("1", "a", "started"), 0)
    out = r.on_heartbeat(hb("a", epoch="e2"), 1.0)
    assert failed(out) == [("1", 502)]
    assert dispatched(out) == [("a", "2")]  # re-routed to the restarted process
    assert r.status(1.0).executors[0].num_in_flight == 1


def test_draining_executor_gets_nothing_new():
    r = make()
    r.on_heartbeat(hb("a", draining=True), 0)
    r.on_heartbeat(hb("b"), 0)
    assert dispatched(r.submit(req("1"), 0, 0)) == [("b", "1")]


def test_abort_drops_queued_and_keeps_aborted_in_flight_from_failover():
    r = make(max_queue_len=5)
    r.on_heartbeat(hb("a", max_num_seqs=1), 0)
    r.submit(req("1"), 0, 0)
    r.submit(req("2"), 0, 0)
    r.submit(req("3"), 0, 0)
    r.abort("2", 0)
    assert r.num_queued == 1
    assert dispatched(r.on_progress(progress("1", "a", "finished"), 0)) == [("a", "3")]
    r.abort("3", 0)
    r.on_heartbeat(hb("b"), 2.5)
    assert r.tick(2.5, 0) == []  # aborted: neither re-routed nor failed


def test_deadlines_and_duplicate_submit():
    r = make()
    assert failed(r.submit(req("late", deadline=10.0), 0, wall_time=11.0)) == [("late", 504)]
    r.submit(req("q", deadline=20.0), 0, wall_time=11.0)
    assert failed(r.tick(1.0, wall_time=21.0)) == [("q", 504)]
    r.on_heartbeat(hb("a"), 1.0)
    assert dispatched(r.submit(req("x"), 1.0, 0)) == [("a", "x")]
    assert r.submit(req("x"), 1.0, 0) == []  # redelivered: not routed twice


def test_config_validation():
    with pytest.raises(ValueError, match="max_queue_len"):
        RouterConfig(max_queue_len=-1)
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        RouterConfig(heartbeat_timeout_s=0)


def test_retry_after_on_429_is_the_queue_over_its_measured_drain_rate():
    """One executor finishing a request every 2 s, a queue of 4 kept full: the 429's Retry-After
    is ~4 / 0.5 = 8 s, not the constant it starts from; the 503 of a queue with no executor left
    carries the same estimate, and the status reports the rate."""
    r = make(max_queue_len=4, no_executor_timeout_s=30.0)
    r.on_heartbeat(hb("a", max_num_seqs=1), 0)
    assert dispatched(r.submit(req("r0"), 0, 0)) == [("a", "r0")]
    for i in range(1, 5):
        assert r.submit(req(f"r{i}"), 0, 0) == []
    [fail] = r.submit(req("early"), 0, 0)
    assert isinstance(fail, Fail) and fail.error.retry_after_s == 1.0  # nothing measured yet
    running, t = "r0", 0.0
    for i in range(5, 20):  # a departure every 2 s; a new request takes each freed place
        t += 2.0
        r.on_heartbeat(hb("a", max_num_seqs=1), t)
        [d] = r.on_progress(progress(running, "a", "finished"), t)
        assert isinstance(d, Dispatch)
        running = d.request.request_id
        assert r.submit(req(f"r{i}"), t, t) == [] and r.num_queued == 4
    [fail] = r.submit(req("late"), t, t)
    assert isinstance(fail, Fail) and fail.error.status == 429
    assert fail.error.retry_after_s == pytest.approx(8.0, rel=0.15)
    status = r.status(t)
    assert status.drain_rate_per_s == pytest.approx(0.5, rel=0.15)
    assert status.retry_after_s == fail.error.retry_after_s
    assert set(r.queued_request_ids()) == {f"r{i}" for i in range(16, 20)}


def test_forget_requests_ends_the_queue_and_forgets_routed_ones():
    """The scheduler lost the bus: every queued request ends with a 503 (with Retry-After), and
    routed ones no longer count (their executor's own report does)."""
    r = make(max_queue_len=4)
    r.on_heartbeat(hb("a", max_num_seqs=1), 0)
    assert dispatched(r.submit(req("r0"), 0, 0)) == [("a", "r0")]
    assert r.submit(req("r1"), 0, 0) == [] and r.submit(req("r2"), 0, 0) == []
    actions = r.forget_requests(1.0)
    assert sorted(failed(actions)) == [("r1", 503), ("r2", 503)]
    assert all(isinstance(a, Fail) and a.error.retry_after_s for a in actions)
    assert r.num_queued == 0 and r.queued_request_ids() == []
    assert r.executors["a"].in_flight == {}
    # The executor has room again as far as this replica knows: a new request goes there.
    assert dispatched(r.submit(req("r3"), 1.0, 1.0)) == [("a", "r3")]
