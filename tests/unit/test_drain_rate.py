"""The queue's drain rate and the Retry-After it gives (services/scheduler/drain.py): measured over
busy time only, smoothed, without start-up bias, and rising when the queue stops draining."""

from __future__ import annotations

import pytest

from services.scheduler.drain import DrainRate


def drain_steadily(d: DrainRate, rate: float, seconds: float, num_queued: int, t0: float = 0.0):
    """A queue that holds ``num_queued`` requests while ``rate`` of them leave per second."""
    step = 1.0 / rate
    t = t0
    while t < t0 + seconds - 1e-9:
        t += step
        d.advance(t, num_queued)
        d.on_departures(1)
    return t


def test_a_steady_rate_is_measured_and_gives_the_time_to_drain_the_queue():
    d = DrainRate(tau_s=10.0)
    t = drain_steadily(d, rate=2.0, seconds=30.0, num_queued=20)
    # (Measured right after a departure: half a step's worth high, step / 2 tau = 2.5 %.)
    assert d.rate_per_s() == pytest.approx(2.0, rel=0.04)
    assert d.retry_after_s(20) == pytest.approx(10.0, rel=0.04)  # 20 queued at 2 per second
    assert d.retry_after_s(3) == pytest.approx(1.5, rel=0.04)
    # Idle time (nothing queued) does not count: the estimate carries over unchanged.
    rate = d.rate_per_s()
    d.advance(t + 600.0, 0)
    assert d.rate_per_s() == rate


def test_no_start_up_bias():
    """One departure after one busy second reads as one per second at once (an average starting
    from zero would read far less)."""
    d = DrainRate(tau_s=10.0)
    d.advance(0.0, 0)
    d.advance(1.0, 5)  # queued from t=0 ... the call at 1.0 closes the busy second
    d.on_departures(1)
    assert d.rate_per_s() == pytest.approx(1.0, rel=0.06)


def test_the_rate_follows_a_change_within_a_few_time_constants():
    d = DrainRate(tau_s=5.0)
    t = drain_steadily(d, rate=10.0, seconds=30.0, num_queued=8)
    assert d.rate_per_s() == pytest.approx(10.0, rel=0.04)
    drain_steadily(d, rate=2.0, seconds=25.0, num_queued=8, t0=t)  # five time constants
    assert d.rate_per_s() == pytest.approx(2.0, rel=0.12)
    assert d.retry_after_s(8) == pytest.approx(4.0, rel=0.12)


def test_before_any_departure_and_when_draining_stops():
    d = DrainRate(tau_s=10.0, fallback_s=1.0, max_retry_after_s=120.0)
    assert d.rate_per_s() is None and d.retry_after_s(10) == 1.0  # nothing measured: fallback
    d.advance(0.0, 0)
    d.advance(3.0, 4)  # 4 waited 3 s and none left: at best one per 3 s
    assert d.retry_after_s(4) == pytest.approx(12.0)
    # Draining, then stuck: the rate decays while busy time grows, so Retry-After rises to the cap.
    d = DrainRate(tau_s=10.0, max_retry_after_s=120.0)
    t = drain_steadily(d, rate=4.0, seconds=20.0, num_queued=40)
    before = d.retry_after_s(40)
    d.advance(t + 30.0, 40)
    assert before == pytest.approx(10.0, rel=0.04) and d.retry_after_s(40) > 5 * before
    d.advance(t + 300.0, 40)
    assert d.retry_after_s(40) == 120.0


def test_retry_after_is_at_least_a_second_and_config_is_checked():
    d = DrainRate()
    drain_steadily(d, rate=100.0, seconds=20.0, num_queued=1)
    assert d.retry_after_s(1) == 1.0  # 10 ms to drain: the header's smallest value
    for bad in ({"tau_s": 0}, {"fallback_s": 0}, {"min_retry_after_s": 5, "max_retry_after_s": 1}):
        with pytest.raises(ValueError):
            DrainRate(**bad)
