"""The engine thread: owns the Engine, steps it, and hands results back through a callback.

    asyncio loop ──Add/Abort/Stop──▶ SimpleQueue ──▶ [engine thread: apply commands, step()]
        ──▶ emit(events)

Invariants:
- Only this thread touches the Engine (it is not thread-safe). The loop never waits for a forward
  pass: it only enqueues commands, and ``emit`` (called from this thread) must not block — the
  service passes ``loop.call_soon_threadsafe`` there.
- Commands are applied between steps, in order, so an Abort after an Add always finds the request.
- Every Add ends in exactly one terminal event for its id: a finished ``RequestOutput`` (in
  ``Outputs``), ``Rejected``, ``Aborted`` or ``Failed``.
- ``latest_stats`` is replaced (never mutated) after every step; reading it from another thread is
  safe.
- The ``observer`` (metrics), when set before ``start``, is called from this thread: ``on_step``
  after each step with its wall time and the stats after it, ``on_first_scheduled`` once per
  request with its queue time (its ExecuteRequest's ``arrival_time``, a wall clock, to the start of
  the first step that ran it).

No asyncio, no NATS: tested synchronously with a fake engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from shared.engine.step_record import StepRecord
from shared.wire.kv_events import KVEventBatch
from shared.wire.messages import ExecuteRequest
from shared.wire.outputs import EngineStats, RequestOutput

log = logging.getLogger("llmserve.executor.worker")


class EngineLike(Protocol):
    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params,
        *,
        priority: int = 0,
        block_hashes: list[int] | None = None,
    ) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def take_kv_events(self) -> KVEventBatch | None: ...
    def abort(self, request_id: str) -> bool: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> EngineStats: ...
    def kv_cache_snapshot(self) -> tuple[int, list[int]]: ...
    def take_first_scheduled(self) -> list[str]: ...


class StepObserver(Protocol):
    def on_step(self, duration_s: float, stats: EngineStats) -> None: ...
    def on_first_scheduled(self, queue_time_s: float) -> None: ...


@runtime_checkable
class StepRecorder(Protocol):
    """An engine that can report what each step did (shared/engine/step_record.py)."""

    record_steps: bool

    def take_step_record(self) -> StepRecord | None: ...


# -- commands (loop → thread) ----------------------------------------------------------------------


@dataclass(frozen=True)
class Add:
    request: ExecuteRequest


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Snapshot:
    """Take the engine's KV cache snapshot between steps; ``reply_to`` comes back with it."""

    reply_to: str


@dataclass(frozen=True)
class Stop:
    pass


Command = Add | Abort | Snapshot | Stop


# -- events (thread → loop) ------------------------------------------------------------------------


@dataclass(frozen=True)
class Outputs:
    outputs: list[RequestOutput]


@dataclass(frozen=True)
class Rejected:
    """The engine refused the request (bad or too long prompt): a client error."""

    request_id: str
    message: str


@dataclass(frozen=True)
class Aborted:
    request_id: str
    was_running: bool  # False: it had already finished or was never added


@dataclass(frozen=True)
class Failed:
    """A step raised: every request that was in the engine is dropped with this message."""

    request_ids: list[str]
    message: str


@dataclass(frozen=True)
class KVEvents:
    """The KV events of one step, for the prefix index (only when the worker takes them)."""

    batch: KVEventBatch


@dataclass(frozen=True)
class SnapshotTaken:
    """The engine's cached block hashes and the seq of the last KV event batch they include. It
    is emitted after that batch's KVEvents (same thread, same order)."""

    reply_to: str
    seq: int
    block_hashes: list[int]


@dataclass(frozen=True)
class StepTraced:
    """What a step did, for tracing (only when the worker records steps). Emitted before that
    step's Outputs, so the shell sees a request's prefill before its first token."""

    record: StepRecord


Event = Outputs | Rejected | Aborted | Failed | KVEvents | SnapshotTaken | StepTraced


class EngineWorker:
    def __init__(
        self,
        engine: EngineLike,
        *,
        num_threads: int | None = None,
        kv_events: bool = True,
        record_steps: bool = False,
    ) -> None:
        """kv_events: hand each step's KV events on as a KVEvents event; False leaves them to the
        engine, which drops them at its next step. record_steps: have the engine record each step
        and hand the records on as StepTraced events (tracing on; the engine must be a
        StepRecorder)."""
        self.engine = engine
        self._recorder: StepRecorder | None = None
        if record_steps:
            if not isinstance(engine, StepRecorder):
                raise TypeError(f"{type(engine).__name__} cannot record its steps")
            engine.record_steps = True
            self._recorder = engine
        self._kv_events = kv_events
        self._emit: Callable[[list[Event]], object] = lambda events: None
        self._num_threads = num_threads
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._live: set[str] = set()  # ids added to the engine and not yet terminal
        # Wall-clock arrival of each live request the engine has not scheduled yet.
        self._arrivals: dict[str, float] = {}
        self._step_s: float | None = None  # wall time of the step this loop ran, for the observer
        self.observer: StepObserver | None = None
        self.latest_stats: EngineStats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self, emit: Callable[[list[Event]], object]) -> None:
        """Start the thread; ``emit(events)`` is called from it and must not block."""
        self._emit = emit
        self._thread.start()

    def submit(self, command: Command) -> None:
        """Thread-safe; never blocks."""
        self._commands.put(command)

    def stop(self, timeout: float | None = None) -> None:
        self.submit(Stop())
        self._thread.join(timeout)

    @property
    def kv_events(self) -> bool:
        """Whether each step's KV events are handed on (else the engine drops them)."""
        return self._kv_events

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        if self._num_threads:
            # OpenMP's thread count is per thread: set it where the forward passes run.
            import torch

            torch.set_num_threads(self._num_threads)
        while True:
            events: list[Event] = []
            # Idle: block until there is work. Busy: take whatever arrived, then step.
            try:
                command = self._commands.get_nowait() if self._live else self._commands.get()
            except queue.Empty:
                command = None
            while command is not None:
                if isinstance(command, Stop):
                    self._flush(events)
                    return
                self._apply(command, events)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self._live:
                self._step(events)
            self._flush(events)

    def _apply(self, command: Command, events: list[Event]) -> None:
        if isinstance(command, Add):
            req = command.request
            try:
                # The engine checks the hashes against the prompt (a ValueError: rejected).
                self.engine.add_request(
                    req.request_id,
                    list(req.prompt_token_ids),
                    req.params,
                    priority=req.priority,
                    block_hashes=req.block_hashes,
                )
            except ValueError as e:
                events.append(Rejected(req.request_id, str(e)))
                return
            self._live.add(req.request_id)
            self._arrivals[req.request_id] = req.arrival_time or time.time()
        elif isinstance(command, Snapshot):
            seq, block_hashes = self.engine.kv_cache_snapshot()
            events.append(SnapshotTaken(command.reply_to, seq, block_hashes))
        elif isinstance(command, Abort):
            was_running = command.request_id in self._live and self.engine.abort(command.request_id)
            self._live.discard(command.request_id)
            self._arrivals.pop(command.request_id, None)
            events.append(Aborted(command.request_id, was_running))

    def _step(self, events: list[Event]) -> None:
        started_at, t0 = time.time(), time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; dropping %d requests", len(self._live))
            dropped = sorted(self._live)
            for rid in dropped:
                try:
                    self.engine.abort(rid)
                except Exception:
                    log.exception("abort of %s after a failed step failed too", rid)
            self._live.clear()
            self._arrivals.clear()
            events.append(Failed(dropped, f"the engine failed: {type(e).__name__}: {e}"))
            return
        self._step_s = time.perf_counter() - t0
        for rid in self.engine.take_first_scheduled():
            arrival = self._arrivals.pop(rid, None)
            if arrival is not None and self.observer is not None:
                self.observer.on_first_scheduled(started_at - arrival)
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
                self._arrivals.pop(out.request_id, None)
        if self._recorder is not None and (record := self._recorder.take_step_record()):
            events.append(StepTraced(record))
        if outputs:
            events.append(Outputs(outputs))
        if self._kv_events and (batch := self.engine.take_kv_events()) is not None:
            events.append(KVEvents(batch))

    def _flush(self, events: list[Event]) -> None:
        try:
            self.latest_stats = self.engine.stats()
        except Exception:
            log.exception("engine stats failed")
        if self._step_s is not None and self.observer is not None:
            self.observer.on_step(self._step_s, self.latest_stats)
        self._step_s = None
        if events:
            self._emit(events)
