"""shared.wire.kv_transport over a real nats-server: pages travel in chunks that fit max_payload;
a decode side that dies with an offer or a chunk unanswered (a process SIGKILLed) is noticed
within the probe interval, not at the transfer's deadline; one that is alive but stuck keeps its
deadline, and never sees the probes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from shared.wire.bus import Bus
from shared.wire.kv_transport import (
    PROBE_INTERVAL_S,
    KVPeerGone,
    KVTransferTimeout,
    NatsKVTransport,
    plan_chunks,
)
from shared.wire.messages import KVChunkAck, KVOffer, KVOfferReply, KVPageLayout
from shared.wire.sampling_params import SamplingParams

DECODE = "decode-0"
PAGE_NBYTES = 1 << 20
NUM_PAGES = 20  # 3 chunks under the test server's 8 MiB max_payload
DEADLINE_S = 30.0  # far above every bound below
# From the kill to KVPeerGone: the probe interval, plus slack for a loaded 2-core host.
GONE_BOUND_S = PROBE_INTERVAL_S + 2.0
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A decode side in a process of its own: it accepts offers and acks the first chunk; ``hang`` (the
# offer, or the second chunk) is never answered. It prints what reached it, so the test kills it
# with that message in flight.
RECEIVER = """
import asyncio, sys
from shared.wire.bus import Bus
from shared.wire.kv_transport import NatsKVTransport
from shared.wire.messages import KVChunkAck, KVOfferReply

hang = sys.argv[2]

class Receiver:
    async def on_offer(self, offer):
        print("offer", flush=True)
        if hang == "offer":
            await asyncio.Event().wait()
        return KVOfferReply(accepted=True)

    async def on_pages(self, request_id, first_page, num_pages, last, data):
        print("chunk", first_page, flush=True)
        if first_page > 0:
            await asyncio.Event().wait()
        return KVChunkAck(ok=True)

    async def on_cancel(self, request_id):
        pass

async def main():
    bus = await Bus.connect(sys.argv[1], "receiver")
    await NatsKVTransport(bus).serve("decode-0", Receiver())
    await bus.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def offer(request_id: str = "r1") -> KVOffer:
    return KVOffer(
        request_id=request_id,
        prefill_executor_id="prefill-0",
        layout=KVPageLayout(num_layers=1, block_size=16, num_kv_heads=1, row=64, dtype="int8"),
        prompt_token_ids=[1, 2, 3],
        block_hashes=[],
        params=SamplingParams(),
        priority=0,
        first_token_id=4,
        num_emitted_chars=0,
        num_cached_tokens=0,
        generator_state=None,
        timeout_s=DEADLINE_S,
    )


def pages() -> memoryview:
    return memoryview(bytes(range(256)) * (NUM_PAGES * PAGE_NBYTES // 256))


class Recorder:
    """An in-process decode side that keeps what it is sent; with ``stuck``, the second chunk
    waits until ``release`` is set."""

    def __init__(self, stuck: bool = False) -> None:
        self.chunks: list[tuple[int, int, bool]] = []
        self.data = bytearray()
        self.stuck = stuck
        self.release = asyncio.Event()

    async def on_offer(self, offer: KVOffer) -> KVOfferReply:
        return KVOfferReply(accepted=True)

    async def on_pages(
        self, request_id: str, first_page: int, num_pages: int, last: bool, data: bytes
    ) -> KVChunkAck:
        self.chunks.append((first_page, num_pages, last))
        self.data += data
        if self.stuck and first_page > 0:
            await self.release.wait()
        return KVChunkAck(ok=True)

    async def on_cancel(self, request_id: str) -> None:
        pass


def test_pages_travel_in_chunks_that_fit_max_payload(nats_url):
    async def main() -> None:
        async with (
            await Bus.connect(nats_url, "decode") as decode_bus,
            await Bus.connect(nats_url, "prefill") as prefill_bus,
        ):
            receiver = Recorder()
            await NatsKVTransport(decode_bus).serve(DECODE, receiver)
            await decode_bus.flush()
            sender = NatsKVTransport(prefill_bus)
            assert (await sender.offer(DECODE, offer(), 5.0)).accepted
            stats = await sender.send_pages(
                DECODE, "r1", pages(), PAGE_NBYTES, time.monotonic() + DEADLINE_S
            )
            planned = plan_chunks(NUM_PAGES, PAGE_NBYTES, prefill_bus.max_payload)
            assert len(planned) >= 2 and stats.num_chunks == len(planned)
            assert receiver.chunks == [
                (first, count, i == len(planned) - 1) for i, (first, count) in enumerate(planned)
            ]
            assert bytes(receiver.data) == bytes(pages())

    asyncio.run(main())


@pytest.mark.parametrize("hang", ["offer", "chunk"])
def test_a_decode_side_killed_with_a_message_in_flight_is_gone_within_the_probe_interval(
    nats_url, hang
):
    async def main() -> float:
        receiver = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            RECEIVER,
            nats_url,
            hang,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": REPO_ROOT},
        )
        assert receiver.stdout is not None
        try:
            assert await asyncio.wait_for(receiver.stdout.readline(), 60) == b"ready\n"
            async with await Bus.connect(nats_url, "prefill") as bus:
                sender = NatsKVTransport(bus)

                async def transfer() -> None:
                    await sender.offer(DECODE, offer(), DEADLINE_S)
                    await sender.send_pages(
                        DECODE, "r1", pages(), PAGE_NBYTES, time.monotonic() + DEADLINE_S
                    )

                task = asyncio.create_task(transfer())
                # The message that will stay unanswered has reached the receiver: kill it.
                last = b"offer\n" if hang == "offer" else b"chunk 7\n"
                while (line := await asyncio.wait_for(receiver.stdout.readline(), 30)) != last:
                    assert line, "the receiver ended"
                receiver.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                with pytest.raises(KVPeerGone, match="is gone"):
                    await asyncio.wait_for(task, DEADLINE_S)
                return time.monotonic() - killed_at
        finally:
            if receiver.returncode is None:
                receiver.send_signal(signal.SIGKILL)
            await receiver.wait()

    after_s = asyncio.run(main())
    print(f"receiver killed with the {hang} in flight: gone after {after_s:.2f} s")
    assert after_s < GONE_BOUND_S


def test_a_stuck_decode_side_keeps_its_deadline_and_never_sees_a_probe(nats_url):
    async def main() -> None:
        async with (
            await Bus.connect(nats_url, "decode") as decode_bus,
            await Bus.connect(nats_url, "prefill") as prefill_bus,
        ):
            receiver = Recorder(stuck=True)
            await NatsKVTransport(decode_bus).serve(DECODE, receiver)
            await decode_bus.flush()
            deadline_s = 4 * PROBE_INTERVAL_S  # several probes go unanswered before it
            started = time.monotonic()
            with pytest.raises(KVTransferTimeout):
                await NatsKVTransport(prefill_bus).send_pages(
                    DECODE, "r1", pages(), PAGE_NBYTES, started + deadline_s
                )
            assert time.monotonic() - started >= deadline_s - 0.05
            # Unstuck, it handles the probes queued behind the chunk: none reaches it.
            receiver.release.set()
            await asyncio.sleep(2 * PROBE_INTERVAL_S)
            assert [first for first, _, _ in receiver.chunks] == [0, 7]

    asyncio.run(main())
