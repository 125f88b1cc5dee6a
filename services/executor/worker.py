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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, runtime_checkable

from shared.engine import kv_transfer
from shared.engine.kv_transfer import Detached, Handoff, PageLayout, Reservation
from shared.engine.step_record import StepRecord
from shared.wire.kv_events import KVEventBatch
from shared.wire.messages import ExecuteRequest
from shared.wire.outputs import EngineStats, RequestOutput

if TYPE_CHECKING:
    from shared.engine.engine import Engine

log = logging.getLogger("llmserve.executor.worker")

T = TypeVar("T")


def build_on_passing_thread(build: Callable[[], T]) -> T:
    """``build()`` run on a thread of its own that ends with it; its result or its exception.

    For the engine's load: its parallel regions (weight packing) would otherwise give the calling
    thread, which lives on, a pool of OpenMP threads that outlives the load. The engine thread
    later makes its own pool, and libgomp, counting more threads than cores, cuts every waiting
    thread's spin (GOMP_SPINCOUNT) to a third: the threads then sleep and wake at most of a
    step's parallel regions instead of spinning through them. A pool dies with its thread."""
    # Leaving the block joins the pool's one thread: it has ended when this returns.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-load") as pool:
        return pool.submit(build).result()


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


# KV handoff (services/executor/handoff.py; shared/engine/kv_transfer.py does the work).
@dataclass(frozen=True)
class Reserve:
    """Decode side: reserve blocks for a request prefilled elsewhere; ``Reserved`` answers."""

    handoff: Handoff


@dataclass(frozen=True)
class Install:
    """Decode side: every page of a reservation is written: the request decodes here."""

    request_id: str
    recompute: bool = False  # the pages will not come: prefill it here instead


@dataclass(frozen=True)
class Unreserve:
    request_id: str


@dataclass(frozen=True)
class Release:
    """Prefill side: the pages arrived, free the held blocks (``readopt``: decode here after
    all)."""

    request_id: str
    readopt: bool = False


Command = Add | Abort | Snapshot | Stop | Reserve | Install | Unreserve | Release


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


@dataclass(frozen=True)
class Prefilled:
    """Prefill side: a request to hand off sampled its first token (its Outputs came first); it
    left the engine with its blocks held, and ``pages`` (uint8 [num blocks, page bytes]) are the
    prompt's pages to send."""

    request_id: str
    decode_executor_id: str
    handoff: Handoff
    layout: PageLayout
    pages: Any  # torch.Tensor


@dataclass(frozen=True)
class Reserved:
    """Decode side: the answer to Reserve. ``block_ids``: the blocks the sent pages go into (the
    leading ``num_cached_blocks`` are cached here); empty and ``reason`` set when refused."""

    request_id: str
    accepted: bool
    num_cached_blocks: int = 0
    block_ids: tuple[int, ...] = ()
    reason: str = ""


Event = (
    Outputs
    | Rejected
    | Aborted
    | Failed
    | KVEvents
    | SnapshotTaken
    | StepTraced
    | Prefilled
    | Reserved
)


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
        # KV handoff: requests to hand off after their first token (id -> decode executor), the
        # prefill side's held blocks, and the decode side's reservations.
        self._handoffs: dict[str, str] = {}
        self._detached: dict[str, Detached] = {}
        self._reservations: dict[str, Reservation] = {}
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
            if req.decode_executor_id is not None and req.params.n == 1:
                self._handoffs[req.request_id] = req.decode_executor_id
        elif isinstance(command, Snapshot):
            seq, block_hashes = self.engine.kv_cache_snapshot()
            events.append(SnapshotTaken(command.reply_to, seq, block_hashes))
        elif isinstance(command, Abort):
            rid = command.request_id
            was_running = rid in self._live and self.engine.abort(rid)
            self._live.discard(rid)
            self._arrivals.pop(rid, None)
            self._handoffs.pop(rid, None)
            # A request in transfer: its held blocks or reservation go back to the pool.
            if (detached := self._detached.pop(rid, None)) is not None:
                kv_transfer.release(self._kv_engine, detached)
                was_running = True
            if (reservation := self._reservations.pop(rid, None)) is not None:
                kv_transfer.cancel(self._kv_engine, reservation)
                was_running = True
            events.append(Aborted(rid, was_running))
        else:
            self._apply_handoff(command, events)

    @property
    def _kv_engine(self) -> Engine:
        # Only a real Engine can move KV pages; the handoff commands come only with one.
        return cast("Engine", self.engine)

    def _apply_handoff(self, command: Command, events: list[Event]) -> None:
        engine = self._kv_engine
        if isinstance(command, Reserve):
            rid = command.handoff.request_id
            try:
                reservation = kv_transfer.reserve(engine, command.handoff)
            except ValueError as e:
                events.append(Reserved(rid, False, reason=str(e)))
                return
            if reservation is None:
                events.append(Reserved(rid, False, reason="no free KV blocks for the prompt"))
                return
            self._reservations[rid] = reservation
            events.append(
                Reserved(
                    rid,
                    True,
                    reservation.num_cached_blocks,
                    tuple(reservation.missing_block_ids),
                )
            )
        elif isinstance(command, Install):
            reservation = self._reservations.pop(command.request_id, None)
            if reservation is None:
                return  # aborted meanwhile
            if command.recompute:
                kv_transfer.recompute(engine, reservation)
            else:
                kv_transfer.commit(engine, reservation)
            self._live.add(command.request_id)
        elif isinstance(command, Unreserve):
            if (reservation := self._reservations.pop(command.request_id, None)) is not None:
                kv_transfer.cancel(engine, reservation)
        elif isinstance(command, Release):
            detached = self._detached.pop(command.request_id, None)
            if detached is None:
                return  # aborted meanwhile
            if command.readopt:
                kv_transfer.readopt(engine, detached)
                self._live.add(command.request_id)
            else:
                kv_transfer.release(engine, detached)

    def _hand_off(self, outputs: list[RequestOutput], events: list[Event]) -> None:
        """Requests to hand off that sampled their first token this step leave the engine."""
        for out in outputs:
            decode_id = self._handoffs.pop(out.request_id, None)
            if decode_id is None or out.finished:
                continue
            engine = self._kv_engine
            detached = kv_transfer.detach(engine, out.request_id)
            self._live.discard(out.request_id)
            self._detached[out.request_id] = detached
            events.append(
                Prefilled(
                    out.request_id,
                    decode_id,
                    detached.handoff,
                    kv_transfer.page_layout(engine.kv_cache),
                    kv_transfer.read_pages(engine.kv_cache, detached.block_ids),
                )
            )

    def page_layout(self) -> PageLayout | None:
        """The engine's KV page layout; None for an engine without a paged KV cache (a fake)."""
        cache = getattr(self.engine, "kv_cache", None)
        return None if cache is None else kv_transfer.page_layout(cache)

    @property
    def kv_cache(self) -> Any:
        """The engine's KV cache, for writing received pages into reserved blocks (see
        kv_transfer: a reserved block is touched by nobody else until Install)."""
        return self._kv_engine.kv_cache

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
            self._handoffs.clear()
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
        if self._handoffs and outputs:
            self._hand_off(outputs, events)
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
