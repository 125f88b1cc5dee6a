"""An engine that computes nothing: for load-testing the services around it.

Each step sleeps until ``step_ms`` after it began (no CPU: the thread waits) and gives every running
request one token per choice, up to ``max_num_seqs`` requests at once, the rest waiting in arrival
order. A request ends after its ``max_tokens`` (or at ``max_model_len``); stop conditions and EOS
are not modelled. It holds no KV cache: no KV events, no cached prefix, and its block counts are
those a paged cache of ``num_blocks`` blocks would show for the tokens held.

With it, a stack's gateway, tokenizer, scheduler, index and bus carry real traffic at a chosen
token rate while the engine takes none of the machine: what they cost, alone, is what a measurement
beside it sees (``loadtests/bench_stack_vs_engine.py --front-ceiling``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from shared.wire.kv_events import KVEventBatch
from shared.wire.outputs import CompletionDelta, EngineStats, RequestOutput
from shared.wire.sampling_params import SamplingParams

# Each generated token: this id and this text (four characters, about an average token's).
MOCK_TOKEN_ID = 1
MOCK_TOKEN_TEXT = " tok"


@dataclass
class _Request:
    request_id: str
    num_prompt_tokens: int
    num_choices: int
    max_tokens: int
    num_generated: int = 0


@dataclass
class MockEngine:
    model_name: str
    step_ms: float
    max_num_seqs: int
    max_model_len: int = 2048
    block_size: int = 16
    num_blocks: int = 1024
    _running: dict[str, _Request] = field(default_factory=dict)
    _waiting: deque[_Request] = field(default_factory=deque)
    _first_scheduled: list[str] = field(default_factory=list)
    # Cumulative since start, as EngineStats counts them; last_* of the most recent step.
    _num_prompt_tokens: int = 0
    _num_generated_tokens: int = 0
    _num_steps: int = 0
    _last_step_num_tokens: int = 0
    _last_step_num_seqs: int = 0
    _step_seconds_total: float = 0.0

    def __post_init__(self) -> None:
        if self.step_ms <= 0:
            raise ValueError(f"step_ms must be > 0, got {self.step_ms}")
        for name in ("max_num_seqs", "max_model_len", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        block_hashes: list[int] | None = None,
    ) -> None:
        if not prompt:
            raise ValueError("prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens leaves no room in max_model_len "
                f"{self.max_model_len}"
            )
        room = self.max_model_len - len(prompt)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self._waiting.append(_Request(request_id, len(prompt), params.n, max_tokens))
        self._num_prompt_tokens += len(prompt)

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        while self._waiting and len(self._running) < self.max_num_seqs:
            req = self._waiting.popleft()
            self._running[req.request_id] = req
            self._first_scheduled.append(req.request_id)
        time.sleep(self.step_ms / 1000)
        outputs = []
        for req in list(self._running.values()):
            req.num_generated += 1
            done = req.num_generated >= req.max_tokens
            outputs.append(
                RequestOutput(
                    request_id=req.request_id,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=0,
                    finished=done,
                    deltas=[
                        CompletionDelta(
                            index=i,
                            token_ids=[MOCK_TOKEN_ID],
                            text=MOCK_TOKEN_TEXT,
                            finish_reason="length" if done else None,
                        )
                        for i in range(req.num_choices)
                    ],
                )
            )
            if done:
                del self._running[req.request_id]
        self._num_steps += 1
        self._last_step_num_seqs = len(outputs)
        self._last_step_num_tokens = sum(len(o.deltas) for o in outputs)
        self._num_generated_tokens += self._last_step_num_tokens
        self._step_seconds_total += time.perf_counter() - started
        return outputs

    def abort(self, request_id: str) -> bool:
        if self._running.pop(request_id, None) is not None:
            return True
        for req in self._waiting:
            if req.request_id == request_id:
                self._waiting.remove(req)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def take_kv_events(self) -> KVEventBatch | None:
        return None  # it caches nothing

    def kv_cache_snapshot(self) -> tuple[int, list[int]]:
        return 0, []

    def take_first_scheduled(self) -> list[str]:
        ids, self._first_scheduled = self._first_scheduled, []
        return ids

    def stats(self) -> EngineStats:
        blocks_used = sum(
            r.num_choices * -(-(r.num_prompt_tokens + r.num_generated) // self.block_size)
            for r in self._running.values()
        )
        used = min(blocks_used, self.num_blocks)
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_total_blocks=self.num_blocks,
            num_free_blocks=self.num_blocks - used,
            kv_cache_usage=used / self.num_blocks,
            prefix_cache_queries_tokens=self._num_prompt_tokens,
            prefix_cache_hits_tokens=0,
            num_preemptions=0,
            num_prompt_tokens=self._num_prompt_tokens,
            num_computed_tokens=self._num_prompt_tokens + self._num_generated_tokens,
            num_generated_tokens=self._num_generated_tokens,
            num_steps=self._num_steps,
            last_step_num_tokens=self._last_step_num_tokens,
            last_step_num_seqs=self._last_step_num_seqs,
            step_seconds_total=self._step_seconds_total,
        )
