"""The gateway process against a real nats-server and a fake backend (gateway_harness.FakeBackend):
SSE framing, include_usage, n > 1 interleaving, errors before and after the first byte, auth,
validation, client disconnects → AbortRequest on NATS, timeouts → an error, never a hang."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from helpers.gateway_harness import (
    FAKE_MODEL,
    NUM_PROMPT_TOKENS,
    GatewayProcess,
    expected_text,
    sse_events,
    token_id,
)
from shared.metrics.publisher import report_of
from shared.wire.messages import EngineStats, ExecutorHeartbeat, ExecutorMemory

API_KEY = "test-key"
REQUEST_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def gateway(nats_server, backend) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(
        nats_server.url, "--request-timeout", str(REQUEST_TIMEOUT_S), api_key=API_KEY
    )
    yield gw
    gw.stop()


@pytest.fixture
def client(gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.base_url, headers=gateway.headers(), timeout=20) as c:
        yield c


def completion(**body) -> dict:
    return {"model": FAKE_MODEL, "prompt": "hello", "max_tokens": 4, **body}


def chat(content: str = "hello", **body) -> dict:
    return {"model": FAKE_MODEL, "messages": [{"role": "user", "content": content}], **body}


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def assert_still_serving(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json=completion(max_tokens=2))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_text(0, 2)


# ------------------------------------------------------------------------------- happy paths


def test_non_streaming_completion(client, backend):
    r = client.post("/v1/completions", json=completion(max_tokens=5, n=2, stop=["zz"], seed=3))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and r.headers["x-request-id"] == body["id"]
    assert body["object"] == "text_completion" and body["model"] == FAKE_MODEL
    assert [c["text"] for c in body["choices"]] == [expected_text(0, 5), expected_text(1, 5)]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["usage"] == {
        "prompt_tokens": NUM_PROMPT_TOKENS,
        "completion_tokens": 9,
        "total_tokens": NUM_PROMPT_TOKENS + 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    sent = backend.requests[body["id"]]
    assert sent.prompt == "hello" and sent.params.n == 2 and sent.params.stop == ["zz"]
    assert sent.params.seed == 3 and sent.deadline is not None


def test_streaming_completion_sse_framing_and_include_usage(client):
    r = client.post(
        "/v1/completions", json=completion(stream=True, stream_options={"include_usage": True})
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == expected_text(0, 4)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, "length"]


def test_streaming_without_include_usage_has_no_usage_key(client):
    events = sse_events(client.post("/v1/completions", json=completion(stream=True)).text)
    assert events[-1] == "[DONE]"
    assert all("usage" not in json.loads(e) for e in events[:-1])


def test_chat_stream_n2_interleaved(client):
    r = client.post("/v1/chat/completions", json=chat(n=2, max_tokens=6, stream=True))
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and len(c["choices"]) == 1 for c in chunks)
    # each choice opens with the role, then its content in order, then exactly one finish
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for i, c in enumerate(chunks):
        choice = c["choices"][0]
        if i < 2:
            assert choice["delta"] == {"role": "assistant", "content": ""} and choice["index"] == i
            continue
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert texts == {0: expected_text(0, 6), 1: expected_text(1, 6)}
    assert finishes == {0: ["length"], 1: ["stop"]}
    assert {c["choices"][0]["index"] for c in chunks[2:4]} == {
        0,
        1,
    }  # interleaved, not one then the other


def test_chat_non_streaming_with_logprobs(client):
    r = client.post(
        "/v1/chat/completions",
        json=chat(max_completion_tokens=3, logprobs=True, top_logprobs=2, user="u1"),
    )
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": expected_text(0, 3),
        "refusal": None,
    }
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{token_id(0, s)}" for s in range(3)]
    assert content[0]["top_logprobs"][1] == {
        "token": "token_id:5",
        "logprob": -2.0,
        "bytes": list(b"token_id:5"),
    }


def test_completion_token_prompt_and_logprobs(client, backend):
    r = client.post("/v1/completions", json=completion(prompt=[1, 2, 3], logprobs=1, max_tokens=2))
    body = r.json()
    assert backend.requests[body["id"]].prompt_token_ids == [1, 2, 3]
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.25, -0.25] and len(lp["tokens"]) == 2
    assert lp["top_logprobs"][0] == {f"token_id:{token_id(0, 0)}": -0.25}


def test_models_health_metrics(client, gateway, backend):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [FAKE_MODEL]
    assert client.get(f"/v1/models/{FAKE_MODEL}").json()["id"] == FAKE_MODEL
    assert httpx.get(gateway.base_url + "/health").status_code == 200  # no key needed
    backend.num_executors = 0
    try:
        r = httpx.get(gateway.base_url + "/health")
        assert r.status_code == 503 and "executor" in r.json()["reason"]
    finally:
        backend.num_executors = 1
    backend.set_tokenizer_listening(False)  # requests would go nowhere: not healthy
    try:
        r = httpx.get(gateway.base_url + "/health")
        assert r.status_code == 503 and r.json()["reason"] == "The tokenizer did not answer."
        # A request fails at once instead of waiting out its timeout.
        t0 = time.monotonic()
        r = client.post("/v1/completions", json=completion())
        assert (
            r.status_code == 503 and r.json()["error"]["message"] == "No tokenizer is running."
        ), r.text
        assert time.monotonic() - t0 < 5
    finally:
        backend.set_tokenizer_listening(True)
    assert httpx.get(gateway.base_url + "/health").status_code == 200
    # An executor's MetricsReport (what services/executor/metrics.py publishes) reaches /metrics,
    # labelled by service and replica.
    registry = CollectorRegistry()
    labels = ["executor", "model_name"]
    queries = Counter("llmserve:prefix_cache_queries", "", labels, registry=registry)
    queries.labels("fake-0", FAKE_MODEL).inc(100)
    backend.publish_metrics(report_of("executor", "fake-0", registry))
    exported = (
        'llmserve:prefix_cache_queries_total{executor="fake-0",model_name="fake-model",'
        'replica="fake-0",service="executor"} 100.0'
    )
    deadline = time.monotonic() + 5
    while exported not in (text := httpx.get(gateway.base_url + "/metrics").text):
        assert time.monotonic() < deadline, text
        time.sleep(0.05)
    for name in (
        "llmserve:time_to_first_token_seconds_bucket",
        "llmserve:e2e_request_latency_seconds_count",
        "llmserve:inter_token_latency_seconds_count",
        "llmserve:time_per_output_token_seconds_count",
        "llmserve:generation_tokens_total",
        'llmserve:gateway_requests_total{endpoint="completions",replica="gateway-',
        'llmserve:nats_round_trip_seconds_count{replica="gateway-',
        # The stack's, from the scheduler's status: the routing state.
        "llmserve:routing_index_available 1.0",
    ):
        assert name in text, name
    # No prefix index runs here: its metrics are left out, the scrape still answers.
    assert "llmserve:prefix_index_up" not in text


# ------------------------------------------------------------------------------------ errors


def test_backend_429_has_retry_after(client):
    for stream in (False, True):
        r = client.post("/v1/completions", json=completion(prompt="error429", stream=stream))
        err = assert_openai_error(r, 429)
        assert r.headers["retry-after"] == "2" and err["code"] == "rate_limit_exceeded"


def test_backend_400_passes_through(client):
    err = assert_openai_error(
        client.post("/v1/chat/completions", json=chat("error400")), 400, "prompt"
    )
    assert err["message"] == "prompt is too long"


def test_error_after_first_byte_is_a_final_sse_event(client):
    r = client.post("/v1/completions", json=completion(prompt="fail_after_first", stream=True))
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["text"] == expected_text(0, 1)
    err = json.loads(events[-2])["error"]
    assert err["message"] == "executor died" and err["type"] == "server_error"


def test_undecodable_stream_message_is_500(client):
    assert_openai_error(client.post("/v1/completions", json=completion(prompt="garbage")), 500)


def test_auth(gateway):
    body = completion()
    assert_openai_error(httpx.post(gateway.base_url + "/v1/completions", json=body), 401)
    r = httpx.post(
        gateway.base_url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}
    )
    assert assert_openai_error(r, 401)["code"] == "invalid_api_key"
    assert_openai_error(httpx.get(gateway.base_url + "/v1/models"), 401)


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", json.dumps({"prompt": "x"}).encode(), 400, "model"),
        ("/v1/completions", json.dumps(completion(model="gpt-5")).encode(), 404, "model"),
        ("/v1/completions", json.dumps(completion(max_tokens=0)).encode(), 400, "max_tokens"),
        ("/v1/completions", json.dumps(completion(max_tokens="abc")).encode(), 400, "max_tokens"),
        ("/v1/completions", json.dumps(completion(max_tokens=1.5)).encode(), 400, "max_tokens"),
        ("/v1/completions", json.dumps(completion(temperature=-1)).encode(), 400, "temperature"),
        ("/v1/completions", json.dumps(completion(top_p=2)).encode(), 400, "top_p"),
        ("/v1/completions", json.dumps(completion(n=0)).encode(), 400, "n"),
        ("/v1/completions", json.dumps(completion(prompt=["a", "b"])).encode(), 400, "prompt"),
        (
            "/v1/chat/completions",
            json.dumps(chat(max_completion_tokens=-1)).encode(),
            400,
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            json.dumps({"model": FAKE_MODEL, "messages": []}).encode(),
            400,
            "messages",
        ),
    ],
)
def test_validation_errors(client, path, body, status, param):
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    err = assert_openai_error(r, status, param)
    if status == 404:
        assert err["code"] == "model_not_found"
    assert_still_serving(client)


def test_unknown_route_is_an_openai_error(client):
    assert_openai_error(client.get("/v1/nothing"), 404)


def test_an_error_from_a_route_keeps_the_connection_serving(client):
    """An APIError raised in a route reaches the app's exception handler; the client's keep-alive
    connection then serves the next request (it was closed when Starlette's clean-up of the
    exception failed on a frozen APIError)."""
    err = assert_openai_error(client.get("/v1/models/gpt-5"), 404, "model")
    assert err["code"] == "model_not_found"
    assert client.get(f"/v1/models/{FAKE_MODEL}").json()["id"] == FAKE_MODEL


# ---------------------------------------------------------------------- disconnect and timeout


def test_streaming_client_disconnect_publishes_abort(gateway, backend):
    with (
        httpx.Client(base_url=gateway.base_url, headers=gateway.headers(), timeout=10) as c,
        c.stream(
            "POST",
            "/v1/completions",
            json=completion(prompt="slow stream", max_tokens=None, stream=True),
        ) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        rid = r.headers["x-request-id"]
    # leaving the block closes the connection mid-stream
    abort = backend.wait_abort(
        rid, timeout=REQUEST_TIMEOUT_S - 1
    )  # before the gateway's own timeout
    assert abort.reason == "client disconnected"


def test_non_streaming_client_disconnect_publishes_abort(gateway, backend):
    def give_up() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                gateway.base_url + "/v1/completions",
                json=completion(prompt="hang nonstream"),
                headers=gateway.headers(),
                timeout=httpx.Timeout(10, read=0.5),
            )

    t = threading.Thread(target=give_up)
    t.start()
    t.join()
    rid = backend.request_for("hang nonstream").request_id
    abort = backend.wait_abort(
        rid, timeout=REQUEST_TIMEOUT_S - 1
    )  # before the gateway's own timeout
    assert abort.reason == "client disconnected"


def test_timeout_before_first_token_is_504_and_aborts(client, backend):
    t0 = time.monotonic()
    r = client.post("/v1/chat/completions", json=chat("hang timeout", stream=True))
    assert REQUEST_TIMEOUT_S - 0.5 < time.monotonic() - t0 < REQUEST_TIMEOUT_S + 5
    assert assert_openai_error(r, 504)["code"] == "request_timeout"
    assert backend.wait_abort(r.headers["x-request-id"]).reason == "request timeout"


def test_timeout_mid_stream_ends_with_error_event(client, backend):
    r = client.post(
        "/v1/completions", json=completion(prompt="slow timeout", max_tokens=None, stream=True)
    )
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and len(events) > 3
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    backend.wait_abort(r.headers["x-request-id"])


# ------------------------------------------------------------------------------------ console


def fake_heartbeat(executor_id: str = "fake-0", num_free_blocks: int = 90) -> ExecutorHeartbeat:
    stats = EngineStats(
        num_running=1,
        num_waiting=0,
        num_total_blocks=100,
        num_free_blocks=num_free_blocks,
        kv_cache_usage=(100 - num_free_blocks) / 100,
        prefix_cache_queries_tokens=64,
        prefix_cache_hits_tokens=16,
        num_preemptions=2,
        num_prompt_tokens=64,
        num_computed_tokens=80,
        num_generated_tokens=16,
        num_steps=17,
        last_step_num_tokens=1,
        num_cached_blocks=4,
    )
    memory = ExecutorMemory(
        memory_budget_bytes=1 << 30,
        weight_dtype="float32",
        kv_dtype="float32",
        planned_weight_bytes=500 << 20,
        planned_activation_bytes=50 << 20,
        planned_kv_cache_bytes=400 << 20,
        planned_num_kv_blocks=101,
        weight_bytes=510 << 20,
        kv_cache_bytes=101 * 4096,
        num_kv_blocks=101,
        kv_bytes_per_block=4096,
        process_rss_bytes=900 << 20,
    )
    return ExecutorHeartbeat(
        executor_id=executor_id,
        epoch="e1",
        role="both",
        model=FAKE_MODEL,
        max_model_len=2048,
        block_size=16,
        stats=stats,
        sent_at=time.time(),
        memory=memory,
    )


def test_console_static_files_are_public_and_its_data_needs_the_key(gateway, client):
    page = httpx.get(gateway.base_url + "/console/")
    assert page.status_code == 200 and "llmserve" in page.text and "app.js" in page.text
    script = httpx.get(gateway.base_url + "/console/app.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    for path in ("/console/api/state", "/console/api/plan/options", "/console/api/plan?memory=1G"):
        assert_openai_error(httpx.get(gateway.base_url + path), 401)
        assert client.get(path).status_code == 200, path
    assert_openai_error(client.get("/console/api/plan?memory=1GiB&model=/etc/passwd"), 400, "model")
    assert_openai_error(client.get("/console/api/plan?memory=1GiB&block_size=-3"), 400)
    assert_openai_error(client.get("/console/api/plan?memory=1KiB"), 400)  # cannot hold the model


def test_console_state_shows_executors_and_each_request_from_queued_to_done(client, backend):
    backend.publish_heartbeat(fake_heartbeat())
    deadline = time.monotonic() + 5
    while not (state := client.get("/console/api/state").json())["executors"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    [executor] = state["executors"]
    assert executor["kv"] == {
        "num_total_blocks": 100,
        "num_used_blocks": 10,
        "num_free_blocks": 90,
        "num_cached_blocks": 4,
        "usage": 0.1,
    }
    assert executor["prefix_cache"]["hit_rate"] == 0.25
    assert executor["batch"]["num_preemptions"] == 2
    assert [r["item"] for r in executor["memory"]["rows"]] == ["weights", "activations", "kv cache"]
    assert state["scheduler"]["available"] and state["scheduler"]["num_queued"] == 0

    r = client.post("/v1/completions", json=completion(max_tokens=4))
    rid = r.headers["x-request-id"]
    [done] = [
        q for q in client.get("/console/api/state").json()["requests"] if q["request_id"] == rid
    ]
    assert (done["state"], done["status"], done["num_tokens"]) == ("done", 200, 4)
    assert done["ttft_s"] is not None and done["e2e_s"] >= done["ttft_s"]
    assert done["num_prompt_tokens"] == NUM_PROMPT_TOKENS and done["finish_reason"] == "length"

    # A request its holder keeps alive is shown in the holder's state (the gateway answers no
    # byte before the first output), then as an error once it times out.
    def held_request() -> None:
        client.post("/v1/completions", json=completion(prompt="keepalive"))

    thread = threading.Thread(target=held_request)
    thread.start()
    try:
        rid = backend.request_for("keepalive").request_id
        held = wait_for_record(client, rid, lambda q: q["state"] == "queued")
        assert held["holder"] == "fake-scheduler" and held["status"] is None
        assert held["ttft_s"] is None and held["num_tokens"] == 0
    finally:
        thread.join()
    ended = wait_for_record(client, rid, lambda q: q["status"] is not None)
    assert (ended["state"], ended["status"]) == ("error", 504)


def wait_for_record(client: httpx.Client, rid: str, cond, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        requests = client.get("/console/api/state").json()["requests"]
        [record] = [q for q in requests if q["request_id"] == rid]
        if cond(record):
            return record
        assert time.monotonic() < deadline, record
        time.sleep(0.05)
