"""The gateway process on SIGTERM (issue 21, finding 7): it stops admission (503 with Retry-After,
/health 503), lets running streams finish within the drain deadline, and ends the rest with an SSE
error event then ``data: [DONE]``, or on a WebSocket an error, ``{"done": true}`` and a close frame,
aborting each on the bus: never a bare TCP close."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time

import httpx
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from helpers.gateway_harness import FAKE_MODEL, GatewayProcess, sse_events

DRAIN_S = 2.0


def completion(prompt: str, **body) -> dict:
    return {"model": FAKE_MODEL, "prompt": prompt, "stream": True, **body}


class SSEReader(threading.Thread):
    """Reads one streaming response to its end; ``raw`` holds every byte, ``error`` a transport
    failure (a connection cut before the response ended)."""

    def __init__(self, base_url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.base_url, self.body = base_url, body
        self.started = threading.Event()
        self.raw = ""
        self.status = 0
        self.request_id = ""
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with (
                httpx.Client(base_url=self.base_url, timeout=30) as c,
                c.stream("POST", "/v1/completions", json=self.body) as r,
            ):
                self.status, self.request_id = r.status_code, r.headers.get("x-request-id", "")
                for text in r.iter_text():
                    self.raw += text
                    self.started.set()
        except Exception as e:  # recorded for the test to assert on
            self.error = e
        finally:
            self.started.set()


def test_sigterm_drains_then_ends_streams_with_an_error_and_done(nats_server, backend):
    gw = GatewayProcess(nats_server.url, "--drain-timeout", str(DRAIN_S))
    ws_url = gw.base_url.replace("http://", "ws://") + "/v1/ws"
    with contextlib.ExitStack() as sockets:
        _drain(gw, ws_url, sockets, backend)


def _drain(gw: GatewayProcess, ws_url: str, sockets: contextlib.ExitStack, backend) -> None:
    try:
        endless = SSEReader(gw.base_url, completion("slow endless", max_tokens=None))
        finishing = SSEReader(gw.base_url, completion("paced finishing", max_tokens=20))
        endless.start()
        assert endless.started.wait(10)
        busy_ws = sockets.enter_context(connect(ws_url, open_timeout=10))
        busy_ws.send(json.dumps(completion("slow ws", max_tokens=None)))
        ws_request_id = json.loads(busy_ws.recv(timeout=10))["id"]
        idle_ws = sockets.enter_context(connect(ws_url, open_timeout=10))
        finishing.start()
        assert finishing.started.wait(10)

        t0 = time.monotonic()
        gw.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)

        # Admission is closed, with a hint to retry; the load balancer's probe says so too.
        r = httpx.post(gw.base_url + "/v1/completions", json=completion("new", stream=False))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["message"] == "The server is shutting down; retry the request."
        health = httpx.get(gw.base_url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        # An idle WebSocket is closed at once, with a close frame.
        try:
            idle_ws.recv(timeout=5)
            raise AssertionError("the idle WebSocket received a message")
        except ConnectionClosed as e:
            assert e.rcvd is not None and e.rcvd.code == 1001

        # A stream that ends within the deadline ends as usual.
        finishing.join(10)
        assert finishing.error is None and finishing.status == 200
        events = sse_events(finishing.raw)
        assert events[-1] == "[DONE]" and all("error" not in e for e in events)
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"

        # The endless one: at the deadline, an error event, then [DONE], then a clean end.
        endless.join(DRAIN_S + 8)
        cut_at = time.monotonic() - t0
        assert endless.error is None, endless.error
        events = sse_events(endless.raw)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
        assert DRAIN_S - 0.5 < cut_at < DRAIN_S + 5
        assert backend.wait_abort(endless.request_id).reason == "gateway shutting down"

        # The busy WebSocket: its chunks, an error, done, then a close frame.
        items = []
        try:
            while True:
                items.append(json.loads(busy_ws.recv(timeout=10)))
        except ConnectionClosed as e:
            assert e.rcvd is not None and e.rcvd.code == 1001
        assert items[-1] == {"done": True} and "shutting down" in items[-2]["error"]["message"]
        assert backend.wait_abort(ws_request_id).reason == "gateway shutting down"

        # Then the process exits (by the signal, as uvicorn re-raises it after its shutdown).
        assert gw.process.wait(10) in (0, -signal.SIGTERM)
    finally:
        gw.stop()
