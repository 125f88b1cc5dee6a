"""How KV pages travel from a prefill executor to a decode executor: one small interface
(``KVTransport``), implemented over NATS here; shared memory on one host or RDMA across hosts
would implement the same four calls.

    prefill side                                     decode side (KVReceiver)
    offer(decode_id, KVOffer) ── request/reply ──▶   on_offer: reserve blocks → KVOfferReply
    send_pages(decode_id, rid, pages)                 on_pages: install → KVChunkAck
        chunk 0..k-1 ── one request/reply each ──▶     (the last chunk's ack: installed, decoding)
    cancel(decode_id, rid) ── publish ──▶             on_cancel: free the reservation

Over NATS a chunk is the pages' raw bytes (no encoding, no copy beyond the client's write) with
its place in headers, sized to fit the server's ``max_payload``; each chunk waits for its ack, so
the decode side paces the transfer (flow control).

A dead receiver is noticed within ``PROBE_INTERVAL_S`` and a round trip, not at the deadline: a
request finds no responders at once when the server holds no subscription on its subject, but one
already delivered (an offer or a chunk in flight when the decode executor died) is simply never
answered. So while an answer is late, a probe goes each ``PROBE_INTERVAL_S`` to the decode
executor's pages subject: no responders means its process is gone (the server dropped its
connection; a connection lost while the process lives makes it abort every request it holds, see
services/executor/service.py), and the transfer ends as ``KVPeerGone``. A probe that reaches the
subscriber is never answered (it times out): a stuck decode side (SIGSTOP, a slow write) still
has until the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol

from shared.wire import subjects
from shared.wire.bus import Bus, BusError, BusNoResponders, BusTimeout, Msg
from shared.wire.messages import (
    KV_CHUNK_ACK,
    KV_OFFER,
    KV_OFFER_REPLY,
    KVChunkAck,
    KVOffer,
    KVOfferReply,
)

__all__ = [
    "KVPeerGone",
    "KVReceiver",
    "KVTransferError",
    "KVTransferTimeout",
    "KVTransport",
    "NatsKVTransport",
    "TransferStats",
    "plan_chunks",
]

# Room left in each message for the headers and the protocol line.
HEADER_ROOM_BYTES = 4096
_FIRST, _COUNT = "Llmserve-Kv-First", "Llmserve-Kv-Count"
_LAST, _CANCEL = "Llmserve-Kv-Last", "Llmserve-Kv-Cancel"
_PROBE = "Llmserve-Kv-Probe"
# While an offer's reply or a chunk's ack is awaited, how often the decode executor's subscription
# is checked: the first probe goes once an answer is this late (a transfer whose answers come in
# time sends none), then one each interval.
PROBE_INTERVAL_S = 0.5


class KVTransferError(Exception):
    """The transfer cannot happen (refused, a page too large for the transport, a failed ack)."""


class KVPeerGone(KVTransferError):
    """Nobody receives on the decode executor's subjects: it is gone. Nothing was installed."""


class KVTransferTimeout(KVTransferError):
    """No answer in time: the decode side may be stuck; it never commits past its deadline."""


@dataclass(frozen=True)
class TransferStats:
    num_pages: int
    num_bytes: int
    num_chunks: int
    seconds: float


def plan_chunks(num_pages: int, page_nbytes: int, max_message_bytes: int) -> list[tuple[int, int]]:
    """(first page, page count) of each chunk: as many whole pages as fit one message."""
    per_chunk = (max_message_bytes - HEADER_ROOM_BYTES) // page_nbytes
    if per_chunk < 1:
        raise KVTransferError(
            f"one KV page is {page_nbytes} bytes, more than a message may carry "
            f"({max_message_bytes} bytes less {HEADER_ROOM_BYTES} for headers): raise the NATS "
            "server's max_payload or lower block_size"
        )
    return [(i, min(per_chunk, num_pages - i)) for i in range(0, num_pages, per_chunk)]


class KVReceiver(Protocol):
    async def on_offer(self, offer: KVOffer) -> KVOfferReply: ...
    async def on_pages(
        self, request_id: str, first_page: int, num_pages: int, last: bool, data: bytes
    ) -> KVChunkAck: ...
    async def on_cancel(self, request_id: str) -> None: ...


class KVTransport(Protocol):
    async def offer(self, decode_id: str, offer: KVOffer, timeout_s: float) -> KVOfferReply: ...
    async def send_pages(
        self, decode_id: str, request_id: str, pages: memoryview, page_nbytes: int, deadline: float
    ) -> TransferStats: ...
    async def cancel(self, decode_id: str, request_id: str) -> None: ...
    async def serve(self, executor_id: str, receiver: KVReceiver) -> None: ...


class NatsKVTransport:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def offer(self, decode_id: str, offer: KVOffer, timeout_s: float) -> KVOfferReply:
        request = self.bus.request(
            subjects.executor_kv_offer(decode_id), KV_OFFER.encode(offer), timeout_s
        )
        try:
            data = await self._answer_while_subscribed(decode_id, offer.request_id, request)
        except BusNoResponders as e:
            raise KVPeerGone(str(e)) from None
        except BusTimeout as e:
            raise KVTransferTimeout(str(e)) from None
        except BusError as e:
            raise KVTransferError(str(e)) from None
        return KV_OFFER_REPLY.decode(data)

    async def send_pages(
        self, decode_id: str, request_id: str, pages: memoryview, page_nbytes: int, deadline: float
    ) -> TransferStats:
        """``pages``: the pages back to back (len a multiple of page_nbytes); ``deadline``: a
        time.monotonic() by which the last ack must have come."""
        t0 = time.perf_counter()
        num_pages = len(pages) // page_nbytes
        chunks = plan_chunks(num_pages, page_nbytes, self.bus.max_payload)
        subject = subjects.kv_pages(decode_id, request_id)
        for i, (first, count) in enumerate(chunks):
            headers = {
                _FIRST: str(first),
                _COUNT: str(count),
                _LAST: "1" if i == len(chunks) - 1 else "0",
            }
            body = pages[first * page_nbytes : (first + count) * page_nbytes]
            timeout_s = deadline - time.monotonic()
            if timeout_s <= 0:
                raise KVTransferTimeout(f"the transfer of {request_id} ran past its deadline")
            try:
                request = self.bus.request(subject, body, timeout_s, headers=headers)  # type: ignore[arg-type]
                reply = await self._answer_while_subscribed(decode_id, request_id, request)
            except BusNoResponders as e:
                raise KVPeerGone(str(e)) from None
            except BusTimeout as e:
                raise KVTransferTimeout(str(e)) from None
            except BusError as e:
                raise KVTransferError(str(e)) from None
            ack = KV_CHUNK_ACK.decode(reply)
            if not ack.ok:
                raise KVTransferError(f"decode executor {decode_id} refused a chunk: {ack.reason}")
        return TransferStats(num_pages, len(pages), len(chunks), time.perf_counter() - t0)

    async def _answer_while_subscribed(
        self, decode_id: str, request_id: str, request: Awaitable[bytes]
    ) -> bytes:
        """``request``'s answer (or its error); ``KVPeerGone`` as soon as a probe finds no
        subscriber of the decode executor's pages."""
        answer = asyncio.ensure_future(request)
        probe: asyncio.Future[bool] | None = None
        try:
            await asyncio.wait((answer,), timeout=PROBE_INTERVAL_S)
            while not answer.done():
                probe = asyncio.ensure_future(self._subscribed(decode_id, request_id))
                await asyncio.wait((answer, probe), return_when=asyncio.FIRST_COMPLETED)
                if not answer.done() and not probe.result():
                    raise KVPeerGone(
                        f"decode executor {decode_id} is gone (nobody subscribes to its pages) "
                        f"while the transfer of {request_id} waited for an answer"
                    )
            return answer.result()
        finally:
            for task in (answer, probe):
                if task is not None and not task.done():
                    task.cancel()

    async def _subscribed(self, decode_id: str, request_id: str) -> bool:
        """False when the server holds no subscription on the decode executor's pages subject (no
        responders, at once); True once ``PROBE_INTERVAL_S`` has passed otherwise (the probe went
        unanswered, or our own connection cannot tell now: the deadline decides)."""
        started = time.monotonic()
        try:
            await self.bus.request(
                subjects.kv_pages(decode_id, request_id),
                b"",
                PROBE_INTERVAL_S,
                headers={_PROBE: "1"},
            )
        except BusNoResponders:
            return False
        except BusError:
            pass
        await asyncio.sleep(max(0.0, PROBE_INTERVAL_S - (time.monotonic() - started)))
        return True

    async def cancel(self, decode_id: str, request_id: str) -> None:
        # Best effort: the decode side's deadline frees the reservation anyway.
        with contextlib.suppress(BusError):
            await self.bus.publish(
                subjects.kv_pages(decode_id, request_id), b"", headers={_CANCEL: "1"}
            )

    async def serve(self, executor_id: str, receiver: KVReceiver) -> None:
        async def on_offer(msg: Msg) -> None:
            reply = await receiver.on_offer(KV_OFFER.decode(msg.data))
            if msg.reply:
                await msg.respond(KV_OFFER_REPLY.encode(reply))

        async def on_pages(msg: Msg) -> None:
            request_id = msg.subject.rsplit(".", 1)[1]
            headers = msg.headers or {}
            if headers.get(_PROBE):
                return  # it asks the server whether we subscribe, not us: never answered
            if headers.get(_CANCEL):
                await receiver.on_cancel(request_id)
                return
            try:
                first, count = int(headers[_FIRST]), int(headers[_COUNT])
                last = headers[_LAST] == "1"
            except (KeyError, ValueError):
                ack = KVChunkAck(ok=False, reason="a chunk without its place in headers")
            else:
                ack = await receiver.on_pages(request_id, first, count, last, msg.data)
            if msg.reply:
                await msg.respond(KV_CHUNK_ACK.encode(ack))

        await self.bus.subscribe(subjects.executor_kv_offer(executor_id), on_offer)
        await self.bus.subscribe(subjects.kv_pages_of(executor_id), on_pages)
