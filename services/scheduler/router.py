"""The scheduler's pure logic: executor table, in-flight accounting, cache- and load-aware
placement (``placement``), the bounded waiting queues (``waiting``), fail-over. No NATS, no
asyncio: every method takes ``now`` and returns ``Action``s that the service turns into messages,
so it is unit-tested synchronously.

Invariants:
- A request goes only to an executor whose heartbeat names the request's model. A request for a
  model no known executor serves, while others are alive, fails at once (404 model_not_found).
- A request is in exactly one place: its model's waiting queue, one executor's in-flight table, or
  nowhere (done, failed or aborted). Every request that enters ``submit`` leaves with a ``Dispatch``
  or a ``Fail`` (or an abort by the client): no client waits forever on a request the scheduler
  dropped.
- Load is counted from the moment of routing (in sequences: a request with n=4 weighs 4), on top of
  the load the executor last reported (``executors``), so a burst is spread instead of piling on
  one executor, and several scheduler replicas see each other's work in the executors' reports.
- An executor is routable while its heartbeat is younger than ``heartbeat_timeout_s``, it is not
  draining, a dispatch has not found it gone, and its load estimate leaves room for the request
  under its capacity (an idle executor always takes one request, even one heavier than its
  capacity, so nothing is stuck forever).
- A dispatch is a request the executor answers: accepted (it is in flight there), refused because
  it is full (it waits again, at its old place in the queue, and that executor counts as full
  until it reports room), or nobody listening (the executor is gone: routed again, attempt + 1).
- An executor that goes silent, or comes back with a new epoch (restarted), loses everything it
  held: requests that had not started are routed again (attempt + 1, ahead of the queue); started
  ones end with a 502 error, since their partial output cannot be taken back.
- Retry-After (429, and the 503s it gives) is the time the queue needs to drain at its measured
  rate (``drain.DrainRate``: requests leaving the queue per busy second, smoothed): every public
  method first moves that clock to its ``now``, with the queue as the previous call left it.
- ``forget_requests`` (the scheduler lost the bus, so its view of every request may be stale) ends
  every queued request with a 503 and forgets what it routed: the executors' own reports are
  the load from then on.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import msgspec

from services.scheduler.disagg import DisaggConfig, decide
from services.scheduler.drain import DrainRate
from services.scheduler.executors import ExecutorState, InFlight
from services.scheduler.placement import ROUTING_POLICIES, CostWeights, choose, uncached_tokens
from services.scheduler.waiting import WaitingQueues
from shared.field_checks import require_at_least, require_positive
from shared.wire.messages import (
    ExecuteReply,
    ExecuteRequest,
    ExecutorHeartbeat,
    ExecutorStatus,
    RequestProgress,
    SchedulerStatus,
    StreamError,
    TokenizedRequest,
)


@dataclass(frozen=True)
class RouterConfig:
    max_queue_len: int = 256
    heartbeat_timeout_s: float = 2.0
    no_executor_timeout_s: float = 10.0  # queued requests wait this long for any executor → 503
    max_in_flight_per_executor: int | None = None  # None: what the executor advertises
    default_max_in_flight: int = 64  # when neither the flag nor the executor says
    retry_after_s: float = 1.0  # Retry-After on 429 before the drain rate is measured
    drain_tau_s: float = 10.0  # the drain rate's smoothing: about the last this many busy seconds
    max_retry_after_s: float = 300.0
    max_attempts: int = 3  # routing attempts of one request (fail-over included)
    routing: str = "cache"  # see placement.ROUTING_POLICIES
    weights: CostWeights = field(default_factory=CostWeights)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)

    def __post_init__(self) -> None:
        require_at_least(self, 0, "max_queue_len")
        require_positive(
            self,
            "heartbeat_timeout_s",
            "no_executor_timeout_s",
            "retry_after_s",
            "drain_tau_s",
            "max_retry_after_s",
        )
        if self.max_in_flight_per_executor is not None and self.max_in_flight_per_executor < 1:
            raise ValueError(
                f"max_in_flight_per_executor must be >= 1, got {self.max_in_flight_per_executor}"
            )
        if self.default_max_in_flight < 1 or self.max_attempts < 1:
            raise ValueError("default_max_in_flight and max_attempts must be >= 1")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")


@dataclass(frozen=True)
class Dispatch:
    executor_id: str
    request: ExecuteRequest
    decision: str = ""  # disagg.DECISIONS when prefill executors exist, for the metrics


@dataclass(frozen=True)
class Fail:
    error: StreamError


Action = Dispatch | Fail


def _weight(request: ExecuteRequest) -> int:
    return max(1, request.params.n)


class Router:
    def __init__(self, config: RouterConfig, now: float) -> None:
        self.config = config
        self.executors: dict[str, ExecutorState] = {}
        self._waiting = WaitingQueues()
        self._order = itertools.count()
        self._turns: dict[str, int] = {}  # round-robin picks per model
        self._started = now  # grace period from start: executors may be loading
        # model -> when an executor serving it last reported
        self._model_seen: dict[str, float] = {}
        self.num_refused_dispatches = 0
        self.disagg_decisions: dict[str, int] = {}  # disagg.DECISIONS -> count
        self.drain = DrainRate(
            tau_s=config.drain_tau_s,
            fallback_s=config.retry_after_s,
            max_retry_after_s=config.max_retry_after_s,
        )

    # -- inputs ------------------------------------------------------------------------------

    def on_heartbeat(self, hb: ExecutorHeartbeat, now: float) -> list[Action]:
        self._advance(now)
        actions: list[Action] = []
        old = self.executors.get(hb.executor_id)
        if old is not None and old.heartbeat.epoch == hb.epoch:
            old.heartbeat, old.last_seen, old.unreachable = hb, now, False
            old.report(hb.load)
        else:
            # New, or restarted (new epoch): whatever the old process held is gone. The new state
            # goes in first, so the lost requests may be routed to the restarted process.
            self.executors[hb.executor_id] = ExecutorState(hb, now)
            if old is not None:
                actions += self._lose_executor(old, now, "restarted")
        self._model_seen[hb.model] = now
        return actions + self._drain_queue(now)

    def submit(
        self,
        req: TokenizedRequest,
        now: float,
        wall_time: float,
        cached_blocks: dict[str, int] | None = None,
    ) -> list[Action]:
        """``cached_blocks``: the prefix index's answer for the prompt (executor id → leading
        blocks held); None routes by load alone."""
        self._advance(now)
        if req.request_id in self._waiting or self._owner(req.request_id) is not None:
            return []  # a redelivered submit: the request is already being served
        if req.deadline is not None and wall_time >= req.deadline:
            return [
                Fail(
                    StreamError(
                        request_id=req.request_id,
                        status=504,
                        type="timeout_error",
                        message="the request timed out before it was scheduled",
                    )
                )
            ]
        if self._alive(now) and not any(s.serves(req.model) for s in self.executors.values()):
            served = ", ".join(sorted({s.heartbeat.model for s in self.executors.values()}))
            return [
                Fail(
                    StreamError(
                        request_id=req.request_id,
                        status=404,
                        type="invalid_request_error",
                        param="model",
                        message=f"The model '{req.model}' does not exist. "
                        f"This server serves '{served}'.",
                    )
                )
            ]
        request = ExecuteRequest(
            request_id=req.request_id,
            model=req.model,
            prompt_token_ids=req.prompt_token_ids,
            block_hashes=req.block_hashes,
            params=req.params,
            priority=req.priority,
            arrival_time=req.arrival_time,
        )
        entry = InFlight(request, _weight(request), req.deadline, cached_blocks, next(self._order))
        return self._admit(entry, now)

    def on_dispatch_reply(self, request_id: str, reply: ExecuteReply, now: float) -> list[Action]:
        self._advance(now)
        state = self.executors.get(reply.executor_id)
        entry = state.in_flight.get(request_id) if state is not None else None
        if state is None or entry is None or state.heartbeat.epoch != reply.epoch:
            return []  # already failed over, or the executor restarted since: its heartbeat rules
        state.report(reply.load)
        if reply.accepted:
            entry.ack_version = reply.load.version
            return []
        # Refused: it is full. Its report says so, so it is not picked again until it has room.
        del state.in_flight[request_id]
        self.num_refused_dispatches += 1
        if entry.aborted:
            return []
        return self._admit(entry, now, is_retry=True)

    def on_dispatch_unreachable(
        self, request_id: str, executor_id: str, now: float
    ) -> list[Action]:
        """Nobody listens on the executor's subject: it is gone, whatever its heartbeats said."""
        self._advance(now)
        state = self.executors.get(executor_id)
        entry = state.in_flight.pop(request_id, None) if state is not None else None
        if state is None or entry is None:
            return []
        state.unreachable = True
        return self._reroute(entry, state, now, "is unreachable")

    def on_progress(self, progress: RequestProgress, now: float) -> list[Action]:
        self._advance(now)
        state = self.executors.get(progress.executor_id)
        entry = state.in_flight.get(progress.request_id) if state else None
        if state is not None:
            state.report(progress.load)
        if progress.state == "adopted" and state is not None and entry is None:
            self._adopt(progress, now)
            return []
        if state is None or entry is None:
            # Not ours (another scheduler routed it) or already failed over; the room it freed
            # may let a queued request go.
            return self._drain_queue(now) if progress.state == "finished" else []
        if progress.state == "adopted":
            self._adopt(progress, now)
            return []
        if progress.state == "started":
            entry.started = True
            return []
        del state.in_flight[progress.request_id]  # 'finished': its slot is free
        target = self.executors.get(progress.handed_to) if progress.handed_to else None
        if target is not None:
            # Handed off before the decode executor's 'adopted' arrived: it holds the request now
            # (its death must end the request; its 'finished' frees the slot).
            entry.started = True
            target.in_flight[progress.request_id] = entry
        return self._drain_queue(now)

    def _adopt(self, progress: RequestProgress, now: float) -> None:
        """A decode executor installed a request handed to it: it holds the request from now on
        (its death ends the request; its 'finished' frees the slot). Moves nothing when the
        prefill executor's 'finished' came first (its own reports count the load then)."""
        owner = self._owner(progress.request_id)
        target = self.executors.get(progress.executor_id)
        if owner is None or target is None or owner is target:
            return
        entry = owner.in_flight.pop(progress.request_id)
        entry.started = True
        target.in_flight[progress.request_id] = entry

    def abort(self, request_id: str, now: float) -> list[Action]:
        self._advance(now)
        self._waiting.remove(request_id)
        owner = self._owner(request_id)
        if owner is not None:
            # The executor aborts it too and reports 'finished'; until then the slot stays taken,
            # but a fail-over must not resurrect it.
            owner.in_flight[request_id].aborted = True
        return []

    def tick(self, now: float, wall_time: float) -> list[Action]:
        """Periodic: declare silent executors dead, expire queued requests, drain the queue."""
        self._advance(now)
        actions: list[Action] = []
        for state in list(self.executors.values()):
            if now - state.last_seen > self.config.heartbeat_timeout_s:
                del self.executors[state.executor_id]
                actions += self._lose_executor(state, now, "stopped sending heartbeats")
        for s in self._alive(now):
            self._model_seen[s.heartbeat.model] = now
        for entry in self._waiting.entries():
            if entry.deadline is not None and wall_time >= entry.deadline:
                actions.append(
                    self._drop_queued(
                        entry,
                        504,
                        "timeout_error",
                        "the request timed out while waiting in the queue",
                    )
                )
        for entry in self._waiting.entries():
            model = entry.request.model
            if self._no_executor_for(model, now):
                actions.append(
                    self._drop_queued(
                        entry, 503, "server_error", self._no_executor_message(model, now)
                    )
                )
        return actions + self._drain_queue(now)

    def forget_requests(self, now: float) -> list[Action]:
        """The bus connection dropped: messages about any request may have been lost meanwhile
        (progress, replies, aborts), and the gateway may have given up on them. Every queued
        request ends with a 503; routed ones are forgotten (their executors end them, or finish
        them; either way their reports count them)."""
        self._advance(now)
        actions: list[Action] = [
            self._drop_queued(
                entry,
                503,
                "server_error",
                "the scheduler lost its connection to the message bus while the request "
                "waited; retry it",
            )
            for entry in self._waiting.entries()
        ]
        self._waiting.clear()
        for state in self.executors.values():
            state.in_flight.clear()
        return actions

    # -- outputs -----------------------------------------------------------------------------

    def queued_request_ids(self) -> list[str]:
        """Every request waiting in a queue (its stream gets the scheduler's keepalives)."""
        return self._waiting.request_ids()

    def retry_after_s(self) -> float:
        """What a 429 says now: the time the queue needs to drain at its measured rate."""
        return self.drain.retry_after_s(self.num_queued)

    @property
    def num_queued(self) -> int:
        return len(self._waiting)

    def num_candidates(self, model: str, now: float) -> int:
        """Live executors serving ``model`` (with room or not; prefill executors too): with fewer
        than two there is no placement to choose, and no need to ask the prefix index."""
        return sum(
            1
            for s in self.executors.values()
            if s.serves(model) and s.live(now, self.config.heartbeat_timeout_s)
        )

    def status(self, now: float) -> SchedulerStatus:
        executors = [
            ExecutorStatus(
                executor_id=s.executor_id,
                model=s.heartbeat.model,
                num_free_blocks=s.heartbeat.stats.num_free_blocks,
                num_total_blocks=s.heartbeat.stats.num_total_blocks,
                num_running=s.heartbeat.stats.num_running,
                num_waiting=s.heartbeat.stats.num_waiting,
                num_in_flight=len(s.in_flight),
                last_heartbeat_age_s=now - s.last_seen,
                load_estimate=s.load_estimate(),
                capacity=self._capacity(s),
                prefix_cache_queries_tokens=s.heartbeat.stats.prefix_cache_queries_tokens,
                prefix_cache_hits_tokens=s.heartbeat.stats.prefix_cache_hits_tokens,
                role=s.heartbeat.role,
            )
            # Prefill executors too (role says which), so their blocks and load are visible.
            for s in self.executors.values()
            if s.live(now, self.config.heartbeat_timeout_s)
        ]
        self._advance(now)
        return SchedulerStatus(
            executors=executors,
            num_queued=self.num_queued,
            max_queue_len=self.config.max_queue_len,
            routing=self.config.routing,
            num_refused_dispatches=self.num_refused_dispatches,
            drain_rate_per_s=self.drain.rate_per_s() or 0.0,
            retry_after_s=self.retry_after_s(),
        )

    # -- internals ---------------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        # The queue is as the previous call left it: it changes only inside these methods.
        self.drain.advance(now, self.num_queued)

    def _capacity(self, state: ExecutorState) -> int:
        return state.capacity(
            self.config.max_in_flight_per_executor, self.config.default_max_in_flight
        )

    def _alive(self, now: float) -> list[ExecutorState]:
        return [
            s for s in self.executors.values() if s.routable(now, self.config.heartbeat_timeout_s)
        ]

    def _last_seen(self, model: str) -> float:
        return self._model_seen.get(model, self._started)

    def _no_executor_for(self, model: str, now: float) -> bool:
        return (
            not any(s.serves(model) for s in self._alive(now))
            and now - self._last_seen(model) >= self.config.no_executor_timeout_s
        )

    def _no_executor_message(self, model: str, now: float) -> str:
        return (
            f"no executor serving {model} is available (none has reported for "
            f"{now - self._last_seen(model):.1f}s); try again later"
        )

    def _pick(self, entry: InFlight, now: float) -> ExecutorState | None:
        """Among the live executors of the request's model with room for it, the placement
        policy's choice; None when none has room."""
        model = entry.request.model
        candidates = []
        for s in self._alive(now):
            if not s.serves(model):
                continue
            load = s.load_estimate()
            if load > 0 and load + entry.weight > self._capacity(s):
                continue
            candidates.append(s)
        if not candidates:
            return None
        turn = self._turns.get(model, 0)
        self._turns[model] = turn + 1
        return choose(
            candidates,
            entry.request,
            entry.cached_blocks,
            self.config.routing,
            self.config.weights,
            turn,
        )

    def _admit(self, entry: InFlight, now: float, is_retry: bool = False) -> list[Action]:
        request = entry.request
        # Strict FIFO within a model and priority: a new request may not overtake its model's queue.
        if self._waiting.head(request.model) is None:
            target = self._pick(entry, now)
            if target is not None:
                return [self._dispatch(target, entry, now)]
        if self._no_executor_for(request.model, now):
            return [
                Fail(
                    StreamError(
                        request_id=request.request_id,
                        status=503,
                        message=self._no_executor_message(request.model, now),
                        retry_after_s=self.retry_after_s(),
                    )
                )
            ]
        if not is_retry and self.num_queued >= self.config.max_queue_len:
            return [
                Fail(
                    StreamError(
                        request_id=request.request_id,
                        status=429,
                        type="rate_limit_error",
                        message=f"the server is overloaded: {self.num_queued} requests are "
                        f"already waiting (max_queue_len={self.config.max_queue_len}); retry later",
                        retry_after_s=self.retry_after_s(),
                    )
                )
            ]
        self._waiting.push(entry)
        return self._drain_queue(now)

    def _prefill_candidates(self, entry: InFlight, now: float) -> list[ExecutorState]:
        timeout_s = self.config.heartbeat_timeout_s
        return [
            s
            for s in self.executors.values()
            if s.heartbeat.role == "prefill"
            and s.serves(entry.request.model)
            and s.live(now, timeout_s)
            and not (s.load_estimate() > 0 and s.load_estimate() + entry.weight > self._capacity(s))
        ]

    def _dispatch(self, target: ExecutorState, entry: InFlight, now: float = 0.0) -> Dispatch:
        """``target``: where the request decodes. With prefill executors about, its prefill may go
        to one of them (disagg.decide); the entry is in flight there until the decode executor
        adopts it."""
        entry.ack_version, entry.started, entry.aborted = None, False, False
        num_prompt_tokens = len(entry.request.prompt_token_ids)
        request = entry.request
        decision = ""
        prefill_candidates = self._prefill_candidates(entry, now)
        if any(s.heartbeat.role == "prefill" for s in self.executors.values()):
            decision, prefill = decide(
                request,
                uncached_tokens(target, request, entry.cached_blocks),
                prefill_candidates,
                entry.cached_blocks,
                self.config.disagg,
                self.config.weights,
            )
            self.disagg_decisions[decision] = self.disagg_decisions.get(decision, 0) + 1
            if prefill is not None:
                request = msgspec.structs.replace(request, decode_executor_id=target.executor_id)
                target = prefill
        entry.num_prefill_tokens = uncached_tokens(target, request, entry.cached_blocks)
        target.in_flight[request.request_id] = entry
        request = msgspec.structs.replace(
            request, num_expected_cached_tokens=num_prompt_tokens - entry.num_prefill_tokens
        )
        return Dispatch(target.executor_id, request, decision)

    def _drain_queue(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for model in self._waiting.models():
            while (head := self._waiting.head(model)) is not None:
                target = self._pick(head, now)
                if target is None:
                    break
                self._waiting.pop(model)
                self.drain.on_departures(1)
                actions.append(self._dispatch(target, head, now))
        return actions

    def _drop_queued(self, entry: InFlight, status: int, type_: str, message: str) -> Fail:
        rid = entry.request.request_id
        self._waiting.remove(rid)
        retry_after_s = self.retry_after_s() if status in (429, 503) else None
        return Fail(
            StreamError(
                request_id=rid,
                status=status,
                type=type_,
                message=message,
                retry_after_s=retry_after_s,
            )
        )

    def _owner(self, request_id: str) -> ExecutorState | None:
        for s in self.executors.values():
            if request_id in s.in_flight:
                return s
        return None

    def _lose_executor(self, state: ExecutorState, now: float, why: str) -> list[Action]:
        actions: list[Action] = []
        lost = list(state.in_flight.values())
        state.in_flight.clear()
        for entry in lost:
            actions += self._reroute(entry, state, now, why)
        return actions

    def _reroute(self, entry: InFlight, state: ExecutorState, now: float, why: str) -> list[Action]:
        """A request its executor lost: ended if it had started (its partial output cannot be
        taken back) or if it ran out of attempts, else routed again ahead of the queue."""
        rid = entry.request.request_id
        if entry.aborted:
            return []
        if entry.started:
            return [
                Fail(
                    StreamError(
                        request_id=rid,
                        status=502,
                        message=f"executor {state.executor_id} {why} while generating this "
                        f"response; the output is incomplete",
                    )
                )
            ]
        if entry.request.attempt + 1 >= self.config.max_attempts:
            return [
                Fail(
                    StreamError(
                        request_id=rid,
                        status=503,
                        message=f"executor {state.executor_id} {why} before this request "
                        f"started, after {entry.request.attempt + 1} attempts; try again later",
                        retry_after_s=self.retry_after_s(),
                    )
                )
            ]
        entry.request = msgspec.structs.replace(entry.request, attempt=entry.request.attempt + 1)
        return self._admit(entry, now, is_retry=True)
