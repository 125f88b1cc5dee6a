"""The /v1/ws WebSocket endpoint against a real nats-server and the fake backend: the same chunk
objects as SSE then {"done": true}, errors, abort on request and on close, auth."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from helpers.gateway_harness import FAKE_MODEL, GatewayProcess, expected_text

API_KEY = "ws-key"


@pytest.fixture(scope="module")
def gateway(nats_server, backend) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(nats_server.url, "--request-timeout", "5", api_key=API_KEY)
    yield gw
    gw.stop()


@pytest.fixture
def ws(gateway) -> Iterator[ClientConnection]:
    url = gateway.base_url.replace("http://", "ws://") + "/v1/ws"
    with connect(url, additional_headers=gateway.headers(), open_timeout=10) as conn:
        yield conn


def until_done(ws: ClientConnection) -> list[dict]:
    items: list[dict] = []
    while True:
        item = json.loads(ws.recv(timeout=10))
        if item == {"done": True}:
            return items
        items.append(item)


def test_completion_then_chat_on_one_socket(ws):
    ws.send(
        json.dumps(
            {
                "model": FAKE_MODEL,
                "prompt": "hello",
                "max_tokens": 3,
                "stream_options": {"include_usage": True},
            }
        )
    )
    chunks = until_done(ws)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == expected_text(0, 3)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3

    ws.send(
        json.dumps(
            {
                "model": FAKE_MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "n": 2,
            }
        )
    )
    chunks = until_done(ws)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = {0: "", 1: ""}
    for c in chunks:
        text[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content", "")
    assert text == {0: expected_text(0, 2), 1: expected_text(1, 2)}


def test_errors_are_objects_then_done_and_the_socket_stays_usable(ws):
    for bad in (
        "{nope",
        json.dumps({"model": "other", "prompt": "x"}),
        json.dumps({"model": FAKE_MODEL, "prompt": "error429"}),
        "[1, 2]",
    ):
        ws.send(bad)
        [item] = until_done(ws)
        assert set(item["error"]) == {"message", "type", "param", "code"}
    ws.send(json.dumps({"model": FAKE_MODEL, "prompt": "fail_after_first"}))
    items = until_done(ws)
    assert items[0]["choices"][0]["text"] and items[-1]["error"]["message"] == "executor died"
    ws.send(json.dumps({"model": FAKE_MODEL, "prompt": "ok", "max_tokens": 1}))
    assert until_done(ws)[0]["choices"][0]["text"] == expected_text(0, 1)


def test_abort_message_and_close_abort_the_request(ws, gateway, backend):
    ws.send(json.dumps({"model": FAKE_MODEL, "prompt": "slow ws abort", "max_tokens": None}))
    first = json.loads(ws.recv(timeout=10))
    ws.send(json.dumps({"abort": True}))
    rest = until_done(ws)  # ends promptly with done, no error
    assert all("error" not in item for item in rest)
    assert backend.wait_abort(first["id"]).reason == "client disconnected"

    url = gateway.base_url.replace("http://", "ws://") + "/v1/ws"
    with connect(url, additional_headers=gateway.headers()) as other:
        other.send(json.dumps({"model": FAKE_MODEL, "prompt": "slow ws close", "max_tokens": None}))
        rid = json.loads(other.recv(timeout=10))["id"]
    backend.wait_abort(rid, timeout=4)


def test_bad_key_is_refused(gateway):
    url = gateway.base_url.replace("http://", "ws://") + "/v1/ws"
    with connect(url, additional_headers={"Authorization": "Bearer wrong"}) as conn:
        assert json.loads(conn.recv(timeout=5))["error"]["code"] == "invalid_api_key"
        with pytest.raises(ConnectionClosed) as e:
            conn.recv(timeout=5)
    assert e.value.rcvd is not None and e.value.rcvd.code == 1008
