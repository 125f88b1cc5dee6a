"""Test support for the gateway: a FAKE backend on a real NATS server, and the real gateway process.

``FakeBackend`` plays tokenizer + scheduler + executor in one: it takes GenerateRequests on
TOKENIZER_GENERATE (acking each, as the tokenizer does) and publishes scripted StreamOutput /
StreamError on the request's stream subject, records AbortRequests, and answers SCHEDULER_STATUS and
TOKENIZER_STATUS. It runs its own event loop in a thread, so tests stay synchronous (plain httpx /
websockets clients against a real server).

The script is chosen by a keyword in the prompt (completions) or last message (chat):

    (default)         n choices; choice i emits max_tokens - i tokens "c{i}.{step} ", one per step;
                      choice 0 ends with 'length', the others with 'stop'. Even steps carry every
                      choice in one message, odd steps one message per choice (in reverse order).
    error429          StreamError 429 with retry_after_s=1.5, before any output
    error400          StreamError 400 (param 'prompt'), as the tokenizer sends for a too-long prompt
    fail_after_first  one output, then StreamError 503
    hang              nothing at all
    slow              one token every 50 ms (up to 2000) until aborted
    paced             max_tokens tokens, one every 50 ms, then 'length' (a stream that ends on its
                      own, but not at once)
    garbage           an undecodable message
    stall_after_first one output, then nothing (a holder that died mid-stream)
    keepalive         a StreamKeepalive every 0.5 s for 8 s, then one finished output (a request
                      held alive, e.g. queued, longer than a short progress timeout)
    noack             not even acknowledged (a tokenizer that took it and stopped)
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import httpx
import pytest

from services.cli.servers import free_port
from shared.wire import subjects
from shared.wire.bus import Bus
from shared.wire.messages import (
    ABORT_REQUEST,
    EXECUTOR_HEARTBEAT,
    GENERATE_REQUEST,
    METRICS_REPORT,
    SCHEDULER_STATUS,
    STREAM_MESSAGE,
    TOKENIZER_STATUS,
    AbortRequest,
    ExecutorHeartbeat,
    ExecutorStatus,
    GenerateRequest,
    MetricsReport,
    SchedulerStatus,
    StreamError,
    StreamKeepalive,
    StreamOutput,
    TokenizerModelStatus,
    TokenizerStatus,
)
from shared.wire.outputs import CompletionDelta, RequestOutput, TokenLogprobs

FAKE_MODEL = "fake-model"
NUM_PROMPT_TOKENS = 7


def token_text(choice: int, step: int) -> str:
    return f"c{choice}.{step} "


def token_id(choice: int, step: int) -> int:
    return 1000 + 100 * choice + step


def expected_text(choice: int, max_tokens: int) -> str:
    return "".join(token_text(choice, s) for s in range(max_tokens - choice))


class FakeBackend:
    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.requests: dict[str, GenerateRequest] = {}
        self.aborts: list[AbortRequest] = []
        self.num_executors = 1
        self._aborted: dict[str, asyncio.Event] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="fake-backend"
        )
        self._bus: Bus | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._tokenizer_subs: list[Any] = []  # TOKENIZER_GENERATE and _STATUS while "listening"

    # -- lifecycle (called from the test thread) -------------------------------------------------

    def start(self) -> FakeBackend:
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _call(self, coro: Any, timeout: float = 10.0) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout)

    def set_tokenizer_listening(self, listening: bool) -> None:
        """Subscribe to (or leave) the tokenizer's subjects, as a tokenizer that starts (or is gone)
        would."""
        self._call(self._set_tokenizer_listening(listening))

    def wait_abort(self, request_id: str | None = None, timeout: float = 5.0) -> AbortRequest:
        """The abort of ``request_id`` (or the first abort of any request) once it arrives."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for a in list(self.aborts):
                if request_id is None or a.request_id == request_id:
                    return a
            time.sleep(0.02)
        raise AssertionError(
            f"no AbortRequest for {request_id or 'any request'} within {timeout}s; "
            f"got {self.aborts}"
        )

    def request_for(self, keyword: str, timeout: float = 5.0) -> GenerateRequest:
        """The latest request whose prompt contains ``keyword``, waiting up to ``timeout`` seconds
        for one to arrive (a client may give up before the gateway has published its request)."""

        def found() -> list[GenerateRequest]:
            return [r for r in list(self.requests.values()) if keyword in _prompt_text(r)]

        deadline = time.monotonic() + timeout
        while not found():
            assert time.monotonic() < deadline, f"no request with {keyword!r} reached the backend"
            time.sleep(0.02)
        return found()[-1]

    def publish_metrics(self, report: MetricsReport) -> None:
        """Publish a MetricsReport, as a service instance would."""

        async def publish() -> None:
            assert self._bus is not None
            await self._bus.publish(
                subjects.metrics(report.service, report.instance), METRICS_REPORT.encode(report)
            )
            await self._bus.flush()

        self._call(publish())

    def publish_heartbeat(self, heartbeat: ExecutorHeartbeat) -> None:
        """Publish an executor's heartbeat, as an executor would."""

        async def publish() -> None:
            assert self._bus is not None
            await self._bus.publish(
                subjects.executor_stats(heartbeat.executor_id),
                EXECUTOR_HEARTBEAT.encode(heartbeat),
            )
            await self._bus.flush()

        self._call(publish())

    # -- the backend (its own loop) ----------------------------------------------------------------

    async def _start(self) -> None:
        self._bus = bus = await Bus.connect(self.nats_url, "fake-backend")
        await bus.subscribe(subjects.ABORT, self._on_abort)
        await bus.subscribe(subjects.SCHEDULER_STATUS, self._on_status)
        await self._set_tokenizer_listening(True)  # flushes

    async def _set_tokenizer_listening(self, listening: bool) -> None:
        assert self._bus is not None
        if listening and not self._tokenizer_subs:
            self._tokenizer_subs = [
                await self._bus.subscribe(
                    subjects.TOKENIZER_GENERATE, self._on_generate, queue=subjects.QUEUE_TOKENIZER
                ),
                await self._bus.subscribe(
                    subjects.TOKENIZER_STATUS,
                    self._on_tokenizer_status,
                    queue=subjects.QUEUE_TOKENIZER,
                ),
            ]
        elif not listening:
            for sub in self._tokenizer_subs:
                await sub.unsubscribe()
            self._tokenizer_subs = []
        await self._bus.flush()

    async def _stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._bus is not None:
            await self._bus.close()

    async def _on_status(self, msg: Any) -> None:
        executors = [
            ExecutorStatus(
                executor_id=f"fake-{i}",
                model=FAKE_MODEL,
                num_free_blocks=10,
                num_total_blocks=10,
                num_running=0,
                num_waiting=0,
                num_in_flight=0,
                last_heartbeat_age_s=0.1,
                prefix_cache_queries_tokens=100 + i,
                prefix_cache_hits_tokens=50 + i,
            )
            for i in range(self.num_executors)
        ]
        await msg.respond(
            SCHEDULER_STATUS.encode(
                SchedulerStatus(executors=executors, num_queued=0, max_queue_len=8)
            )
        )

    async def _on_tokenizer_status(self, msg: Any) -> None:
        await msg.respond(
            TOKENIZER_STATUS.encode(
                TokenizerStatus(
                    models=[
                        TokenizerModelStatus(name=FAKE_MODEL, max_model_len=2048, block_size=16)
                    ]
                )
            )
        )

    async def _on_abort(self, msg: Any) -> None:
        abort = ABORT_REQUEST.decode(msg.data)
        self.aborts.append(abort)
        self._aborted.setdefault(abort.request_id, asyncio.Event()).set()

    async def _on_generate(self, msg: Any) -> None:
        req = GENERATE_REQUEST.decode(msg.data)
        if "noack" in _prompt_text(req):
            self.requests[req.request_id] = req
            return
        await msg.respond(b"")
        self.requests[req.request_id] = req
        self._aborted.setdefault(req.request_id, asyncio.Event())
        task = asyncio.create_task(self._play(req))  # don't block the next request
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, rid: str, message: StreamOutput | StreamError | StreamKeepalive) -> None:
        assert self._bus is not None
        await self._bus.publish(subjects.stream(rid), STREAM_MESSAGE.encode(message))

    async def _output(
        self, req: GenerateRequest, deltas: list[CompletionDelta], finished: bool
    ) -> None:
        out = RequestOutput(
            request_id=req.request_id,
            deltas=deltas,
            num_prompt_tokens=NUM_PROMPT_TOKENS,
            num_cached_tokens=0,
            finished=finished,
        )
        await self._send(req.request_id, StreamOutput(executor_id="fake-0", output=out))

    def _delta(self, req: GenerateRequest, choice: int, step: int, last: bool) -> CompletionDelta:
        tid = token_id(choice, step)
        n_top = req.params.logprobs
        logprobs = (
            None
            if n_top is None
            else [
                TokenLogprobs(
                    token_id=tid, logprob=-0.25, rank=1, top=[(tid, -0.25), (5, -2.0)][:n_top]
                )
            ]
        )
        return CompletionDelta(
            index=choice,
            token_ids=[tid],
            text=token_text(choice, step),
            logprobs=logprobs,
            finish_reason=("length" if choice == 0 else "stop") if last else None,
        )

    async def _play(self, req: GenerateRequest) -> None:
        text = _prompt_text(req)
        rid = req.request_id
        if "error429" in text:
            await self._send(
                rid,
                StreamError(
                    request_id=rid,
                    status=429,
                    message="queue is full",
                    type="rate_limit_error",
                    retry_after_s=1.5,
                ),
            )
        elif "error400" in text:
            await self._send(
                rid,
                StreamError(
                    request_id=rid,
                    status=400,
                    type="invalid_request_error",
                    message="prompt is too long",
                    param="prompt",
                ),
            )
        elif "fail_after_first" in text:
            await self._output(req, [self._delta(req, 0, 0, False)], False)
            await asyncio.sleep(0.05)
            await self._send(rid, StreamError(request_id=rid, status=503, message="executor died"))
        elif "garbage" in text:
            assert self._bus is not None
            await self._bus.publish(subjects.stream(rid), b"\xc1 not msgpack")
        elif "hang" in text:
            pass
        elif "stall_after_first" in text:
            await self._output(req, [self._delta(req, 0, 0, False)], False)
        elif "keepalive" in text:
            for _ in range(16):
                await asyncio.sleep(0.5)
                await self._send(
                    rid, StreamKeepalive(request_id=rid, holder="fake-scheduler", state="queued")
                )
            await self._output(req, [self._delta(req, 0, 0, True)], True)
        elif "paced" in text:
            num_tokens = req.params.max_tokens or 16
            for step in range(num_tokens):
                if self._aborted[rid].is_set():
                    return
                last = step == num_tokens - 1
                await self._output(req, [self._delta(req, 0, step, last)], last)
                await asyncio.sleep(0.05)
        elif "slow" in text:
            for step in range(2000):
                if self._aborted[rid].is_set():
                    return
                await self._output(req, [self._delta(req, 0, step, False)], False)
                await asyncio.sleep(0.05)
        else:
            await self._play_script(req)

    async def _play_script(self, req: GenerateRequest) -> None:
        n, max_tokens = req.params.n, req.params.max_tokens or 16
        lengths = [max_tokens - i for i in range(n)]
        for step in range(max_tokens):
            deltas = [
                self._delta(req, i, step, step == lengths[i] - 1)
                for i in range(n)
                if step < lengths[i]
            ]
            last_step = step == max_tokens - 1
            if step % 2 == 0:
                await self._output(req, deltas, last_step)
            else:
                for j, delta in enumerate(reversed(deltas)):
                    await self._output(req, [delta], last_step and j == len(deltas) - 1)


def _prompt_text(req: GenerateRequest) -> str:
    if req.messages:
        return req.messages[-1].content
    return req.prompt or ""


class GatewayProcess:
    """``python -m services.gateway`` on a free loopback port (a real uvicorn server: streams are
    seen as a client sees them, unlike httpx's in-process ASGI transport, which buffers them)."""

    def __init__(self, nats_url: str, *args: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        argv = [
            sys.executable,
            "-m",
            "services.gateway",
            "--nats-url",
            nats_url,
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *args,
        ]
        # The key by environment, as the launcher passes it (the gateway refuses it on argv).
        env = {k: v for k, v in os.environ.items() if k != "LLMSERVE_API_KEY"}
        if api_key:
            env["LLMSERVE_API_KEY"] = api_key
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**env, "PYTHONUNBUFFERED": "1"},
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.output()}")
            try:
                if httpx.get(self.base_url + "/metrics", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gateway not ready in {timeout}s: {self.output()}")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def output(self) -> str:
        if self.process.poll() is None:
            return "(still running)"
        assert self.process.stdout is not None
        return self.process.stdout.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def sse_events(raw: str) -> list[str]:
    """The data payloads of an SSE body, asserting the exact framing: ``data: ...\\n\\n`` only."""
    assert raw.endswith("\n\n"), raw[-200:]
    events = raw[:-2].split("\n\n")
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, e
    return [e[len("data: ") :] for e in events]


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def backend(nats_server) -> Iterator[FakeBackend]:
    """The fake executor side of the gateway tests: a tokenizer, scheduler and executor in one."""
    fake = FakeBackend(nats_server.url).start()
    yield fake
    fake.stop()
