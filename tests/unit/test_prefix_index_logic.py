"""The prefix index's pure decisions (services/prefix_index/logic.py) and its config."""

from __future__ import annotations

import pytest

from services.prefix_index.config import PrefixIndexConfig, parse_config
from services.prefix_index.logic import (
    Counters,
    ExecutorTracker,
    GapAction,
    GapTracker,
    RedisHealth,
    encode_events,
    hash_tag_prefix,
)
from shared.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


def stored(*hashes: int) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=0
    )


def test_events_flatten_in_order_with_hashes_as_exact_strings():
    big = (1 << 63) - 1
    events: list[KVEvent] = [
        stored(1, big),
        BlockRemoved(block_hashes=[1]),
        AllBlocksCleared(),
        stored(7),
    ]
    assert encode_events(events) == ["S", "2", "1", str(big), "R", "1", "1", "C", "S", "1", "7"]
    # An empty store or removal says nothing; the order of what remains is kept.
    assert encode_events([stored(), BlockRemoved(block_hashes=[]), AllBlocksCleared()]) == ["C"]
    with pytest.raises(TypeError, match="unknown KV event"):
        encode_events([object()])  # type: ignore[list-item]


def test_a_gap_waits_while_the_executor_progresses_and_resyncs_once_it_stalls():
    g = GapTracker(stall_timeout_s=1.0, min_deliveries=3)
    # Applied seq 4 of epoch e1 when the gap is first seen: wait.
    assert g.on_gap("a", "e1", 4, num_delivered=1, now=0.0) is GapAction.WAIT
    assert g.on_gap("a", "e1", 4, num_delivered=2, now=0.5) is GapAction.WAIT
    # Another replica applied the next batches meanwhile: the clock starts again.
    assert g.on_gap("a", "e1", 6, num_delivered=3, now=0.9) is GapAction.WAIT
    assert g.on_gap("a", "e1", 6, num_delivered=9, now=1.8) is GapAction.WAIT
    # Stood still for the timeout over enough deliveries: the batch is lost.
    assert g.on_gap("a", "e1", 6, num_delivered=3, now=2.0) is GapAction.RESYNC
    # Not before enough deliveries, however long it stood.
    assert g.on_gap("b", "e1", 0, num_delivered=1, now=0.0) is GapAction.WAIT
    assert g.on_gap("b", "e1", 0, num_delivered=2, now=50.0) is GapAction.WAIT
    assert g.on_gap("b", "e1", 0, num_delivered=3, now=50.0) is GapAction.RESYNC
    # A new epoch at the same seq is progress too; so is any batch applied.
    assert g.on_gap("b", "e2", 0, num_delivered=5, now=60.0) is GapAction.WAIT
    g.on_progress("b")
    assert g.on_gap("b", "e2", 0, num_delivered=5, now=60.5) is GapAction.WAIT
    with pytest.raises(ValueError):
        GapTracker(stall_timeout_s=0.0, min_deliveries=1)


def test_tracker_expires_executors_silent_for_the_timeout():
    t = ExecutorTracker(timeout_s=3.0, check_interval_s=3.0)
    t.on_heartbeat("a", "e1", now=0.0)
    t.on_heartbeat("b", "e1", now=0.0)
    t.on_heartbeat("a", "e1", now=2.0)
    assert t.expired(2.9) == []
    assert t.expired(3.0) == [("b", "e1")]
    # Expired stays expired until the service has purged it and forgets it.
    assert t.expired(3.5) == [("b", "e1")]
    t.forget("b")
    assert t.expired(4.9) == [] and t.expired(5.0) == [("a", "e1")]
    assert "b" not in t and "a" in t


def test_executors_found_in_the_index_start_their_clock_when_first_seen():
    t = ExecutorTracker(timeout_s=3.0, check_interval_s=3.0)
    t.on_heartbeat("a", "e2", now=0.0)
    t.on_indexed({"a": "e1", "z": "e9"}, now=1.0)  # "a" is tracked already: its beat counts
    assert t.expired(3.5) == [("a", "e2")]
    assert t.expired(4.0) == [("a", "e2"), ("z", "e9")]
    t.on_indexed({"z": "e9"}, now=10.0)  # a second listing does not restart the clock
    assert ("z", "e9") in t.expired(10.0)


def test_heartbeats_ask_for_a_redis_check_on_a_new_epoch_or_when_due():
    t = ExecutorTracker(timeout_s=3.0, check_interval_s=2.0)
    assert t.on_heartbeat("a", "e1", now=0.0)  # first sight
    assert not t.on_heartbeat("a", "e1", now=0.5)
    assert not t.on_heartbeat("a", "e1", now=1.9)
    assert t.on_heartbeat("a", "e1", now=2.0)  # due again
    assert t.on_heartbeat("a", "e2", now=2.1)  # restarted
    assert not t.on_heartbeat("a", "e2", now=2.2)
    t.check_failed("a")  # Redis did not answer: ask at the next beat
    assert t.on_heartbeat("a", "e2", now=2.3)
    t.check_failed("nobody")  # harmless


def test_redis_health_reports_each_transition_once():
    h = RedisHealth()
    assert h.ok and h.recovered(0.0) is None
    assert h.failed(10.0) is True
    assert h.failed(11.0) is False and not h.ok
    assert h.recovered(12.5) == pytest.approx(2.5)
    assert h.ok and h.recovered(13.0) is None
    assert h.failed(14.0) is True


def test_status_carries_the_counters():
    c = Counters(num_batches_applied=5, num_replays=2, num_resyncs=1, num_purges=3)
    c.last_apply_lag_s = 0.25
    s = c.status(redis_ok=True, num_executors=4, num_entries=40)
    assert (s.redis_ok, s.num_executors, s.num_block_entries) == (True, 4, 40)
    assert (s.num_batches_applied, s.num_replays, s.num_resyncs, s.num_purges) == (5, 2, 1, 3)
    assert s.last_apply_lag_s == 0.25


def test_config_from_flags_over_environment(monkeypatch):
    monkeypatch.setenv("NATS_URL", "nats://n:1")
    monkeypatch.setenv("REDIS_URL", "redis://r:2/3")
    monkeypatch.setenv("LLMSERVE_EXECUTOR_TIMEOUT", "7.5")
    monkeypatch.setenv("LLMSERVE_PREFIX_INDEX_CONSUMER", "from_env")
    c = parse_config(["--consumer", "from_flag", "--key-prefix", "other:pi"])
    assert (c.nats_url, c.redis_url, c.executor_timeout_s) == ("nats://n:1", "redis://r:2/3", 7.5)
    assert (c.consumer, c.key_prefix) == ("from_flag", "other:pi")
    assert parse_config([]).consumer == "from_env"


@pytest.mark.parametrize(
    "field, value",
    [
        ("key_prefix", "{bad}"),
        ("key_prefix", ""),
        ("consumer", "a.b"),
        ("executor_timeout_s", 0.0),
        ("resync_after_deliveries", 0),
        ("max_match_blocks", 0),
    ],
)
def test_config_refuses_bad_values(field, value):
    with pytest.raises(ValueError):
        PrefixIndexConfig(nats_url="nats://x", redis_url="redis://x", **{field: value})


def test_every_key_shares_one_hash_tag():
    assert hash_tag_prefix("llmserve:pi") == "{llmserve:pi}"
    with pytest.raises(ValueError):
        hash_tag_prefix("a b")
