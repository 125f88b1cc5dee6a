"""For the prefix index's tests: an executor's KV cache side played by the test (the true set of
cached block hashes, the KVEventsMessage batches that reproduce it, snapshots and heartbeats), and a
typed dump of every Redis key under an index's prefix.

    ex = KVExecutorModel("ex-a", "m", block_size=4)
    msg = ex.store_prompt(list(range(20)))      # a batch: BlockStored of the prompt's 5 blocks
    await publish(bus, msg)                     # on subjects.kv_events("ex-a"), kept by the stream
    ex.held                                     # what the index must end up with
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

from helpers.stats import engine_stats
from shared.wire import subjects
from shared.wire.block_hash import hash_prompt_blocks
from shared.wire.bus import Bus, Msg
from shared.wire.kv_events import (
    KV_CACHE_SNAPSHOT,
    KV_EVENTS_MESSAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheSnapshot,
    KVEvent,
    KVEventBatch,
    KVEventsMessage,
    new_epoch,
)
from shared.wire.messages import EXECUTOR_HEARTBEAT, ExecutorHeartbeat


class KVExecutorModel:
    """One executor's cached block hashes and the batches that tell them, numbered 1, 2, ... per
    epoch."""

    def __init__(self, executor_id: str, model: str, block_size: int = 4) -> None:
        self.executor_id = executor_id
        self.model = model
        self.block_size = block_size
        self.epoch = new_epoch()
        self.seq = 0
        self.held: set[int] = set()

    def batch(self, events: list[KVEvent]) -> KVEventsMessage:
        self.seq += 1
        return KVEventsMessage(
            executor_id=self.executor_id,
            epoch=self.epoch,
            model=self.model,
            batch=KVEventBatch(seq=self.seq, events=events),
        )

    def stored(self, token_ids: Sequence[int]) -> BlockStored:
        """The event of a prompt's full blocks becoming cached (the whole chain: an index must
        take hashes it already holds as a set insert)."""
        hashes = hash_prompt_blocks(token_ids, self.block_size)
        self.held.update(hashes)
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=list(token_ids[: len(hashes) * self.block_size]),
            block_size=self.block_size,
        )

    def removed(self, hashes: Sequence[int]) -> BlockRemoved:
        self.held.difference_update(hashes)
        return BlockRemoved(block_hashes=list(hashes))

    def cleared(self) -> AllBlocksCleared:
        self.held.clear()
        return AllBlocksCleared()

    def store_prompt(self, token_ids: Sequence[int]) -> KVEventsMessage:
        return self.batch([self.stored(token_ids)])

    def restart(self) -> None:
        """A new process: a later epoch, nothing cached, batches from 1 again (no event says so)."""
        self.epoch = new_epoch()
        self.seq = 0
        self.held = set()

    def snapshot(self) -> KVCacheSnapshot:
        return KVCacheSnapshot(
            executor_id=self.executor_id,
            epoch=self.epoch,
            model=self.model,
            seq=self.seq,
            block_hashes=sorted(self.held),
        )

    def heartbeat(self) -> ExecutorHeartbeat:
        return ExecutorHeartbeat(
            executor_id=self.executor_id,
            epoch=self.epoch,
            role="both",
            model=self.model,
            max_model_len=4096,
            block_size=self.block_size,
            stats=engine_stats(),
            sent_at=time.time(),
        )

    def random_step(self, rng: random.Random, prefixes: Sequence[Sequence[int]]) -> KVEventsMessage:
        """A plausible engine step: a prompt sharing one of ``prefixes`` is cached, and sometimes
        some held blocks are evicted, or (rarely) everything is cleared."""
        events: list[KVEvent] = []
        roll = rng.random()
        if roll < 0.02:
            events.append(self.cleared())
        elif roll < 0.35 and self.held:
            victims = rng.sample(sorted(self.held), k=min(len(self.held), rng.randint(1, 4)))
            events.append(self.removed(victims))
        suffix = [rng.randrange(50_000) for _ in range(rng.randint(0, 3 * self.block_size))]
        events.append(self.stored([*rng.choice(prefixes), *suffix]))
        return self.batch(events)


async def publish(bus: Bus, message: KVEventsMessage) -> None:
    await bus.publish(subjects.kv_events(message.executor_id), KV_EVENTS_MESSAGE.encode(message))


async def publish_heartbeat(bus: Bus, executor: KVExecutorModel) -> None:
    await bus.publish(
        subjects.executor_stats(executor.executor_id),
        EXECUTOR_HEARTBEAT.encode(executor.heartbeat()),
    )


async def answer_snapshots(bus: Bus, executor: KVExecutorModel) -> Any:
    """Answer the executor's snapshot subject from ``executor``'s current state, as a real one
    does between engine steps. Returns the subscription (``.unsubscribe()``)."""

    async def on_request(msg: Msg) -> None:
        await msg.respond(KV_CACHE_SNAPSHOT.encode(executor.snapshot()))

    sub = await bus.subscribe(subjects.executor_kv_snapshot(executor.executor_id), on_request)
    await bus.flush()
    return sub


async def dump_keys(client: Any, key_prefix: str) -> dict[str, Any]:
    """Every key under ``{key_prefix}:``, typed: a SET as a frozenset, a HASH as a dict (a
    tombstone's TTL left out), so two indexes with equal content compare equal whatever the order
    their members came in. Not atomic: while the index changes, poll it until it is as expected."""
    out: dict[str, Any] = {}
    async for key in client.scan_iter(match="{" + key_prefix + "}:*", count=1000):
        name = key.decode() if isinstance(key, bytes) else key
        kind = await client.type(key)
        kind = kind.decode() if isinstance(kind, bytes) else kind
        if kind == "set":
            out[name] = frozenset(_text(m) for m in await client.smembers(key))
        elif kind == "hash":
            out[name] = {_text(k): _text(v) for k, v in (await client.hgetall(key)).items()}
        elif kind != "none":  # none: deleted since the scan saw it
            raise AssertionError(f"unexpected {kind} key {name}")
    return out


async def dump_bytes(client: Any, keys: list[str]) -> dict[str, bytes | None]:
    """DUMP of each key: byte-identical values mean the key was not touched."""
    return {key: await client.dump(key) for key in keys}


async def keys_without(client: Any, key_prefix: str, executor_id: str) -> dict[str, bytes | None]:
    """DUMP of every key under the prefix that neither names ``executor_id`` nor holds it: what a
    change to that executor alone must leave byte-identical."""
    dump = await dump_keys(client, key_prefix)
    names = [
        key
        for key, value in dump.items()
        if not key.endswith(f":{executor_id}")
        and not (isinstance(value, frozenset) and executor_id in value)
    ]
    return await dump_bytes(client, sorted(names))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def index_of(dump: dict[str, Any], key_prefix: str) -> dict[str, set[int]]:
    """executor → block hashes, read from the block sets of a dump (the side match uses)."""
    head = "{" + key_prefix + "}:b:"
    out: dict[str, set[int]] = {}
    for key, members in dump.items():
        if key.startswith(head):
            block_hash = int(key.rsplit(":", 1)[1])
            for executor_id in members:
                out.setdefault(executor_id, set()).add(block_hash)
    return out
