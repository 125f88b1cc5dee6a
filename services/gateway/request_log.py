"""The console's table of recent requests: each one this gateway served, from dispatch to its end.

    dispatched ─ack─▶ accepted ─keepalives─▶ <the holder's state: tokenizing, queued, waiting,
    running> ─first token─▶ streaming ─▶ done | error | cancelled

A request's record is updated from the three places that see it: its RequestTracker (tokens, the
end), its GenerationStream (the ack, and each StreamKeepalive's holder and state). Keepalives come
only after a holder was silent for KEEPALIVE_INTERVAL_S, so a fast request goes straight from
accepted to streaming. Bounded: the oldest record is forgotten when a new one would exceed
``capacity`` (a forgotten live request still updates its record, which nobody reads any more).
Pure: no asyncio, no NATS; times are passed in (monotonic) except the wall-clock ``created_at``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

CANCELLED = 499  # the client went away first (metrics.CLIENT_CLOSED)


@dataclass
class RequestRecord:
    request_id: str
    endpoint: str  # "completions", "chat_completions", "ws"
    model: str
    stream: bool
    max_tokens: int | None
    created_at: float  # wall clock, for display
    started: float  # monotonic: TTFT and E2E count from here (the body parsed)
    state: str = "dispatched"
    holder: str = ""  # who holds it: "tokenizer", a scheduler, an executor id
    ttft_s: float | None = None
    num_tokens: int = 0  # generated so far, every choice
    num_prompt_tokens: int = 0  # known once it ends
    e2e_s: float | None = None
    status: int | None = None  # the HTTP status it ended with (499: the client left first)
    finish_reason: str | None = None

    @property
    def ended(self) -> bool:
        return self.status is not None

    def on_accepted(self) -> None:
        if not self.ended and self.state == "dispatched":
            self.state, self.holder = "accepted", "tokenizer"

    def on_keepalive(self, holder: str, state: str) -> None:
        # A keepalive may trail the first token (an executor's, for a running request): the
        # holder is news, the state is not once tokens flow.
        if self.ended:
            return
        self.holder = holder
        if self.ttft_s is None:
            self.state = state or "held"

    def on_output(self, executor_id: str) -> None:
        if not self.ended:
            self.holder = executor_id

    def on_tokens(self, num_tokens: int, now: float) -> None:
        if num_tokens <= 0 or self.ended:
            return
        if self.ttft_s is None:
            self.ttft_s = now - self.started
            self.state = "streaming"
        self.num_tokens += num_tokens

    def done(
        self,
        status: int,
        now: float,
        num_prompt_tokens: int = 0,
        finish_reasons: list[str | None] | None = None,
    ) -> None:
        if self.ended:
            return
        self.status = status
        self.e2e_s = now - self.started
        self.num_prompt_tokens = num_prompt_tokens
        self.finish_reason = next((r for r in finish_reasons or [] if r), None)
        self.state = "done" if status == 200 else "cancelled" if status == CANCELLED else "error"

    def as_json(self, now: float) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "model": self.model,
            "stream": self.stream,
            "max_tokens": self.max_tokens,
            "created_at": self.created_at,
            "state": self.state,
            "holder": self.holder,
            "age_s": now - self.started,
            "ttft_s": self.ttft_s,
            "num_tokens": self.num_tokens,
            "num_prompt_tokens": self.num_prompt_tokens,
            "e2e_s": self.e2e_s,
            "status": self.status,
            "finish_reason": self.finish_reason,
        }


class RequestLog:
    def __init__(self, capacity: int = 100) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._records: OrderedDict[str, RequestRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: RequestRecord) -> RequestRecord:
        self._records[record.request_id] = record
        self._records.move_to_end(record.request_id)
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)
        return record

    def get(self, request_id: str) -> RequestRecord | None:
        return self._records.get(request_id)

    def newest_first(self) -> list[RequestRecord]:
        return list(reversed(self._records.values()))
