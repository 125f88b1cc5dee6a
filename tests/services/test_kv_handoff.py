"""KV handoff between executor services over a real nats-server (max_payload small, so pages span
several messages): a prefill executor streams the first token and hands the request to a decode
executor, which continues it with exactly the tokens of one engine; each failure ends in the same
tokens decoded locally, and no block is leaked on either side."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from helpers.tiny_llama import TINY_VOCAB, save_tiny_llama
from services.cli.servers import ServerProcess, start_nats
from services.executor.service import ExecutorService, ExecutorServiceConfig
from services.executor.worker import EngineWorker
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.wire import messages, subjects
from shared.wire.block_hash import hash_prompt_blocks
from shared.wire.bus import Bus, Msg
from shared.wire.messages import (
    KV_CHUNK_ACK,
    KV_OFFER,
    KV_OFFER_REPLY,
    ExecuteRequest,
    KVChunkAck,
    KVOffer,
    KVOfferReply,
    SamplingParams,
    StreamError,
    StreamKeepalive,
    StreamOutput,
)

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
# fp32 pages of the tiny Llama: 2 layers x (K, V) x 16 tokens x 2 heads x 16 x 4 bytes = 8 KiB;
# a 32 KiB payload carries 3 of them, so a 150-token prompt (10 blocks) takes 4 messages.
MAX_PAYLOAD = 32 * 1024


@pytest.fixture(scope="module")
def small_nats() -> Iterator[ServerProcess]:
    server = start_nats(max_payload=MAX_PAYLOAD)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=9)


def tiny_engine(path: str, num_kv_blocks: int = 64) -> Engine:
    return Engine(
        EngineConfig(
            model=path,
            dtype="float32",
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            num_threads=1,
        ),
        progress=False,
    )


@pytest.fixture(scope="module")
def engines(tiny_dir) -> dict[str, Engine]:
    return {name: tiny_engine(tiny_dir) for name in ("ref", "p", "d")}


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(2, TINY_VOCAB) for _ in range(n - 1)]


def aggregated(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    rid = uuid.uuid4().hex
    engine.add_request(rid, prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.deltas[0].token_ids
    return tokens


def service(bus: Bus, engine: Engine, executor_id: str, role: str, **kw: Any) -> ExecutorService:
    return ExecutorService(
        bus,
        EngineWorker(engine, num_threads=1),
        ExecutorServiceConfig(
            executor_id=executor_id,
            model_name="tiny",
            max_model_len=engine.max_model_len,
            block_size=BLOCK,
            max_num_seqs=4,
            heartbeat_interval_s=0.2,
            drain_timeout_s=0.5,
            role=role,
            **kw,
        ),
    )


async def run(
    bus: Bus, prefill_id: str, decode_id: str, prompt: list[int], params=GREEDY
) -> tuple[list[int], list[str]]:
    """Dispatch to the prefill executor with a decode executor; the stream's tokens and which
    executor sent each output."""
    rid = uuid.uuid4().hex
    tokens: list[int] = []
    senders: list[str] = []
    async with await bus.subscribe_iter(subjects.stream(rid)) as sub:
        request = ExecuteRequest(
            request_id=rid,
            model="tiny",
            prompt_token_ids=prompt,
            block_hashes=hash_prompt_blocks(prompt, BLOCK),
            params=params,
            decode_executor_id=decode_id,
        )
        await bus.publish(
            subjects.executor_decode(prefill_id), messages.EXECUTE_REQUEST.encode(request)
        )
        while True:
            msg = messages.STREAM_MESSAGE.decode((await sub.next(30)).data)
            if isinstance(msg, StreamKeepalive):
                continue
            assert not isinstance(msg, StreamError), msg
            assert isinstance(msg, StreamOutput)
            tokens += msg.output.deltas[0].token_ids
            senders.append(msg.executor_id)
            if msg.output.finished:
                return tokens, senders


async def settle(*engines: Engine, free: list[int]) -> None:
    """Wait until each engine is idle with ``free`` free blocks (the engine threads finish their
    commands a moment after the last output)."""
    for _ in range(250):
        if [e.stats().num_free_blocks for e in engines] == free and not any(
            e.requests for e in engines
        ):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"free blocks {[e.stats().num_free_blocks for e in engines]} != {free}")


class Stack:
    def __init__(self, url: str) -> None:
        self.url = url
        self.services: list[ExecutorService] = []
        self.buses: list[Bus] = []

    async def bus(self, name: str) -> Bus:
        bus = await Bus.connect(self.url, name)
        self.buses.append(bus)
        return bus

    async def executor(self, engine: Engine, executor_id: str, role: str, **kw) -> ExecutorService:
        s = service(await self.bus(executor_id), engine, executor_id, role, **kw)
        await s.start()
        self.services.append(s)
        return s

    async def close(self) -> None:
        for s in self.services:
            await s.drain()
        for b in self.buses:
            await b.close()


def test_handoff_streams_the_same_tokens_and_frees_every_block(small_nats, engines):
    ref, p, d = engines["ref"], engines["p"], engines["d"]
    prompt = prompt_of(150, seed=1)
    expected = aggregated(ref, prompt, GREEDY)
    free = [p.stats().num_free_blocks, d.stats().num_free_blocks]

    async def main() -> None:
        stack = Stack(small_nats.url)
        try:
            sp = await stack.executor(p, "pre-1", "prefill")
            sd = await stack.executor(d, "dec-1", "decode")
            client = await stack.bus("client")
            progress: list[tuple[str, str]] = []
            handed_to: list[str | None] = []

            async def on_progress(msg: Msg) -> None:
                m = messages.REQUEST_PROGRESS.decode(msg.data)
                progress.append((m.executor_id, m.state))
                if (m.executor_id, m.state) == ("pre-1", "finished"):
                    handed_to.append(m.handed_to)

            await client.subscribe(subjects.SCHEDULER_PROGRESS, on_progress)
            await client.flush()
            tokens, senders = await run(client, "pre-1", "dec-1", prompt)
            assert tokens == expected
            assert senders[0] == "pre-1" and set(senders[1:]) == {"dec-1"}
            await settle(p, d, free=free)
            assert sp.handoffs.stats.outcomes == {"sent": 1}
            assert sd.handoffs.stats.outcomes == {"received": 1}
            sent = sp.handoffs.stats.transfers[0]
            assert sent.num_pages == 10 and sent.num_chunks == 4
            assert sent.num_bytes == 10 * 8192
            for _ in range(50):
                if ("pre-1", "finished") in progress and ("dec-1", "finished") in progress:
                    break
                await asyncio.sleep(0.02)
            assert progress.index(("pre-1", "started")) < progress.index(("dec-1", "adopted"))
            assert ("dec-1", "finished") in progress and ("pre-1", "finished") in progress
            # The prefill side names where the request went (the scheduler moves it there even if
            # this 'finished' overtakes the 'adopted'), and it is idle: a drain would not wait.
            assert handed_to == ["dec-1"]
            assert sp._idle.is_set() and not sp._live

            # The decode side's cached prefix is not sent again: the same prompt's first 9 blocks
            # are in its prefix cache now (the 10th, partly filled, is sent).
            tokens, _ = await run(client, "pre-1", "dec-1", prompt)
            assert tokens == expected
            assert sp.handoffs.stats.transfers[1].num_pages == 1
            await settle(p, d, free=free)
        finally:
            await stack.close()

    asyncio.run(main())


def test_a_decode_executor_without_room_refuses_and_the_prefill_side_decodes(
    small_nats, engines, tiny_dir
):
    ref, p = engines["ref"], engines["p"]
    small = tiny_engine(tiny_dir, num_kv_blocks=6)  # 5 usable blocks: a 150-token prompt needs 10
    prompt = prompt_of(150, seed=2)
    expected = aggregated(ref, prompt, SamplingParams(temperature=0.0, max_tokens=4))
    free = [p.stats().num_free_blocks, small.stats().num_free_blocks]

    async def main() -> None:
        stack = Stack(small_nats.url)
        try:
            sp = await stack.executor(p, "pre-2", "prefill")
            await stack.executor(small, "dec-2", "decode")
            client = await stack.bus("client")
            tokens, senders = await run(
                client, "pre-2", "dec-2", prompt, SamplingParams(temperature=0.0, max_tokens=4)
            )
            assert tokens == expected and set(senders) == {"pre-2"}
            assert sp.handoffs.stats.outcomes == {"refused": 1}
            await settle(p, small, free=free)
        finally:
            await stack.close()

    asyncio.run(main())


def test_a_decode_executor_that_is_gone_leaves_the_request_to_the_prefill_side(small_nats, engines):
    ref, p = engines["ref"], engines["p"]
    prompt = prompt_of(40, seed=3)
    expected = aggregated(ref, prompt, GREEDY)
    free = [p.stats().num_free_blocks]

    async def main() -> None:
        stack = Stack(small_nats.url)
        try:
            sp = await stack.executor(p, "pre-3", "prefill")
            client = await stack.bus("client")
            tokens, senders = await run(client, "pre-3", "nobody", prompt)
            assert tokens == expected and set(senders) == {"pre-3"}
            assert sp.handoffs.stats.outcomes == {"peer_gone": 1}
            await settle(p, free=free)
        finally:
            await stack.close()

    asyncio.run(main())


def test_a_transfer_timeout_cancels_and_the_prefill_side_decodes(small_nats, engines):
    """A decode executor that accepts and then never acknowledges a chunk (stuck)."""
    ref, p = engines["ref"], engines["p"]
    prompt = prompt_of(100, seed=4)
    expected = aggregated(ref, prompt, GREEDY)
    free = [p.stats().num_free_blocks]

    async def main() -> None:
        stack = Stack(small_nats.url)
        try:
            sp = await stack.executor(p, "pre-4", "prefill", kv_transfer_timeout_s=0.5)
            stuck = await stack.bus("stuck")
            cancels: list[str] = []

            async def on_offer(msg: Msg) -> None:
                KV_OFFER.decode(msg.data)
                await msg.respond(KV_OFFER_REPLY.encode(KVOfferReply(accepted=True)))

            async def on_pages(msg: Msg) -> None:
                if (msg.headers or {}).get("Llmserve-Kv-Cancel"):
                    cancels.append(msg.subject)  # and never ack a chunk

            await stuck.subscribe(subjects.executor_kv_offer("stuck"), on_offer)
            await stuck.subscribe(subjects.kv_pages_of("stuck"), on_pages)
            await stuck.flush()
            client = await stack.bus("client")
            tokens, senders = await run(client, "pre-4", "stuck", prompt)
            assert tokens == expected and set(senders) == {"pre-4"}
            assert sp.handoffs.stats.outcomes == {"timeout": 1}
            assert len(cancels) == 1
            await settle(p, free=free)
        finally:
            await stack.close()

    asyncio.run(main())


def test_a_prefill_side_that_dies_mid_transfer_frees_the_reservation(small_nats, engines):
    """The prefill executor offers, sends one chunk of three and goes: the decode executor frees
    its reservation at the transfer's deadline, and refuses a chunk that comes after it."""
    d = engines["d"]
    prompt = prompt_of(150, seed=5)
    free = [d.stats().num_free_blocks]

    async def main() -> None:
        stack = Stack(small_nats.url)
        try:
            sd = await stack.executor(d, "dec-5", "decode")
            layout = sd.handoffs.layout
            assert layout is not None
            dying = await stack.bus("dying")
            offer = KVOffer(
                request_id="r5",
                prefill_executor_id="dying",
                layout=messages.KVPageLayout(**layout.__dict__),
                prompt_token_ids=prompt,
                block_hashes=hash_prompt_blocks(prompt, BLOCK),
                params=GREEDY,
                priority=0,
                first_token_id=5,
                num_emitted_chars=1,
                num_cached_tokens=0,
                generator_state=None,
                timeout_s=0.5,
            )
            reply = KV_OFFER_REPLY.decode(
                await dying.request(subjects.executor_kv_offer("dec-5"), KV_OFFER.encode(offer), 5)
            )
            assert reply.accepted and reply.num_cached_blocks == 0
            assert d.stats().num_free_blocks <= free[0] - 10
            chunk = bytes(3 * layout.page_nbytes)
            headers = {"Llmserve-Kv-First": "0", "Llmserve-Kv-Count": "3", "Llmserve-Kv-Last": "0"}
            ack = KV_CHUNK_ACK.decode(
                await dying.request(subjects.kv_pages("dec-5", "r5"), chunk, 5, headers=headers)
            )
            assert ack == KVChunkAck(ok=True)
            await asyncio.sleep(0.7)  # past the deadline
            await settle(d, free=free)
            assert sd.handoffs.stats.outcomes == {"expired": 1}
            headers["Llmserve-Kv-First"] = "3"
            late = KV_CHUNK_ACK.decode(
                await dying.request(subjects.kv_pages("dec-5", "r5"), chunk, 5, headers=headers)
            )
            assert not late.ok
            assert not sd._live  # nothing held for it
        finally:
            await stack.close()

    asyncio.run(main())
