"""The scheduler's pure logic: executor table, in-flight accounting, least-loaded routing, the
bounded waiting queue, fail-over. No NATS, no asyncio: every method takes ``now`` and returns
``Action``s that the service turns into publishes, so it is unit-tested synchronously.

Invariants:
- A request goes only to an executor whose heartbeat names the request's model. A request for a
  model no known executor serves, while others are alive, fails at once (404 model_not_found).
- A request is in exactly one place: its model's waiting queue, one executor's in-flight table, or
  nowhere (done, failed or aborted). Every request that enters ``submit`` leaves with a ``Dispatch``
  or a ``Fail`` (or an abort by the client): no client waits forever on a request the scheduler
  dropped.
- In-flight load is counted from the moment of routing (in sequences: a request with n=4 weighs 4),
  not from the executor's next heartbeat, so a burst is spread instead of piling on one executor.
- An executor is routable while its heartbeat is younger than ``heartbeat_timeout_s``, it is not
  draining, and its in-flight weight is below its cap (an idle executor always takes one request,
  even one heavier than its cap, so nothing is stuck forever).
- An executor that goes silent, or comes back with a new epoch (restarted), loses everything it
  held: requests that had not started are routed again (attempt + 1, ahead of the queue); started
  ones end with a 502 error, since their partial output cannot be taken back.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import msgspec

from shared.wire.messages import (
    ExecuteRequest,
    ExecutorHeartbeat,
    ExecutorStatus,
    RequestProgress,
    SchedulerStatus,
    StreamError,
    TokenizedRequest,
)

ROLES_THAT_DECODE = ("decode", "both")


@dataclass(frozen=True)
class RouterConfig:
    max_queue_len: int = 256
    heartbeat_timeout_s: float = 2.0
    no_executor_timeout_s: float = 10.0  # queued requests wait this long for any executor → 503
    max_in_flight_per_executor: int | None = None  # None: the executor's max_num_seqs
    default_max_in_flight: int = 64  # when neither the flag nor the heartbeat says
    retry_after_s: float = 1.0  # Retry-After on 429
    max_attempts: int = 3  # routing attempts of one request (fail-over included)

    def __post_init__(self) -> None:
        if self.max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {self.max_queue_len}")
        for name in ("heartbeat_timeout_s", "no_executor_timeout_s", "retry_after_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_in_flight_per_executor is not None and self.max_in_flight_per_executor < 1:
            raise ValueError(
                f"max_in_flight_per_executor must be >= 1, got {self.max_in_flight_per_executor}"
            )
        if self.default_max_in_flight < 1 or self.max_attempts < 1:
            raise ValueError("default_max_in_flight and max_attempts must be >= 1")


@dataclass(frozen=True)
class Dispatch:
    executor_id: str
    request: ExecuteRequest


@dataclass(frozen=True)
class Fail:
    error: StreamError


Action = Dispatch | Fail


@dataclass
class _InFlight:
    request: ExecuteRequest
    weight: int
    deadline: float | None
    started: bool = False
    aborted: bool = False


@dataclass
class ExecutorState:
    heartbeat: ExecutorHeartbeat
    last_seen: float
    in_flight: dict[str, _InFlight] = field(default_factory=dict)

    @property
    def executor_id(self) -> str:
        return self.heartbeat.executor_id

    @property
    def in_flight_weight(self) -> int:
        return sum(f.weight for f in self.in_flight.values())


@dataclass(order=True)
class _Queued:
    sort_key: tuple[int, int, int]  # (-attempt: retries first, priority, arrival sequence)
    request: ExecuteRequest = field(compare=False)
    deadline: float | None = field(compare=False, default=None)
    cancelled: bool = field(compare=False, default=False)


def _weight(request: ExecuteRequest) -> int:
    return max(1, request.params.n)


class Router:
    def __init__(self, config: RouterConfig, now: float) -> None:
        self.config = config
        self.executors: dict[str, ExecutorState] = {}
        # One heap per model (FIFO within a model: a busy model does not hold up another one's
        # requests); cancelled entries are skipped lazily, an empty heap is removed.
        self._queues: dict[str, list[_Queued]] = {}
        self._queued: dict[str, _Queued] = {}  # live entries by request id
        self._seq = itertools.count()
        self._started = now  # grace period from start: executors may be loading
        self._model_seen: dict[
            str, float
        ] = {}  # model -> when an executor serving it last reported

    # -- inputs ------------------------------------------------------------------------------

    def on_heartbeat(self, hb: ExecutorHeartbeat, now: float) -> list[Action]:
        actions: list[Action] = []
        old = self.executors.get(hb.executor_id)
        if old is not None and old.heartbeat.epoch == hb.epoch:
            old.heartbeat, old.last_seen = hb, now
        else:
            # New, or restarted (new epoch): whatever the old process held is gone. The new state
            # goes in first, so the lost requests may be routed to the restarted process.
            self.executors[hb.executor_id] = ExecutorState(hb, now)
            if old is not None:
                actions += self._lose_executor(old, now, "restarted")
        self._model_seen[hb.model] = now
        return actions + self._drain_queue(now)

    def submit(self, req: TokenizedRequest, now: float, wall_time: float) -> list[Action]:
        if req.request_id in self._queued or self._owner(req.request_id) is not None:
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
        if self._alive(now) and not any(
            s.heartbeat.model == req.model for s in self.executors.values()
        ):
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
        return self._admit(request, now, req.deadline)

    def on_progress(self, progress: RequestProgress, now: float) -> list[Action]:
        state = self.executors.get(progress.executor_id)
        entry = state.in_flight.get(progress.request_id) if state else None
        if state is None or entry is None:
            return []  # not ours (another scheduler routed it) or already failed over
        if progress.state == "started":
            entry.started = True
            return []
        del state.in_flight[progress.request_id]  # 'finished': its slot is free
        return self._drain_queue(now)

    def abort(self, request_id: str, now: float) -> list[Action]:
        queued = self._queued.pop(request_id, None)
        if queued is not None:
            queued.cancelled = True
        owner = self._owner(request_id)
        if owner is not None:
            # The executor aborts it too and reports 'finished'; until then the slot stays taken,
            # but a fail-over must not resurrect it.
            owner.in_flight[request_id].aborted = True
        return []

    def tick(self, now: float, wall_time: float) -> list[Action]:
        """Periodic: declare silent executors dead, expire queued requests, drain the queue."""
        actions: list[Action] = []
        for state in list(self.executors.values()):
            if now - state.last_seen > self.config.heartbeat_timeout_s:
                del self.executors[state.executor_id]
                actions += self._lose_executor(state, now, "stopped sending heartbeats")
        for s in self._alive(now):
            self._model_seen[s.heartbeat.model] = now
        for entry in list(self._queued.values()):
            if entry.deadline is not None and wall_time >= entry.deadline:
                actions.append(
                    self._drop_queued(
                        entry,
                        504,
                        "timeout_error",
                        "the request timed out while waiting in the queue",
                    )
                )
        for entry in list(self._queued.values()):
            model = entry.request.model
            if self._no_executor_for(model, now):
                actions.append(
                    self._drop_queued(
                        entry, 503, "server_error", self._no_executor_message(model, now)
                    )
                )
        return actions + self._drain_queue(now)

    # -- outputs -----------------------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        return len(self._queued)

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
            )
            for s in self._alive(now)
        ]
        return SchedulerStatus(
            executors=executors, num_queued=self.num_queued, max_queue_len=self.config.max_queue_len
        )

    # -- internals ---------------------------------------------------------------------------

    def _cap(self, state: ExecutorState) -> int:
        if self.config.max_in_flight_per_executor is not None:
            return self.config.max_in_flight_per_executor
        return state.heartbeat.max_num_seqs or self.config.default_max_in_flight

    def _alive(self, now: float) -> list[ExecutorState]:
        return [
            s
            for s in self.executors.values()
            if now - s.last_seen <= self.config.heartbeat_timeout_s
            and not s.heartbeat.draining
            and s.heartbeat.role in ROLES_THAT_DECODE
        ]

    def _last_seen(self, model: str) -> float:
        return self._model_seen.get(model, self._started)

    def _no_executor_for(self, model: str, now: float) -> bool:
        return (
            not any(s.heartbeat.model == model for s in self._alive(now))
            and now - self._last_seen(model) >= self.config.no_executor_timeout_s
        )

    def _no_executor_message(self, model: str, now: float) -> str:
        return (
            f"no executor serving {model} is available (none has reported for "
            f"{now - self._last_seen(model):.1f}s); try again later"
        )

    def _pick(self, request: ExecuteRequest, now: float) -> ExecutorState | None:
        """Among the executors serving the request's model, the least loaded: fewest in-flight
        sequences, then most free KV blocks, then id (stable)."""
        weight = _weight(request)
        best: ExecutorState | None = None
        best_key: tuple[int, int, str] | None = None
        for s in self._alive(now):
            if s.heartbeat.model != request.model:
                continue
            load = s.in_flight_weight
            if load > 0 and load + weight > self._cap(s):
                continue
            key = (load, -s.heartbeat.stats.num_free_blocks, s.executor_id)
            if best_key is None or key < best_key:
                best, best_key = s, key
        return best

    def _admit(
        self, request: ExecuteRequest, now: float, deadline: float | None, is_retry: bool = False
    ) -> list[Action]:
        # Strict FIFO within a model and priority: a new request may not overtake its model's queue.
        if self._head(request.model) is None:
            target = self._pick(request, now)
            if target is not None:
                return [self._dispatch(target, request, deadline)]
        if self._no_executor_for(request.model, now):
            return [
                Fail(
                    StreamError(
                        request_id=request.request_id,
                        status=503,
                        message=self._no_executor_message(request.model, now),
                    )
                )
            ]
        if not is_retry and len(self._queued) >= self.config.max_queue_len:
            return [
                Fail(
                    StreamError(
                        request_id=request.request_id,
                        status=429,
                        type="rate_limit_error",
                        message=f"the server is overloaded: {len(self._queued)} requests are "
                        f"already waiting (max_queue_len={self.config.max_queue_len}); retry later",
                        retry_after_s=self.config.retry_after_s,
                    )
                )
            ]
        entry = _Queued((-request.attempt, request.priority, next(self._seq)), request, deadline)
        heapq.heappush(self._queues.setdefault(request.model, []), entry)
        self._queued[request.request_id] = entry
        return self._drain_queue(now)

    def _dispatch(
        self, target: ExecutorState, request: ExecuteRequest, deadline: float | None
    ) -> Dispatch:
        target.in_flight[request.request_id] = _InFlight(request, _weight(request), deadline)
        return Dispatch(target.executor_id, request)

    def _head(self, model: str) -> _Queued | None:
        """The first live entry of the model's queue; drops cancelled ones and an emptied queue."""
        queue = self._queues.get(model)
        while queue and queue[0].cancelled:
            heapq.heappop(queue)
        if not queue:
            self._queues.pop(model, None)
            return None
        return queue[0]

    def _drain_queue(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for model in list(self._queues):
            while (head := self._head(model)) is not None:
                target = self._pick(head.request, now)
                if target is None:
                    break
                heapq.heappop(self._queues[model])
                del self._queued[head.request.request_id]
                actions.append(self._dispatch(target, head.request, head.deadline))
        return actions

    def _drop_queued(self, entry: _Queued, status: int, type_: str, message: str) -> Fail:
        entry.cancelled = True
        del self._queued[entry.request.request_id]
        return Fail(
            StreamError(
                request_id=entry.request.request_id, status=status, type=type_, message=message
            )
        )

    def _owner(self, request_id: str) -> ExecutorState | None:
        for s in self.executors.values():
            if request_id in s.in_flight:
                return s
        return None

    def _lose_executor(self, state: ExecutorState, now: float, why: str) -> list[Action]:
        actions: list[Action] = []
        lost = list(state.in_flight.items())
        state.in_flight.clear()
        for rid, entry in lost:
            if entry.aborted:
                continue
            if entry.started:
                actions.append(
                    Fail(
                        StreamError(
                            request_id=rid,
                            status=502,
                            message=f"executor {state.executor_id} {why} while generating this "
                            f"response; the output is incomplete",
                        )
                    )
                )
            elif entry.request.attempt + 1 >= self.config.max_attempts:
                actions.append(
                    Fail(
                        StreamError(
                            request_id=rid,
                            status=503,
                            message=f"executor {state.executor_id} {why} before this request "
                            f"started, after {entry.request.attempt + 1} attempts; try again later",
                        )
                    )
                )
            else:
                retry = msgspec.structs.replace(entry.request, attempt=entry.request.attempt + 1)
                actions += self._admit(retry, now, entry.deadline, is_retry=True)
        return actions
