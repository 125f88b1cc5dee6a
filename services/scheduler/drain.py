"""How fast the waiting queue drains, for a truthful Retry-After. Pure: no NATS, no asyncio.

    rate        = D / B    requests that left the queue per second of busy time
    retry_after = num_queued / rate, clamped to [min_retry_after_s, max_retry_after_s]

Busy time is time with at least one request waiting: while nothing waits, few departures say
nothing about capacity (there was nothing to drain), so that time does not count and the estimate
carries over idle periods unchanged. D (departures) and B (busy seconds) are both decayed by
exp(-busy time / tau_s), so their ratio is the rate of roughly the last ``tau_s`` busy seconds,
without the start-up bias of an average that begins at zero: one departure after a second of
waiting reads as one per second at once.

Before any departure has been seen the rate is unknown: Retry-After is then the time the queue has
already been waiting per request queued (at best one leaves per that much), at least
``fallback_s``. A queue that stops draining (executors stuck) lets D decay while B grows, so the
estimate rises towards ``max_retry_after_s`` instead of promising a retry that cannot succeed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.field_checks import require_positive


@dataclass
class DrainRate:
    tau_s: float = 10.0
    fallback_s: float = 1.0
    min_retry_after_s: float = 1.0  # Retry-After is whole seconds, at least one
    max_retry_after_s: float = 300.0
    _departures: float = field(default=0.0, init=False)  # D
    _busy_s: float = field(default=0.0, init=False)  # B
    _undecayed_busy_s: float = field(default=0.0, init=False)  # busy time with no departure yet
    _last: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        require_positive(self, "tau_s")
        if not 0 < self.min_retry_after_s <= self.max_retry_after_s:
            raise ValueError("need 0 < min_retry_after_s <= max_retry_after_s")
        require_positive(self, "fallback_s")

    def advance(self, now: float, num_queued: int) -> None:
        """The clock moves to ``now``; the queue held ``num_queued`` requests since the previous
        call (the caller changes the queue only between calls, at their ``now``)."""
        if self._last is not None and num_queued > 0:
            dt = max(0.0, now - self._last)
            decay = math.exp(-dt / self.tau_s)
            self._departures *= decay
            # The decayed weight of dt busy seconds: the integral of exp(-(now - t) / tau) over dt.
            self._busy_s = self._busy_s * decay + self.tau_s * (1.0 - decay)
            if self._departures == 0.0:
                self._undecayed_busy_s += dt
        self._last = now

    def on_departures(self, n: int = 1) -> None:
        """``n`` requests left the queue at the last ``advance``'s time (dispatched)."""
        self._departures += n

    def rate_per_s(self) -> float | None:
        """Requests leaving the queue per busy second; None before any left."""
        if self._departures <= 0.0 or self._busy_s <= 0.0:
            return None
        return self._departures / self._busy_s

    def retry_after_s(self, num_queued: int) -> float:
        """Seconds until the ``num_queued`` requests waiting now have left, at the measured rate."""
        rate = self.rate_per_s()
        if rate is None:
            estimate = max(self.fallback_s, num_queued * self._undecayed_busy_s)
        else:
            estimate = num_queued / rate
        return min(self.max_retry_after_s, max(self.min_retry_after_s, estimate))
