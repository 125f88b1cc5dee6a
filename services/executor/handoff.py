"""The executor's KV handoff: a prefill executor ships a request's pages to a decode executor, which
installs them and continues the request (shared/engine/kv_transfer.py does the engine part,
shared/wire/kv_transport.py the moving).

    prefill executor                                    decode executor
    first token streamed; engine: Prefilled
    offer ─────────────────────────────────────────▶   Reserve (blocks; cached prefix by hash)
          ◀──────────── accepted, num_cached_blocks ─   (refused: no room, other layout, draining)
    pages[num_cached_blocks:] in chunks ───────────▶   written into the reserved blocks
          ◀─────────────────────────── ack per chunk ─   last chunk: Install; progress 'adopted'
    Release (held blocks freed); progress 'finished'     decodes and streams from the 2nd token

Who owns the request: the prefill executor until the last chunk is acknowledged, the decode
executor from then on (its 'adopted' progress tells the scheduler).

Failures, each bounded, none leaking a block:
- offer refused, or the decode executor gone before installing (no responders to the offer or a
  chunk, or to a probe while one of them waits for its answer: within half a second, see
  shared/wire/kv_transport.py): the prefill executor decodes the request itself on the blocks it
  held (``readopt``), so the client gets the same tokens.
- no ack in time: the prefill side cancels the transfer and decodes itself. Safe: the decode side
  commits only before ``timeout_s`` from the offer it received, and the prefill side waits that
  long from the offer's reply plus ``ACK_GRACE_S``.
- the prefill executor dies mid-transfer: the decode side frees its reservation at its deadline;
  the scheduler, which sees the prefill executor's heartbeats stop, ends the started request with
  a 502 (within its heartbeat timeout).
- a client abort during the transfer: both sides free their blocks (the worker's Abort).
- a drain (SIGTERM) on either side: a transfer counts as a request held (the shell's ``adopt`` /
  ``release``), so the drain waits for it up to its drain timeout, then cancels it (the peer is
  told and frees its side; a prefill side already gone decodes nothing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.executor.worker import (
    EngineWorker,
    Install,
    Prefilled,
    Release,
    Reserve,
    Reserved,
    Unreserve,
)
from shared.engine.kv_transfer import Handoff, PageLayout, write_pages
from shared.wire.kv_transport import (
    KVPeerGone,
    KVTransferError,
    KVTransferTimeout,
    KVTransport,
    TransferStats,
)
from shared.wire.messages import KVChunkAck, KVOffer, KVOfferReply, KVPageLayout

log = logging.getLogger("llmserve.executor.handoff")

# How long past the decode side's deadline the prefill side waits for the last ack (the ack's
# travel time): beyond it the decode side has certainly not committed.
ACK_GRACE_S = 1.0


@dataclass(frozen=True)
class HandoffConfig:
    executor_id: str
    transfer_timeout_s: float = 10.0  # offer to last ack, per request
    offer_timeout_s: float = 5.0  # the decode side answers an offer within this (it reserves)

    def __post_init__(self) -> None:
        if self.transfer_timeout_s <= 0 or self.offer_timeout_s <= 0:
            raise ValueError("transfer_timeout_s and offer_timeout_s must be > 0")


class ShellHooks:
    """What the handoff needs from the executor's shell (services/executor/service.py)."""

    def __init__(
        self,
        adopt: Callable[[str, int], bool],
        release: Callable[[str], object],
        progress: Callable[..., Awaitable[None]],
        draining: Callable[[], bool],
    ) -> None:
        self.adopt = adopt  # (rid, num_prompt_tokens) -> counted as held here (False: no room)
        self.release = release  # forget a request that ended or left
        # (rid, state, handed_to=None) on the scheduler's progress subject
        self.progress = progress
        self.draining = draining


@dataclass
class _Incoming:
    block_ids: tuple[int, ...]
    deadline: float  # time.monotonic(): no commit after it
    timer: asyncio.TimerHandle | None = None
    num_received: int = 0


@dataclass
class HandoffStats:
    """Cumulative, for metrics and tests."""

    outcomes: dict[str, int] = field(default_factory=dict)
    transfers: list[TransferStats] = field(default_factory=list)

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


def _wire_layout(layout: PageLayout) -> KVPageLayout:
    return KVPageLayout(
        num_layers=layout.num_layers,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        row=layout.row,
        dtype=layout.dtype,
    )


class KVHandoffs:
    """Both sides of the handoff for one executor: ``send`` for requests it prefilled, and the
    ``KVReceiver`` callbacks for requests handed to it."""

    def __init__(
        self,
        config: HandoffConfig,
        worker: EngineWorker,
        transport: KVTransport,
        hooks: ShellHooks,
        layout: PageLayout | None,
        on_transfer: Callable[[str, TransferStats | None], None] = lambda outcome, stats: None,
    ) -> None:
        self.config = config
        self.worker = worker
        self.transport = transport
        self.hooks = hooks
        self.layout = layout  # this engine's (None: unknown, e.g. a fake engine: offers refused)
        self.stats = HandoffStats()
        self._on_transfer = on_transfer
        self._sending: dict[str, asyncio.Task[None]] = {}
        self._reserving: dict[str, asyncio.Future[Reserved]] = {}
        self._incoming: dict[str, _Incoming] = {}

    def _outcome(self, outcome: str, stats: TransferStats | None = None) -> None:
        self.stats.count(outcome)
        if stats is not None:
            self.stats.transfers.append(stats)
        self._on_transfer(outcome, stats)

    # -- prefill side ------------------------------------------------------------------------------

    def send(self, event: Prefilled) -> None:
        task = asyncio.create_task(self._send(event))
        self._sending[event.request_id] = task
        task.add_done_callback(lambda _: self._sending.pop(event.request_id, None))

    def abort(self, rid: str) -> None:
        """A client abort: stop a transfer in flight (the worker's Abort frees the blocks)."""
        if (task := self._sending.get(rid)) is not None:
            task.cancel()
        if (incoming := self._incoming.pop(rid, None)) is not None:
            if incoming.timer is not None:
                incoming.timer.cancel()
            self._outcome("cancelled")  # every reservation ends with an outcome, for the metrics

    async def _send(self, event: Prefilled) -> None:
        rid, decode_id, h = event.request_id, event.decode_executor_id, event.handoff
        offer = KVOffer(
            request_id=rid,
            prefill_executor_id=self.config.executor_id,
            layout=_wire_layout(event.layout),
            prompt_token_ids=h.prompt_token_ids,
            block_hashes=h.block_hashes,
            params=h.params,
            priority=h.priority,
            first_token_id=h.first_token_id,
            num_emitted_chars=h.num_emitted_chars,
            num_cached_tokens=h.num_cached_tokens,
            generator_state=h.generator_state,
            timeout_s=self.config.transfer_timeout_s,
        )
        offered = False
        try:
            reply = await self.transport.offer(decode_id, offer, self.config.offer_timeout_s)
            if not reply.accepted:
                raise KVTransferError(f"refused: {reply.reason}")
            offered = True
            deadline = time.monotonic() + self.config.transfer_timeout_s + ACK_GRACE_S
            pages = event.pages[reply.num_cached_blocks :]
            stats = await self.transport.send_pages(
                decode_id,
                rid,
                memoryview(pages.numpy()).cast("B"),
                event.layout.page_nbytes,
                deadline,
            )
        except asyncio.CancelledError:
            if offered:
                await self.transport.cancel(decode_id, rid)
            raise
        except KVTransferError as e:
            if offered and not isinstance(e, KVPeerGone):
                await self.transport.cancel(decode_id, rid)
            outcome = (
                "peer_gone"
                if isinstance(e, KVPeerGone)
                else "timeout"
                if isinstance(e, KVTransferTimeout)
                else "refused"
            )
            log.warning("KV handoff of %s to %s failed (%s); decoding it here", rid, decode_id, e)
            self._outcome(outcome)
            self.worker.submit(Release(rid, readopt=True))
            return
        self._outcome("sent", stats)
        self.worker.submit(Release(rid))
        self.hooks.release(rid)
        await self.hooks.progress(rid, "finished", handed_to=decode_id)

    # -- decode side (KVReceiver) ------------------------------------------------------------------

    def on_reserved(self, event: Reserved) -> None:
        future = self._reserving.pop(event.request_id, None)
        if future is not None and not future.done():
            future.set_result(event)
        elif event.accepted:  # nobody waits any more (the offer timed out): give the blocks back
            self.worker.submit(Unreserve(event.request_id))

    async def on_offer(self, offer: KVOffer) -> KVOfferReply:
        rid = offer.request_id
        received_at = time.monotonic()
        if self.hooks.draining():
            return KVOfferReply(accepted=False, reason="draining")
        if self.layout is None or _wire_layout(self.layout) != offer.layout:
            return KVOfferReply(
                accepted=False, reason=f"KV page layout {offer.layout} is not this engine's"
            )
        if rid in self._incoming or rid in self._reserving:
            return KVOfferReply(accepted=False, reason="a transfer of this request is under way")
        if not self.hooks.adopt(rid, len(offer.prompt_token_ids)):
            return KVOfferReply(accepted=False, reason="no room for another request")
        future: asyncio.Future[Reserved] = asyncio.get_running_loop().create_future()
        self._reserving[rid] = future
        self.worker.submit(
            Reserve(
                Handoff(
                    request_id=rid,
                    prompt_token_ids=offer.prompt_token_ids,
                    block_hashes=offer.block_hashes,
                    params=offer.params,
                    priority=offer.priority,
                    first_token_id=offer.first_token_id,
                    num_emitted_chars=offer.num_emitted_chars,
                    num_cached_tokens=offer.num_cached_tokens,
                    generator_state=offer.generator_state,
                )
            )
        )
        try:
            # Answer before the prefill side gives up on the offer; late, on_reserved frees it.
            reserved = await asyncio.wait_for(future, self.config.offer_timeout_s * 0.8)
        except TimeoutError:
            self._reserving.pop(rid, None)
            self.hooks.release(rid)
            return KVOfferReply(accepted=False, reason="the engine did not reserve in time")
        if not reserved.accepted:
            self.hooks.release(rid)
            return KVOfferReply(accepted=False, reason=reserved.reason)
        deadline = received_at + offer.timeout_s
        incoming = _Incoming(reserved.block_ids, deadline)
        incoming.timer = asyncio.get_running_loop().call_at(
            asyncio.get_running_loop().time() + (deadline - time.monotonic()),
            self._expire,
            rid,
        )
        self._incoming[rid] = incoming
        return KVOfferReply(accepted=True, num_cached_blocks=reserved.num_cached_blocks)

    def _expire(self, rid: str) -> None:
        if self._drop(rid):
            log.warning("KV transfer of %s did not complete in time; reservation freed", rid)
            self._outcome("expired")

    def _drop(self, rid: str) -> bool:
        incoming = self._incoming.pop(rid, None)
        if incoming is None:
            return False
        if incoming.timer is not None:
            incoming.timer.cancel()
        self.worker.submit(Unreserve(rid))
        self.hooks.release(rid)
        return True

    async def on_pages(
        self, request_id: str, first_page: int, num_pages: int, last: bool, data: bytes
    ) -> KVChunkAck:
        incoming = self._incoming.get(request_id)
        if incoming is None:
            return KVChunkAck(ok=False, reason="no transfer of this request is open here")
        if time.monotonic() >= incoming.deadline:
            self._expire(request_id)
            return KVChunkAck(ok=False, reason="the transfer ran past its deadline")
        block_ids = list(incoming.block_ids[first_page : first_page + num_pages])
        try:
            if len(block_ids) != num_pages:
                raise ValueError(f"pages {first_page}+{num_pages} outside the reservation")
            write_pages(self.worker.kv_cache, block_ids, data)
        except ValueError as e:
            self._drop(request_id)
            self._outcome("bad_chunk")
            return KVChunkAck(ok=False, reason=str(e))
        incoming.num_received += num_pages
        if not last:
            return KVChunkAck(ok=True)
        if incoming.num_received != len(incoming.block_ids):
            self._drop(request_id)
            self._outcome("bad_chunk")
            return KVChunkAck(ok=False, reason="the last chunk came before every page")
        del self._incoming[request_id]
        if incoming.timer is not None:
            incoming.timer.cancel()
        self.worker.submit(Install(request_id))
        self._outcome("received")
        await self.hooks.progress(request_id, "adopted")
        return KVChunkAck(ok=True)

    async def on_cancel(self, request_id: str) -> None:
        if self._drop(request_id):
            self._outcome("cancelled")
