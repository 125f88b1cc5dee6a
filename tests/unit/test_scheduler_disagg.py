"""The scheduler's disaggregation choice (services.scheduler.disagg, through the router): a long
uncached prompt goes to a prefill executor with its decode executor named; short prompts, n > 1,
a deep prefill queue or no prefill executor keep the prefill local; decisions are counted; the
decode executor's 'adopted' moves the request to it (its death then ends the request)."""

from __future__ import annotations

import pytest

from helpers.stats import engine_stats
from services.scheduler.disagg import DisaggConfig
from services.scheduler.router import Dispatch, Fail, Router, RouterConfig
from shared.wire.messages import (
    ExecutorHeartbeat,
    ExecutorLoad,
    RequestProgress,
    SamplingParams,
    TokenizedRequest,
)


def hb(executor_id: str, role: str, pending_prefill: int = 0) -> ExecutorHeartbeat:
    return ExecutorHeartbeat(
        executor_id=executor_id,
        epoch="e1",
        role=role,
        model="m",
        max_model_len=4096,
        block_size=16,
        stats=engine_stats(),
        sent_at=0.0,
        max_num_seqs=8,
        load=ExecutorLoad(
            version=1,
            num_admitted=0,
            max_admitted=16,
            num_pending_prefill_tokens=pending_prefill,
        ),
    )


def req(rid: str, num_tokens: int, n: int = 1) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=rid,
        model="m",
        prompt_token_ids=list(range(num_tokens)),
        block_hashes=[0] * (num_tokens // 16),
        params=SamplingParams(n=n, max_tokens=4),
    )


def router(*heartbeats: ExecutorHeartbeat, **disagg) -> Router:
    r = Router(RouterConfig(disagg=DisaggConfig(**disagg)), 0.0)
    for h in heartbeats:
        r.on_heartbeat(h, 0.0)
    return r


def only_dispatch(actions) -> Dispatch:
    (action,) = actions
    assert isinstance(action, Dispatch)
    return action


def test_a_long_uncached_prompt_is_prefilled_on_the_prefill_executor():
    r = router(hb("p", "prefill"), hb("d", "decode"), min_uncached_tokens=100)
    d = only_dispatch(r.submit(req("a", 500), 0.0, 0.0))
    assert (d.executor_id, d.request.decode_executor_id, d.decision) == ("p", "d", "disaggregated")
    assert r.disagg_decisions == {"disaggregated": 1}


def test_decode_side_prefix_hits_count_against_the_threshold():
    r = router(hb("p", "prefill"), hb("d", "decode"), min_uncached_tokens=100)
    # The decode executor holds 28 of the 31 blocks: 52 tokens uncached there.
    d = only_dispatch(r.submit(req("a", 500), 0.0, 0.0, cached_blocks={"d": 28}))
    assert (d.executor_id, d.request.decode_executor_id, d.decision) == ("d", None, "short_prompt")


@pytest.mark.parametrize(
    ("num_tokens", "n", "pending", "decision"),
    [
        (50, 1, 0, "short_prompt"),
        (500, 2, 0, "multiple_choices"),
        (500, 1, 10_000, "prefill_queue_long"),
    ],
)
def test_local_prefill_when_it_does_not_pay(num_tokens, n, pending, decision):
    r = router(
        hb("p", "prefill", pending_prefill=pending),
        hb("d", "decode"),
        min_uncached_tokens=100,
        max_prefill_queue_tokens=5000,
    )
    d = only_dispatch(r.submit(req("a", num_tokens, n), 0.0, 0.0))
    assert (d.executor_id, d.request.decode_executor_id, d.decision) == ("d", None, decision)
    assert r.disagg_decisions == {decision: 1}


def test_without_prefill_executors_nothing_changes():
    r = router(hb("d", "both"))
    d = only_dispatch(r.submit(req("a", 5000), 0.0, 0.0))
    assert (d.executor_id, d.request.decode_executor_id, d.decision) == ("d", None, "")
    assert r.disagg_decisions == {}


def test_adoption_moves_the_request_to_the_decode_executor():
    r = router(hb("p", "prefill"), hb("d", "decode"), min_uncached_tokens=0)
    only_dispatch(r.submit(req("a", 500), 0.0, 0.0))
    assert "a" in r.executors["p"].in_flight
    p = lambda ex, state: RequestProgress(request_id="a", executor_id=ex, state=state)  # noqa: E731
    r.on_progress(p("p", "started"), 0.1)
    r.on_progress(p("d", "adopted"), 0.2)
    assert "a" not in r.executors["p"].in_flight and "a" in r.executors["d"].in_flight
    assert r.on_progress(p("p", "finished"), 0.3) == []
    assert "a" in r.executors["d"].in_flight
    # The decode executor goes silent: the started request ends with a 502.
    r.on_heartbeat(hb("p", "prefill"), 2.5)
    actions = r.tick(2.6, 2.6)
    assert [a.error.status for a in actions if isinstance(a, Fail)] == [502]


def test_a_prefill_executor_dying_before_its_first_token_reroutes():
    r = router(hb("p", "prefill"), hb("d", "decode"), min_uncached_tokens=0)
    only_dispatch(r.submit(req("a", 500), 0.0, 0.0))
    r.on_heartbeat(hb("d", "decode"), 2.5)
    d = only_dispatch(r.tick(2.6, 2.6))
    # The prefill executor is gone (forgotten): its decode executor prefills the request itself.
    assert (d.executor_id, d.request.attempt, d.request.decode_executor_id) == ("d", 1, None)


def test_a_handoff_finished_before_adopted_still_moves_the_request():
    r = router(hb("p", "prefill"), hb("d", "decode"), min_uncached_tokens=0)
    only_dispatch(r.submit(req("a", 500), 0.0, 0.0))
    r.on_progress(RequestProgress(request_id="a", executor_id="p", state="started"), 0.1)
    # Progress from two executors is not ordered: the prefill side's 'finished' comes first.
    r.on_progress(
        RequestProgress(request_id="a", executor_id="p", state="finished", handed_to="d"), 0.2
    )
    assert "a" not in r.executors["p"].in_flight and "a" in r.executors["d"].in_flight
    r.on_progress(RequestProgress(request_id="a", executor_id="d", state="adopted"), 0.3)
    assert "a" in r.executors["d"].in_flight
    # The decode executor goes silent: the request ends with a 502 at the scheduler's tick, not
    # at the gateway's progress timeout.
    r.on_heartbeat(hb("p", "prefill"), 2.5)
    actions = r.tick(2.6, 2.6)
    assert [a.error.status for a in actions if isinstance(a, Fail)] == [502]
    # and the decode executor's own 'finished' frees the slot
    r2 = router(hb("p", "prefill"), hb("d", "decode"), min_uncached_tokens=0)
    only_dispatch(r2.submit(req("a", 500), 0.0, 0.0))
    r2.on_progress(
        RequestProgress(request_id="a", executor_id="p", state="finished", handed_to="d"), 0.2
    )
    r2.on_progress(RequestProgress(request_id="a", executor_id="d", state="finished"), 0.3)
    assert not r2.executors["p"].in_flight and not r2.executors["d"].in_flight


def test_the_status_lists_prefill_executors_with_their_role():
    r = router(hb("p", "prefill"), hb("d", "decode"))
    assert {e.executor_id: e.role for e in r.status(0.1).executors} == {
        "p": "prefill",
        "d": "decode",
    }
