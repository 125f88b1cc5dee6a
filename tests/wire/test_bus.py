"""shared.wire.bus against a real nats-server: publish/subscribe, queue groups, request/reply and
its timeout, handler errors not killing a subscription, iterator subscriptions, max_payload."""

from __future__ import annotations

import asyncio

import pytest

from services.cli.servers import start_nats
from shared.wire.bus import Bus, BusError, BusInterrupted, BusNoResponders, BusTimeout

SUBJECT = "test.bus.a"


def test_publish_subscribe_in_order(nats_url):
    async def main() -> None:
        async with (
            await Bus.connect(nats_url, "sub") as sub_bus,
            await Bus.connect(nats_url, "pub") as pub_bus,
        ):
            got: list[bytes] = []
            done = asyncio.Event()

            async def handler(msg) -> None:
                got.append(msg.data)
                if len(got) == 100:
                    done.set()

            await sub_bus.subscribe(SUBJECT + ".order", handler)
            await sub_bus.flush()
            for i in range(100):
                await pub_bus.publish(
                    SUBJECT + ".order", str(i).encode(), headers={"traceparent": "x"}
                )
            await asyncio.wait_for(done.wait(), 5)
            assert got == [str(i).encode() for i in range(100)]

    asyncio.run(main())


def test_queue_group_delivers_each_message_once(nats_url):
    async def main() -> None:
        buses = [await Bus.connect(nats_url, f"member-{i}") for i in range(3)]
        pub = await Bus.connect(nats_url, "pub")
        counts = [0, 0, 0]
        total = asyncio.Event()

        def make_handler(i: int):
            async def handler(msg) -> None:
                counts[i] += 1
                if sum(counts) == 60:
                    total.set()

            return handler

        for i, b in enumerate(buses):
            await b.subscribe(SUBJECT + ".q", make_handler(i), queue="workers")
            await b.flush()
        for _ in range(60):
            await pub.publish(SUBJECT + ".q", b"x")
        await asyncio.wait_for(total.wait(), 5)
        await asyncio.sleep(0.1)
        assert sum(counts) == 60
        assert sum(1 for c in counts if c > 0) >= 2  # spread over members, not all to one
        for b in [*buses, pub]:
            await b.close()

    asyncio.run(main())


def test_request_reply_timeout_and_no_responders(nats_url):
    async def main() -> None:
        async with (
            await Bus.connect(nats_url, "srv") as srv,
            await Bus.connect(nats_url, "cli") as cli,
        ):

            async def echo(msg) -> None:
                await msg.respond(b"re:" + msg.data)

            async def silent(msg) -> None:
                pass

            await srv.subscribe(SUBJECT + ".echo", echo)
            await srv.subscribe(SUBJECT + ".silent", silent)
            await srv.flush()
            assert await cli.request(SUBJECT + ".echo", b"hi", timeout=2) == b"re:hi"
            with pytest.raises(BusTimeout, match="no reply"):
                await cli.request(SUBJECT + ".silent", b"hi", timeout=0.2)
            with pytest.raises(BusNoResponders, match="no service"):
                await cli.request(SUBJECT + ".nobody", b"hi", timeout=2)

    asyncio.run(main())


def test_flush_pings_only_after_earlier_subscriptions_are_on_the_wire(nats_url, monkeypatch):
    """flush() promises that the server has seen every SUB sent before it. nats-py queues SUB for
    its flusher task but writes flush()'s PING straight to the socket, so without care the PING
    overtakes the SUBs and another connection's request can still find no responders."""

    async def main() -> None:
        async with await Bus.connect(nats_url, "srv") as srv:
            transport = srv._nc._transport
            assert transport is not None
            wire: list[bytes] = []
            write, writelines = transport.write, transport.writelines

            def recording_write(data):
                wire.append(bytes(data))
                return write(data)

            def recording_writelines(datas):
                wire.extend(bytes(d) for d in datas)
                return writelines(datas)

            monkeypatch.setattr(transport, "write", recording_write)
            monkeypatch.setattr(transport, "writelines", recording_writelines)

            async def handler(msg) -> None:
                pass

            await srv.subscribe(SUBJECT + ".wire.a", handler)
            await srv.subscribe(SUBJECT + ".wire.b", handler)
            await srv.flush()
            sent = b"".join(wire)
            assert (
                sent.index(b"SUB test.bus.a.wire.a ")
                < sent.index(b"SUB test.bus.a.wire.b ")
                < sent.index(b"PING\r\n")
            )

    asyncio.run(main())


def test_handler_exception_keeps_subscription(nats_url, caplog):
    async def main() -> None:
        async with await Bus.connect(nats_url, "b") as bus:
            got: list[bytes] = []
            done = asyncio.Event()

            async def handler(msg) -> None:
                if msg.data == b"boom":
                    raise RuntimeError("handler bug")
                got.append(msg.data)
                done.set()

            await bus.subscribe(SUBJECT + ".err", handler)
            await bus.publish(SUBJECT + ".err", b"boom")
            await bus.publish(SUBJECT + ".err", b"ok")
            await asyncio.wait_for(done.wait(), 5)
            assert got == [b"ok"]

    with caplog.at_level("ERROR", logger="llmserve.bus"):
        asyncio.run(main())
    assert any("handler bug" in (r.exc_text or "") or r.exc_info for r in caplog.records)


def test_subscribe_iter(nats_url):
    async def main() -> None:
        async with await Bus.connect(nats_url, "b") as bus:
            async with await bus.subscribe_iter(SUBJECT + ".iter") as sub:
                for i in range(3):
                    await bus.publish(SUBJECT + ".iter", bytes([i]))
                got = []
                async for msg in sub:
                    got.append(msg.data)
                    if len(got) == 3:
                        break
                assert got == [b"\x00", b"\x01", b"\x02"]
                with pytest.raises(BusTimeout):
                    await sub.next(timeout=0.1)
            await sub.unsubscribe()  # idempotent

    asyncio.run(main())


def test_iterator_subscription_counts_what_it_hands_out_and_wakes_when_the_connection_closes(
    nats_url,
):
    """Messages taken by next() leave the subscription's pending count (its slow-consumer limit),
    whether they were waiting already or arrived during the wait; a next() waiting when its
    connection closes ends with BusError at once, not at its timeout."""

    async def main() -> None:
        bus = await Bus.connect(nats_url, "pending")
        sub = await bus.subscribe_iter(SUBJECT + ".pending")
        for i in range(3):
            await bus.publish(SUBJECT + ".pending", bytes(10 + i))
        await bus.flush()
        await asyncio.sleep(0.05)
        assert sub._sub.pending_bytes == 33
        assert [len((await sub.next(1)).data) for _ in range(3)] == [10, 11, 12]
        assert sub._sub.pending_bytes == 0
        late = asyncio.ensure_future(sub.next(timeout=30))
        await asyncio.sleep(0.05)
        await bus.publish(SUBJECT + ".pending", b"late")
        assert (await asyncio.wait_for(late, 2)).data == b"late"
        assert sub._sub.pending_bytes == 0
        waiting = asyncio.ensure_future(sub.next(timeout=30))
        await asyncio.sleep(0.05)
        await bus.close()
        with pytest.raises(BusError, match="connection closed"):
            await asyncio.wait_for(waiting, 5)  # not its 30 s timeout
        with pytest.raises(BusError, match="connection closed"):
            await sub.next(timeout=1)

    asyncio.run(main())


def test_max_payload_is_raised_and_enforced():
    server = start_nats(max_payload=2 * 1024 * 1024)

    async def main() -> None:
        async with await Bus.connect(server.url, "b") as bus:
            assert bus.max_payload == 2 * 1024 * 1024
            async with await bus.subscribe_iter(SUBJECT + ".big") as sub:
                await bus.publish(
                    SUBJECT + ".big", b"x" * (1024 * 1024 + 5)
                )  # over nats' 1 MiB default
                assert len((await sub.next(5)).data) == 1024 * 1024 + 5
            with pytest.raises(BusError, match="max_payload"):
                await bus.publish(SUBJECT + ".big", b"x" * (3 * 1024 * 1024))

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_connect_failure_is_clear():
    async def main() -> None:
        with pytest.raises(BusError, match="cannot connect"):
            await Bus.connect("nats://127.0.0.1:1", "x", connect_timeout_s=0.5)

    asyncio.run(main())


def test_interrupt_wakes_a_waiting_iterator_subscription(nats_url):
    """A gateway that drains ends the streams it waits on: interrupt() makes the pending next()
    (and every later one) raise BusInterrupted, without cancelling the waiting task."""

    async def main() -> None:
        async with await Bus.connect(nats_url, "sub") as bus:
            sub = await bus.subscribe_iter(SUBJECT + ".interrupt")
            waiter = asyncio.ensure_future(sub.next(timeout=30))
            await asyncio.sleep(0.05)
            sub.interrupt()
            with pytest.raises(BusInterrupted):
                await asyncio.wait_for(waiter, 2)
            with pytest.raises(BusInterrupted):
                await sub.next(timeout=1)
            # A cancellation of the waiting task itself is still a cancellation.
            other = await bus.subscribe_iter(SUBJECT + ".cancel")
            task = asyncio.ensure_future(other.next(timeout=30))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await sub.unsubscribe()
            await other.unsubscribe()

    asyncio.run(main())
