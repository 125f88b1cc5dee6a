"""The gateway process against hostile or careless clients (issue 21), over a real nats-server and
the fake backend: bodies bounded while they are read (413 in well under a second while a small
request is served as usual), integers of any size answered with a 400 naming the field and the
in-flight gauge back at zero, JSON depth bounded on HTTP and WebSocket, JSON-only bodies (415) and
no CORS, plain 404s for unknown routes, idle connections closed."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect
from websockets.typing import Origin

from helpers.gateway_harness import FAKE_MODEL, GatewayProcess, expected_text

KEEP_ALIVE_S = 1.0
BODY_TIMEOUT_S = 1.5
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def gateway(nats_server, backend) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(
        nats_server.url,
        "--request-timeout",
        "5",
        "--keep-alive-timeout",
        str(KEEP_ALIVE_S),
        "--body-timeout",
        str(BODY_TIMEOUT_S),
    )
    yield gw
    gw.stop()


@pytest.fixture
def client(gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.base_url, timeout=20) as c:
        yield c


def completion(**body) -> dict:
    return {"model": FAKE_MODEL, "prompt": "hello", "max_tokens": 4, **body}


def chat(**body) -> dict:
    return {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi"}], **body}


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def in_flight(gateway: GatewayProcess) -> float:
    text = httpx.get(gateway.base_url + "/metrics").text
    # Other gateways on this bus are in its /metrics too; its own series come first.
    line = next(
        x for x in text.splitlines() if x.startswith("llmserve:gateway_requests_in_flight{")
    )
    return float(line.split()[1])


def small_request(base_url: str) -> float:
    t0 = time.monotonic()
    r = httpx.post(base_url + "/v1/completions", json=completion(max_tokens=2), timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_text(0, 2)
    return time.monotonic() - t0


# ------------------------------------------------------------------------------- bounded bodies


def post_raw(port: int, prefix: bytes, filler: bytes, size: int, *, chunked: bool):
    """POST /v1/completions with a ``size``-byte body (``prefix``, then ``filler`` repeated),
    written in 64 KiB pieces by another thread while this one waits for the answer. Returns the
    status, the seconds until the answer, and its JSON body."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(10)
    framing = b"Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}".encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n" + framing + b"\r\n\r\n"
    )

    def pieces() -> Iterator[bytes]:
        if prefix:  # (an empty chunk would end a chunked body)
            yield prefix
        piece = filler * max(1, 65536 // len(filler))
        for _ in range((size - len(prefix)) // len(piece)):
            yield piece

    def write_body() -> None:
        try:
            for piece in pieces():
                sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece)
        except OSError:
            pass  # refused: the server closed the connection

    t0 = time.monotonic()
    sock.sendall(head)
    writer = threading.Thread(target=write_body, daemon=True)
    writer.start()
    response = b""
    try:
        while b"\r\n\r\n" not in response or not response.rstrip().endswith(b"}"):
            part = sock.recv(65536)
            if not part:
                break
            response += part
    except ConnectionResetError:
        pass
    elapsed = time.monotonic() - t0
    sock.close()
    writer.join(10)
    status = int(response.split(b" ", 2)[1])
    return status, elapsed, json.loads(response.split(b"\r\n\r\n", 1)[1])


_PROMPT = b'{"model": "fake-model", "max_tokens": 2, "prompt": "'
_STOP = b'{"model": "fake-model", "prompt": "x", "stop": ['


@pytest.mark.parametrize(
    "name, prefix, filler, size, chunked",
    [
        ("100 MB body", b"", b"x", 100 * MiB, False),
        ("100 MB body, chunked", b"", b"x", 100 * MiB, True),
        ("7 MB prompt", _PROMPT, b"word ", 7 * MiB, False),
        ("7 MB prompt, chunked", _PROMPT, b"word ", 7 * MiB, True),
        ("10 MB stop list", _STOP, b'"stop", ', 10 * MiB, False),
        ("10 MB stop list, chunked", _STOP, b'"stop", ', 10 * MiB, True),
    ],
)
def test_big_bodies_are_refused_while_read_and_others_are_served(
    gateway, name, prefix, filler, size, chunked
):
    idle = [small_request(gateway.base_url) for _ in range(5)]
    latencies: list[float] = []
    stop = threading.Event()

    def small_requests() -> None:
        while not stop.is_set():
            latencies.append(small_request(gateway.base_url))

    others = threading.Thread(target=small_requests)
    others.start()
    try:
        status, elapsed, body = post_raw(gateway.port, prefix, filler, size, chunked=chunked)
        time.sleep(0.2)
    finally:
        stop.set()
        others.join(10)
    print(
        f"{name}: {status} in {elapsed * 1000:.0f} ms; small requests: idle median "
        f"{statistics.median(idle) * 1000:.0f} ms, meanwhile median "
        f"{statistics.median(latencies) * 1000:.0f} ms (max {max(latencies) * 1000:.0f} ms, "
        f"{len(latencies)} requests)"
    )
    assert status == 413 and elapsed < 1.0
    assert body["error"]["code"] == "request_too_large" and str(4 * MiB) in body["error"]["message"]
    assert latencies and max(latencies) < 1.0
    assert in_flight(gateway) == 0


def test_a_body_over_the_bus_max_payload_is_413_not_503(nats_server, backend):
    """With the body limit raised past the bus's max_payload (8 MiB here), a body that passes it
    still cannot travel: 413, not a retryable 503."""
    gw = GatewayProcess(nats_server.url, "--max-body-bytes", str(16 * MiB))
    try:
        r = httpx.post(
            gw.base_url + "/v1/completions", json=completion(prompt="w " * (5 * MiB)), timeout=20
        )
        err = error_of(r, 413)
        assert "max_payload" not in err["message"] and str(8 * MiB) in err["message"]
        assert in_flight(gw) == 0
        small_request(gw.base_url)
    finally:
        gw.stop()


def test_stop_lists_are_bounded(client):
    for stop, match in (
        (["s"] * 33, "at most 32 strings"),
        (["s" * 1025], "at most 1024 characters"),
    ):
        err = error_of(client.post("/v1/completions", json=completion(stop=stop)), 400)
        assert err["param"] == "stop" and match in err["message"]
    err = error_of(client.post("/v1/completions", json=completion(stop_token_ids=[1] * 1025)), 400)
    assert err["param"] == "stop_token_ids"
    assert (
        client.post("/v1/completions", json=completion(stop=["s" * 1024] * 32)).status_code == 200
    )


# ------------------------------------------------------------------------------ integer ranges

HUGE = 2**64


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", completion(priority=HUGE), "priority"),
        ("/v1/completions", completion(priority=-HUGE), "priority"),
        ("/v1/completions", completion(top_k=HUGE), "top_k"),
        ("/v1/completions", completion(max_tokens=HUGE), "max_tokens"),
        ("/v1/completions", completion(max_tokens=2**100), "max_tokens"),
        ("/v1/completions", completion(stop_token_ids=[2, HUGE]), "stop_token_ids"),
        ("/v1/completions", completion(n=HUGE), "n"),
        ("/v1/completions", completion(seed=HUGE), "seed"),
        ("/v1/completions", completion(seed=-HUGE), "seed"),
        ("/v1/completions", completion(logprobs=HUGE), "logprobs"),
        ("/v1/completions", completion(prompt=[1, HUGE]), "prompt"),
        ("/v1/completions", completion(prompt=[[1, 2**70]]), "prompt"),
        ("/v1/completions", completion(best_of=HUGE), "best_of"),
        ("/v1/chat/completions", chat(max_completion_tokens=HUGE), "max_completion_tokens"),
        ("/v1/chat/completions", chat(logprobs=True, top_logprobs=HUGE), "top_logprobs"),
        ("/v1/chat/completions", chat(priority=HUGE, stream=True), "priority"),
        ("/v1/chat/completions", chat(top_k=HUGE, stream=True), "top_k"),
    ],
)
def test_integers_of_any_size_are_a_400_naming_the_field(gateway, client, path, body, param):
    err = error_of(client.post(path, json=body), 400)
    assert err["param"] == param, err
    assert in_flight(gateway) == 0  # no error path leaves a request counted in flight
    small_request(gateway.base_url)


def test_huge_integers_on_the_websocket(gateway):
    url = gateway.base_url.replace("http://", "ws://") + "/v1/ws"
    with connect(url, open_timeout=10) as ws:
        ws.send(json.dumps(completion(top_k=HUGE)))
        assert json.loads(ws.recv(timeout=10))["error"]["param"] == "top_k"
        assert json.loads(ws.recv(timeout=10)) == {"done": True}
        ws.send(json.dumps(completion(max_tokens=1)))
        assert json.loads(ws.recv(timeout=10))["choices"][0]["text"] == expected_text(0, 1)
    assert in_flight(gateway) == 0


# ---------------------------------------------------------------------------------- JSON depth


def nested(depth: int) -> bytes:
    return json.dumps(completion()).encode()[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}"


def test_deep_json_is_a_400_on_http(client):
    for depth in (300, 100_000):
        r = client.post(
            "/v1/completions", content=nested(depth), headers={"Content-Type": "application/json"}
        )
        assert "nested too deeply" in error_of(r, 400)["message"]
    r = client.post(
        "/v1/completions", content=nested(50), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 200


def test_deep_json_on_the_websocket_gets_a_close_frame_with_a_reason(gateway):
    url = gateway.base_url.replace("http://", "ws://") + "/v1/ws"
    with connect(url, open_timeout=10) as ws:
        ws.send(nested(100_000).decode())
        assert "nested too deeply" in json.loads(ws.recv(timeout=10))["error"]["message"]
        with pytest.raises(ConnectionClosed) as e:
            ws.recv(timeout=10)
    assert e.value.rcvd is not None
    assert e.value.rcvd.code == 1007 and "nested too deeply" in e.value.rcvd.reason
    # The gateway is unharmed.
    with connect(url, open_timeout=10) as ws:
        ws.send(json.dumps(completion(max_tokens=1)))
        assert json.loads(ws.recv(timeout=10))["choices"][0]["text"] == expected_text(0, 1)


def test_a_websocket_message_over_the_body_limit_is_closed_1009(gateway):
    url = gateway.base_url.replace("http://", "ws://") + "/v1/ws"
    with connect(url, open_timeout=10, max_size=None) as ws:
        ws.send(json.dumps(completion(prompt="w" * (5 * MiB))))
        with pytest.raises(ConnectionClosed) as e:
            ws.recv(timeout=10)
    assert e.value.rcvd is not None and e.value.rcvd.code == 1009


# -------------------------------------------------------------------- content types and origins


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
)
def test_only_json_bodies_are_accepted(gateway, content_type):
    """A browser sends these cross-origin without a preflight; a JSON API must not take them."""
    headers = {"Content-Type": content_type} if content_type else {}
    for path, body in (("/v1/completions", completion()), ("/v1/chat/completions", chat())):
        req = httpx.Request(
            "POST", gateway.base_url + path, content=json.dumps(body), headers=headers
        )
        assert req.headers.get("Content-Type") == content_type
        err = error_of(httpx.Client().send(req), 415)
        assert err["code"] == "unsupported_media_type"
    ok = httpx.post(
        gateway.base_url + "/v1/completions",
        content=json.dumps(completion()),
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert ok.status_code == 200


def test_no_cors(gateway):
    origin = {"Origin": "https://evil.example"}
    preflight = httpx.options(
        gateway.base_url + "/v1/completions",
        headers={**origin, "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code in (404, 405)
    r = httpx.post(gateway.base_url + "/v1/completions", json=completion(), headers=origin)
    assert r.status_code == 200
    for response in (preflight, r):
        assert not [h for h in response.headers if h.lower().startswith("access-control-")]


def test_a_cross_origin_websocket_is_refused(gateway):
    url = gateway.base_url.replace("http://", "ws://") + "/v1/ws"
    with connect(url, open_timeout=10, origin=Origin("https://evil.example")) as ws:
        assert json.loads(ws.recv(timeout=5))["error"]["code"] == "forbidden"
        with pytest.raises(ConnectionClosed) as e:
            ws.recv(timeout=5)
    assert e.value.rcvd is not None and e.value.rcvd.code == 1008
    with connect(url, open_timeout=10, origin=Origin(gateway.base_url)) as ws:
        ws.send(json.dumps(completion(max_tokens=1)))
        assert json.loads(ws.recv(timeout=10))["choices"][0]["text"] == expected_text(0, 1)


# ------------------------------------------------------------------------- routes, connections


def test_an_unknown_route_is_a_plain_404(client):
    err = error_of(client.get("/v1/nothing"), 404)
    assert err["code"] is None and err["message"] == "Invalid URL (GET /v1/nothing)"
    err = error_of(client.post("/v1/chat/completion", json=chat()), 404)
    assert err["code"] is None and "model" not in err["message"]
    # A model that does not exist still says so.
    assert error_of(client.get("/v1/models/gpt-5"), 404)["code"] == "model_not_found"


def closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closes ``sock`` (fails if it stays open ``seconds``)."""
    sock.settimeout(seconds)
    t0 = time.monotonic()
    while True:
        try:
            if not sock.recv(65536):
                return time.monotonic() - t0
        except ConnectionResetError:
            return time.monotonic() - t0
        except TimeoutError:
            raise AssertionError(f"connection still open after {seconds} s") from None


def test_a_trickled_body_is_408_within_the_body_timeout(gateway):
    """A body sent a byte every 0.1 s (its head complete, so the keep-alive timeout no longer
    applies) is answered 408 once the body timeout passes, and the connection is closed; a small
    request meanwhile is served as usual."""
    body = json.dumps(completion(prompt="x" * 200)).encode()
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        t0 = time.monotonic()
        sock.settimeout(0.1)
        response = b""
        for byte in body:
            try:
                sock.sendall(bytes([byte]))
                response += sock.recv(65536)
            except TimeoutError:
                pass
            except OSError:
                break
            if response or time.monotonic() - t0 > BODY_TIMEOUT_S + 3:
                break
        sock.settimeout(5)
        elapsed = time.monotonic() - t0
        small_request(gateway.base_url)
        try:
            while part := sock.recv(65536):
                response += part
        except ConnectionResetError:
            pass
    assert BODY_TIMEOUT_S - 0.2 <= elapsed < BODY_TIMEOUT_S + 2
    assert response.startswith(b"HTTP/1.1 408"), response[:200]
    error = json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "body_timeout"
    assert b"connection: close" in response.lower()
    assert in_flight(gateway) == 0


def test_idle_connections_are_closed(gateway):
    # Opened and never used.
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        assert closed_within(sock, KEEP_ALIVE_S + 2) >= KEEP_ALIVE_S - 0.2
    # A request head sent a byte at a time, never finished.
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        t0 = time.monotonic()
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.1)
            if time.monotonic() - t0 > KEEP_ALIVE_S + 2:
                raise AssertionError("a trickled request head kept the connection open")
        closed_within(sock, KEEP_ALIVE_S + 2)
        assert time.monotonic() - t0 < KEEP_ALIVE_S + 2
    # Idle after a response (uvicorn's own keep-alive timeout, now configurable).
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        closed_within(sock, KEEP_ALIVE_S + 2)
    # A connection in use is not cut: a stream longer than the timeout runs to its end.
    with httpx.Client(base_url=gateway.base_url, timeout=20) as c:
        r = c.post("/v1/completions", json=completion(prompt="paced", max_tokens=40, stream=True))
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
