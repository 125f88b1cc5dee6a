"""The scheduler's waiting requests: one priority queue per model, so a busy model does not hold
up another one's requests.

Within a model the order is: retries first (a higher ``attempt`` first), then ``priority``, then
arrival (``InFlight.order``, kept when a refused request waits again, so it returns to its old
place). A removed request is marked and skipped when it reaches the front; an emptied queue is
dropped. Pure: the router calls it; nothing here knows about executors.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from services.scheduler.executors import InFlight


@dataclass(order=True)
class _Queued:
    sort_key: tuple[int, int, int]  # (-attempt, priority, arrival order)
    entry: InFlight = field(compare=False)
    removed: bool = field(compare=False, default=False)


class WaitingQueues:
    def __init__(self) -> None:
        self._heaps: dict[str, list[_Queued]] = {}  # model -> its queue; removed entries linger
        self._live: dict[str, _Queued] = {}  # request id -> its live entry

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def request_ids(self) -> list[str]:
        return list(self._live)

    def entries(self) -> list[InFlight]:
        """Every waiting request (a copy: removing while iterating over it is fine)."""
        return [queued.entry for queued in self._live.values()]

    def models(self) -> list[str]:
        """Models with a queue (possibly holding only removed entries until ``head`` looks)."""
        return list(self._heaps)

    def push(self, entry: InFlight) -> None:
        request = entry.request
        queued = _Queued((-request.attempt, request.priority, entry.order), entry)
        heapq.heappush(self._heaps.setdefault(request.model, []), queued)
        self._live[request.request_id] = queued

    def head(self, model: str) -> InFlight | None:
        """The model's first waiting request; None when none waits."""
        heap = self._heaps.get(model)
        while heap and heap[0].removed:
            heapq.heappop(heap)
        if not heap:
            self._heaps.pop(model, None)
            return None
        return heap[0].entry

    def pop(self, model: str) -> InFlight:
        """Take the model's first waiting request out; there must be one (``head`` said so)."""
        entry = self.head(model)
        assert entry is not None, f"no request waits for {model}"
        heapq.heappop(self._heaps[model])
        del self._live[entry.request.request_id]
        return entry

    def remove(self, request_id: str) -> InFlight | None:
        """Take a request out wherever it waits; None if it does not."""
        queued = self._live.pop(request_id, None)
        if queued is None:
            return None
        queued.removed = True
        return queued.entry

    def clear(self) -> None:
        self._heaps.clear()
        self._live.clear()
