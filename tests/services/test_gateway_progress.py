"""The gateway's bounded waits, against a real nats-server and the fake backend: a request whose
stream goes silent for the progress timeout ends (503 with Retry-After before its first output,
an SSE error event after it) and is aborted; keepalives keep a request alive past that timeout; a
request no tokenizer acknowledges is a 503 after the ack timeout. None waits for the request
timeout (long here)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from helpers.gateway_harness import FAKE_MODEL, GatewayProcess, sse_events

PROGRESS_TIMEOUT_S = 6.0  # the least the gateway accepts: three keepalive intervals
ACK_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def gateway(nats_server, backend) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(
        nats_server.url,
        "--request-timeout",
        "120",
        "--progress-timeout",
        str(PROGRESS_TIMEOUT_S),
        "--ack-timeout",
        str(ACK_TIMEOUT_S),
    )
    yield gw
    gw.stop()


def test_silence_ends_a_request_within_the_progress_timeout_and_keepalives_prevent_it(
    gateway, backend
):
    async def timed(client: httpx.AsyncClient, prompt: str, stream: bool = False):
        t0 = time.monotonic()
        body = {"model": FAKE_MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}
        r = await client.post("/v1/completions", json=body)
        return r, time.monotonic() - t0

    async def main():
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as client:
            return await asyncio.gather(
                timed(client, "hang"),
                timed(client, "stall_after_first", stream=True),
                timed(client, "keepalive"),
                timed(client, "noack"),
            )

    (hang, hang_s), (stall, stall_s), (alive, alive_s), (noack, noack_s) = asyncio.run(main())

    # Nothing ever came: 503 with Retry-After, after the progress timeout, not the request's.
    assert hang.status_code == 503, hang.text
    assert "no progress" in hang.json()["error"]["message"]
    assert int(hang.headers["retry-after"]) >= 1
    assert PROGRESS_TIMEOUT_S - 0.5 < hang_s < PROGRESS_TIMEOUT_S + 4
    assert backend.wait_abort(hang.headers["x-request-id"]).reason == "no progress"

    # One output, then silence: the stream ends with an error event (incomplete output), [DONE].
    assert stall.status_code == 200
    events = sse_events(stall.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "stalled" in error["message"] and "incomplete" in error["message"]
    assert stall_s < PROGRESS_TIMEOUT_S + 4
    backend.wait_abort(stall.headers["x-request-id"])

    # Keepalives for 8 s (longer than the progress timeout), then the output: served.
    assert alive.status_code == 200, alive.text
    assert alive_s > PROGRESS_TIMEOUT_S

    # Never acknowledged: 503 after the ack timeout.
    assert noack.status_code == 503 and "acknowledged" in noack.json()["error"]["message"]
    assert int(noack.headers["retry-after"]) >= 1
    assert noack_s < ACK_TIMEOUT_S + 3


def test_progress_timeout_must_leave_room_for_keepalives():
    from services.gateway.config import GatewayConfig

    with pytest.raises(ValueError, match="progress_timeout_s"):
        GatewayConfig(progress_timeout_s=3.0)
    assert GatewayConfig().progress_timeout_s == 10.0
