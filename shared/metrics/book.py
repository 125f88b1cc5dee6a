"""The latest MetricsReport of every live service instance, as a gateway holds them.

An instance is live while its last report arrived less than ``stale_after_s`` ago (receiver's
monotonic clock, so senders' clocks do not matter); a stopped or unreachable one drops out of the
next scrape instead of failing it or showing frozen values. A report older (by ``sent_at``) than
the one held, from a reordered delivery, does not replace it.

No asyncio, no NATS: tested synchronously.
"""

from __future__ import annotations

from shared.wire.messages import MetricsReport


class ReportBook:
    def __init__(self, stale_after_s: float) -> None:
        if stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s}")
        self.stale_after_s = stale_after_s
        self._latest: dict[tuple[str, str], tuple[MetricsReport, float]] = {}

    def put(self, report: MetricsReport, now: float) -> None:
        key = (report.service, report.instance)
        held = self._latest.get(key)
        if held is None or report.sent_at >= held[0].sent_at:
            self._latest[key] = (report, now)

    def live(self, now: float, exclude: tuple[str, str] | None = None) -> list[MetricsReport]:
        """The live reports (``exclude``: one instance left out, e.g. the caller's own), sorted by
        service and instance; stale ones are forgotten."""
        for key in [k for k, (_, at) in self._latest.items() if now - at > self.stale_after_s]:
            del self._latest[key]
        return [r for key, (r, _) in sorted(self._latest.items()) if key != exclude]
