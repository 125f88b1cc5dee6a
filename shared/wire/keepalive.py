"""Keepalives on a request's stream: who holds a request says so while it has nothing to stream.

The gateway fails a request whose stream stays silent for its progress timeout (several
``KEEPALIVE_INTERVAL_S``), so every holder keeps each request it holds from going silent for
longer than an interval: the tokenizer from its ack until the scheduler acks the submit, the
scheduler while the request waits in its queue, the executor from accepting it to its last output
(outputs count as proof of life; keepalives fill only the gaps, as a long prefill or a preempted
request leaves). A holder that dies stops them, and its requests fail at the gateway within the
progress timeout instead of hanging until the request timeout.

The other direction: a request whose gateway died (or dropped it without an abort) has nobody
reading its stream, and its holder would compute it to the end for nobody. ``clients_gone`` sends
the keepalive as a NATS *request*: the gateway never answers it (it only reads keepalives), so with
its subscription there the request just times out; with nobody subscribed to the stream the server
answers at once that there are no responders, and the holder aborts it.

``SilenceTracker`` is the pure bookkeeping (no asyncio, no NATS); ``send_keepalives`` the publish.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from shared.wire import subjects
from shared.wire.bus import Bus, BusNoResponders, BusTimeout
from shared.wire.messages import KEEPALIVE_INTERVAL_S, STREAM_MESSAGE, StreamKeepalive

__all__ = ["KEEPALIVE_INTERVAL_S", "SilenceTracker", "clients_gone", "send_keepalives"]


class SilenceTracker:
    """When each held request's stream last carried something from us. ``due`` names those silent
    for ``interval_s`` or more and counts them as spoken for now: called every fraction of an
    interval, no held stream goes silent much longer than one interval."""

    def __init__(self, interval_s: float = KEEPALIVE_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._last: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._last

    def touch(self, request_id: str, now: float) -> None:
        """Something was just published on its stream (or we just took it)."""
        self._last[request_id] = now

    def forget(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    def clear(self) -> None:
        self._last.clear()

    def due(self, now: float) -> list[str]:
        due = [rid for rid, last in self._last.items() if now - last >= self.interval_s]
        for rid in due:
            self._last[rid] = now
        return due


async def send_keepalives(bus: Bus, holder: str, items: Iterable[tuple[str, str]]) -> None:
    """One StreamKeepalive per (request id, state) on that request's stream. BusError propagates
    (the caller's loop logs it and tries again at its next tick)."""
    for request_id, state in items:
        await bus.publish(
            subjects.stream(request_id),
            STREAM_MESSAGE.encode(
                StreamKeepalive(request_id=request_id, holder=holder, state=state)
            ),
        )


async def clients_gone(
    bus: Bus, holder: str, items: Iterable[tuple[str, str]], timeout_s: float
) -> list[str]:
    """The request ids of ``items`` (request id, state) whose stream nobody reads any more: each
    gets its keepalive as a request, all at once; no responders means gone, a timeout means a
    reader is there. Other bus errors propagate."""

    async def gone(request_id: str, state: str) -> bool:
        keepalive = StreamKeepalive(request_id=request_id, holder=holder, state=state)
        try:
            await bus.request(
                subjects.stream(request_id), STREAM_MESSAGE.encode(keepalive), timeout=timeout_s
            )
        except BusNoResponders:
            return True
        except BusTimeout:
            pass
        return False

    items = list(items)
    answers = await asyncio.gather(*(gone(rid, state) for rid, state in items))
    return [rid for (rid, _), is_gone in zip(items, answers, strict=True) if is_gone]
