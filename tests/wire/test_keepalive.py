"""Keepalives and reconnects, the wire side of "nothing lost when a process dies":

- SilenceTracker names the held requests whose streams have been silent an interval, once each;
- a StreamKeepalive is one more tagged variant of the stream message (outputs and errors decode
  as before);
- the reconnect backoff is bounded;
- a Bus whose nats-server is SIGKILLed tells its listeners, reconnects by itself once the server is
  restarted on its port (ServerProcess.restart), and its subscriptions work again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

from services.cli.servers import start_nats
from shared.wire.bus import Bus, BusError, reconnect_delay_s
from shared.wire.keepalive import KEEPALIVE_INTERVAL_S, SilenceTracker, send_keepalives
from shared.wire.messages import (
    STREAM_MESSAGE,
    StreamError,
    StreamKeepalive,
    StreamOutput,
)
from shared.wire.outputs import RequestOutput


def test_silence_tracker_names_each_silent_request_once_per_interval():
    t = SilenceTracker(interval_s=2.0)
    t.touch("a", 0.0)
    t.touch("b", 1.0)
    assert t.due(1.9) == []
    assert t.due(2.0) == ["a"]  # and "a" counts as spoken for at 2.0
    assert t.due(2.5) == []
    t.touch("b", 2.9)  # an output on b's stream
    assert t.due(4.0) == ["a"]
    assert t.due(4.9) == ["b"]
    t.forget("a")
    assert "a" not in t and len(t) == 1 and t.due(100.0) == ["b"]
    with pytest.raises(ValueError):
        SilenceTracker(interval_s=0)


def test_keepalive_is_a_tagged_stream_variant_and_old_variants_are_unchanged():
    keepalive = StreamKeepalive(request_id="r", holder="scheduler", state="queued")
    assert STREAM_MESSAGE.decode(STREAM_MESSAGE.encode(keepalive)) == keepalive
    error = StreamError(request_id="r", status=503, message="m", retry_after_s=2.0)
    output = StreamOutput(
        executor_id="x",
        output=RequestOutput(
            request_id="r", deltas=[], num_prompt_tokens=1, num_cached_tokens=0, finished=True
        ),
    )
    for message in (error, output):
        assert STREAM_MESSAGE.decode(STREAM_MESSAGE.encode(message)) == message
    # The tags the gateway parsed before keepalives existed stay as they were.
    assert b"\xa4kind\xa5error" in STREAM_MESSAGE.encode(error)
    assert b"\xa4kind\xa6output" in STREAM_MESSAGE.encode(output)


def test_reconnect_backoff_is_bounded():
    delays = [reconnect_delay_s(n) for n in range(10)]
    assert delays[:5] == [0.0, 0.1, 0.2, 0.4, 0.8]
    assert all(d == 1.0 for d in delays[5:])


def test_a_bus_reconnects_by_itself_to_a_restarted_server():
    server = start_nats()

    async def main() -> tuple[float, float]:
        events: list[tuple[str, float]] = []
        bus = await Bus.connect(server.url, "reconnect-test")
        bus.on_connection_lost(lambda: events.append(("lost", time.monotonic())))
        bus.on_reconnected(lambda: events.append(("back", time.monotonic())))
        other = await Bus.connect(server.url, "other")
        try:
            async with await bus.subscribe_iter("llm.v1.test.reconnect") as sub:
                await bus.flush()
                os.kill(server.pid, signal.SIGKILL)
                killed_at = time.monotonic()
                while not events:
                    await asyncio.sleep(0.01)
                assert events[0][0] == "lost" and not bus.is_connected
                assert bus.disconnected_since is not None
                # While it is away a publish is buffered (past the buffer: BusError, nothing else).
                with contextlib.suppress(BusError):
                    await send_keepalives(bus, "test", [("r1", "queued")])
                await asyncio.to_thread(server.restart)  # same port, same config and store
                restarted_at = time.monotonic()
                while len(events) < 2:
                    assert time.monotonic() - restarted_at < 5, events
                    await asyncio.sleep(0.01)
                assert events[1][0] == "back" and bus.is_connected
                assert bus.disconnected_since is None and bus.num_disconnects == 1
                while not other.is_connected:
                    await asyncio.sleep(0.01)
                await other.flush()
                await bus.flush()
                # The subscription was replayed: a message from the other connection arrives.
                await other.publish("llm.v1.test.reconnect", b"hello again")
                assert (await sub.next(5)).data == b"hello again"
                return events[0][1] - killed_at, events[1][1] - restarted_at
        finally:
            await bus.close()
            await other.close()

    try:
        noticed_s, reconnected_s = asyncio.run(main())
    finally:
        server.stop()
    print(
        f"\nloss noticed in {noticed_s:.3f} s; reconnected {reconnected_s:.3f} s after the restart"
    )
    # Bounded by the backoff's cap (1 s) plus a connect round trip.
    assert reconnected_s < 1.0 + KEEPALIVE_INTERVAL_S
    assert server.num_restarts == 1
