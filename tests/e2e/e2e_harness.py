"""Support for the end-to-end tests (the whole stack, the real SmolLM2): the offline engine's greedy
reference for the exact prompt ids the tokenizer service builds, SSE parsing, scheduler status."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.cli.launcher import Stack
from services.tokenizer.prompts import prompt_token_ids
from shared.wire import subjects
from shared.wire.bus import Bus, BusError
from shared.wire.messages import (
    PREFIX_MATCH_REPLY,
    PREFIX_MATCH_REQUEST,
    SCHEDULER_STATUS,
    SCHEDULER_STATUS_REQUEST,
    ChatMessage,
    GenerateRequest,
    PrefixMatchRequest,
    SchedulerStatus,
    SchedulerStatusRequest,
)
from shared.wire.sampling_params import SamplingParams


@dataclass(frozen=True)
class Expected:
    text: str
    num_tokens: int
    finish_reason: str | None
    token_ids: tuple[int, ...]


class Reference:
    """Greedy generation by the offline engine (``LLM``), one prompt at a time (batch of one: the
    canonical greedy output, independent of how the server happened to batch)."""

    def __init__(self, model: str | None = None, **engine: Any) -> None:
        """``model``: its path (default: the default model); ``engine``: settings over these."""
        from shared.engine.llm import LLM

        settings = dict(dtype="float32", num_kv_blocks=256, max_num_seqs=4, num_threads=1)
        self.llm = LLM(model=model, **{**settings, **engine}, progress=False)
        self.tokenizer = self.llm.tokenizer
        self._cache: dict[tuple[Any, ...], Expected] = {}

    def prompt_ids(
        self, *, prompt: str | None = None, messages: list[dict[str, str]] | None = None
    ) -> list[int]:
        """The ids the tokenizer service sends for this request (its own function, not a copy)."""
        req = GenerateRequest(
            request_id="ref",
            model="ref",
            params=SamplingParams(),
            prompt=prompt,
            messages=[ChatMessage(role=m["role"], content=m["content"]) for m in messages]
            if messages is not None
            else None,
        )
        return prompt_token_ids(req, self.tokenizer)[0]

    def greedy(
        self,
        max_tokens: int,
        *,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        **params: Any,
    ) -> Expected:
        key = (prompt, json.dumps(messages), max_tokens, tuple(sorted(params.items())))
        if key not in self._cache:
            ids = self.prompt_ids(prompt=prompt, messages=messages)
            [result] = self.llm.generate(
                ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
            )
            out = result.outputs[0]
            self._cache[key] = Expected(
                out.text, len(out.token_ids), out.finish_reason, tuple(out.token_ids)
            )
        return self._cache[key]


def parse_sse(raw: str) -> tuple[list[dict[str, Any]], bool]:
    """The chunk objects of an SSE body and whether it ended with [DONE]."""
    chunks, done = [], False
    for event in raw.split("\n\n"):
        if not event.strip():
            continue
        assert event.startswith("data: "), event
        data = event[len("data: ") :]
        if data == "[DONE]":
            done = True
        else:
            chunks.append(json.loads(data))
    return chunks, done


def stream_text(chunks: list[dict[str, Any]], chat: bool, index: int = 0) -> str:
    parts = []
    for c in chunks:
        for choice in c.get("choices", []):
            if choice["index"] == index:
                parts.append(choice["delta"].get("content", "") if chat else choice["text"])
    return "".join(parts)


def finish_reason(chunks: list[dict[str, Any]], index: int = 0) -> str | None:
    reasons = [
        ch["finish_reason"]
        for c in chunks
        for ch in c.get("choices", [])
        if ch["index"] == index and ch["finish_reason"]
    ]
    assert len(reasons) <= 1, reasons
    return reasons[0] if reasons else None


def scheduler_status(stack: Stack) -> SchedulerStatus:
    """The scheduler's status, asked as the stack's admin user (a stranger is refused)."""

    async def ask() -> SchedulerStatus:
        async with await Bus.connect(stack.nats_url, "e2e-test", auth=stack.admin_auth) as bus:
            data = await bus.request(
                subjects.SCHEDULER_STATUS,
                SCHEDULER_STATUS_REQUEST.encode(SchedulerStatusRequest()),
                timeout=5,
            )
            return SCHEDULER_STATUS.decode(data)

    return asyncio.run(ask())


def free_blocks(stack: Stack) -> dict[str, int]:
    """Each live executor's free KV blocks, from its last heartbeat (every 0.5 s), as the scheduler
    has it."""
    return {e.executor_id: e.num_free_blocks for e in scheduler_status(stack).executors}


def index_match(stack: Stack, model: str, block_hashes: list[int]) -> dict[str, int] | None:
    """The prefix index's answer (executor id -> leading blocks it holds), or None when it does
    not answer or cannot (Redis down)."""

    async def ask() -> dict[str, int] | None:
        async with await Bus.connect(stack.nats_url, "e2e-test", auth=stack.admin_auth) as bus:
            query = PrefixMatchRequest(model=model, block_hashes=block_hashes)
            try:
                data = await bus.request(
                    subjects.PREFIX_INDEX_MATCH, PREFIX_MATCH_REQUEST.encode(query), timeout=2
                )
            except BusError:
                return None
            reply = PREFIX_MATCH_REPLY.decode(data)
            return None if reply.error else reply.num_blocks

    return asyncio.run(ask())


def metric_total(metrics_text: str, sample: str, **labels: str) -> float:
    """The sum of the samples named ``sample`` (a counter's with its ``_total``) whose labels
    include ``labels``, in a /metrics body; 0 when there is none."""
    return sum(
        s.value
        for family in text_string_to_metric_families(metrics_text)
        for s in family.samples
        if s.name == sample and labels.items() <= s.labels.items()
    )


def served_model(base_url: str, headers: dict[str, str]) -> str:
    r = httpx.get(base_url + "/v1/models", headers=headers, timeout=10)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def wait_for(cond, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
