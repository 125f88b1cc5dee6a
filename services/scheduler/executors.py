"""What one scheduler replica knows of one executor: its last heartbeat, the load it last reported
and the requests this replica routed to it. Pure: no NATS, no asyncio.

Load, in sequences (a request with n=4 weighs 4), and the prefill work waiting there, in tokens,
are each estimated the same way:

    estimate = the executor's own count in its newest report
             + this replica's requests the report does not include yet

A request is included once the executor's reply to it carried a load version <= the report's
version (versions grow by one at every accept and finish). Requests still waiting for that reply
count on top. Other replicas' requests show up in the next report (heartbeat or reply), and the
executor refuses what would take it past ``max_admitted``, so several replicas never over-admit it.
Without a reported load (an executor that does not count), the estimate is this replica's own
in-flight weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.wire.messages import ExecuteRequest, ExecutorHeartbeat, ExecutorLoad

ROLES_THAT_DECODE = ("decode", "both")


@dataclass
class InFlight:
    """A request this replica routed and has not seen finish."""

    request: ExecuteRequest
    weight: int
    deadline: float | None
    cached_blocks: dict[str, int] | None  # the index's answer it was routed with, for re-routing
    order: int  # its place in the queue, kept if it has to wait again
    num_prefill_tokens: int = 0  # what it was expected to prefill where it was sent
    ack_version: int | None = None  # the executor's load version in its accepting reply
    started: bool = False
    aborted: bool = False


@dataclass
class ExecutorState:
    heartbeat: ExecutorHeartbeat
    last_seen: float
    in_flight: dict[str, InFlight] = field(default_factory=dict)
    reported: ExecutorLoad | None = None
    unreachable: bool = False  # a dispatch found nobody listening; cleared by the next heartbeat

    def __post_init__(self) -> None:
        self.reported = self.heartbeat.load

    @property
    def executor_id(self) -> str:
        return self.heartbeat.executor_id

    @property
    def in_flight_weight(self) -> int:
        return sum(f.weight for f in self.in_flight.values())

    def report(self, load: ExecutorLoad | None) -> None:
        """Take a load report (of this epoch) if it is newer than the one held."""
        if load is not None and (self.reported is None or load.version >= self.reported.version):
            self.reported = load

    def load_estimate(self) -> int:
        reported = self.reported
        if reported is None:
            return self.in_flight_weight
        unreported = sum(
            f.weight
            for f in self.in_flight.values()
            if f.ack_version is None or f.ack_version > reported.version
        )
        return reported.num_admitted + unreported

    def pending_prefill_estimate(self) -> int:
        """Prompt tokens to prefill ahead of a new request: the executor's report plus this
        replica's requests it does not include yet, less those that started."""
        reported = self.reported
        unreported = sum(
            f.num_prefill_tokens
            for f in self.in_flight.values()
            if not f.started
            and (reported is None or f.ack_version is None or f.ack_version > reported.version)
        )
        return unreported + (reported.num_pending_prefill_tokens if reported is not None else 0)

    def capacity(self, override: int | None, default: int) -> int:
        """The weight it may hold: the flag, else what it advertises, else its batch limit."""
        if override is not None:
            return override
        if self.reported is not None:
            return self.reported.max_admitted
        return self.heartbeat.max_num_seqs or default

    def serves(self, model: str) -> bool:
        return self.heartbeat.model == model

    def routable(self, now: float, heartbeat_timeout_s: float) -> bool:
        """A whole request (or its decode) may go here."""
        return self.live(now, heartbeat_timeout_s) and self.heartbeat.role in ROLES_THAT_DECODE

    def live(self, now: float, heartbeat_timeout_s: float) -> bool:
        """Heard from lately, not draining, not found gone: work of its role may go here."""
        return (
            now - self.last_seen <= heartbeat_timeout_s
            and not self.heartbeat.draining
            and not self.unreachable
        )
