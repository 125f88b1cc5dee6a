"""The prefix index's Lua contracts (services/prefix_index/lua.py) against a real redis-server.

Every test runs twice: through EVALSHA (what Redis 6.2 runs), and through the Redis 7 function
library's exact text run by EVAL with ``redis.register_function`` stubbed (the library's syntax and
its callbacks' wiring; a real Redis 7 runs it with LLMSERVE_TEST_REDIS7_SERVER set, see below)."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from helpers.kv_executor import KVExecutorModel, dump_bytes, dump_keys, index_of, keys_without
from services.cli.servers import ServerProcess, free_port, start_redis
from services.prefix_index import lua
from services.prefix_index.store import (
    ApplyResult,
    IndexStoreError,
    IndexUnavailable,
    PrefixStore,
    connect_redis,
)
from shared.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheSnapshot,
    KVEvent,
    KVEventBatch,
    KVEventsMessage,
)

MODEL = "m"

# The library's text after its shebang line, with register_function collecting the callbacks; the
# script then calls the one named by ARGV[1] with the rest of ARGV, as FCALL would.
_LIBRARY_UNDER_EVAL = (
    "local registered = {}\n"
    "local redis = setmetatable({register_function = function(spec)\n"
    "  registered[spec.function_name] = spec.callback end}, {__index = redis})\n"
    + lua.FUNCTION_LIBRARY.split("\n", 1)[1]
    + "\nlocal name = table.remove(ARGV, 1)\nreturn registered[name](KEYS, ARGV)\n"
)


class LibraryUnderEvalStore(PrefixStore):
    async def _call(self, name: str, args: list[Any]) -> Any:
        argv = [lua.FUNCTION_NAMES[name], self.prefix, *args]
        return await self._guard(
            self.client.eval(_LIBRARY_UNDER_EVAL, 1, self.executors_key, *argv)
        )


@pytest.fixture(scope="module")
def redis7() -> Iterator[ServerProcess | None]:
    """A Redis >= 7 from $LLMSERVE_TEST_REDIS7_SERVER (a redis-server binary), to run the function
    path for real; None without it."""
    binary = os.environ.get("LLMSERVE_TEST_REDIS7_SERVER")
    if not binary:
        yield None
        return
    import services.cli.servers as servers

    real = servers.find_redis_server
    servers.find_redis_server = lambda: binary
    try:
        server = start_redis(free_port())
    finally:
        servers.find_redis_server = real
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_without_smismember() -> Iterator[ServerProcess]:
    """A Redis whose one user may run everything but SMISMEMBER, as a server older than 6.2
    lacks it: match takes its one-SISMEMBER-a-block path there."""
    server = start_redis(
        acl="user default off\nuser pi on >pi-test-password ~* &* +@all -smismember"
    )
    yield server
    server.stop()


@pytest.fixture(params=["evalsha", "library", "redis7-functions", "evalsha-no-smismember"])
def with_store(request, redis_url, redis7):
    """``with_store(main)``: runs ``await main(store, key_prefix)`` on a fresh key prefix, in one
    event loop with the store's client, and closes it."""
    mode = request.param
    if mode == "redis7-functions" and redis7 is None:
        pytest.skip("set LLMSERVE_TEST_REDIS7_SERVER to a redis-server >= 7 to run this mode")
    url = redis7.url if mode == "redis7-functions" else redis_url
    if mode == "evalsha-no-smismember":
        host_port = request.getfixturevalue("redis_without_smismember").url.split("//", 1)[1]
        url = f"redis://pi:pi-test-password@{host_port}"
    cls = LibraryUnderEvalStore if mode == "library" else PrefixStore

    def use(main: Callable[[PrefixStore, str], Awaitable[None]]) -> None:
        async def wrapper() -> None:
            key_prefix = f"test:pi:{uuid.uuid4().hex[:8]}"
            store = cls(
                connect_redis(url, 5.0),
                key_prefix,
                tombstone_ttl_s=600,
                use_functions=mode == "redis7-functions",
            )
            try:
                await main(store, key_prefix)
            finally:
                await store.close()

        asyncio.run(wrapper())

    return use


def test_applying_a_batch_twice_leaves_redis_unchanged(with_store):
    async def main(store: PrefixStore, key_prefix: str) -> None:
        a = KVExecutorModel("ex-a", MODEL)
        first = a.store_prompt(list(range(20)))
        assert (await store.apply(first)).result is ApplyResult.APPLIED
        second = a.batch([a.stored(list(range(100, 116))), a.removed([min(a.held)])])
        assert (await store.apply(second)).result is ApplyResult.APPLIED
        before = await dump_keys(store.client, key_prefix)
        raw_before = await dump_bytes(store.client, sorted(before))
        for message in (second, first, second):
            assert await store.apply(message) == (ApplyResult.REPLAY, 2)
        assert await dump_keys(store.client, key_prefix) == before
        assert await dump_bytes(store.client, sorted(before)) == raw_before
        assert index_of(before, key_prefix) == {"ex-a": a.held}

    with_store(main)


def test_match_gives_each_executor_its_leading_run(with_store):
    async def main(store: PrefixStore, key_prefix: str) -> None:
        tokens = list(range(40))  # 10 blocks of 4
        hashes = KVExecutorModel("x", MODEL).stored(tokens).block_hashes
        a, b, c, other = (KVExecutorModel(f"ex-{n}", MODEL) for n in "abcd")
        # A holds blocks 1-5, B 1-3, C 2-4 without 1; D holds 1-5 of another model.
        await store.apply(a.store_prompt(tokens[:20]))
        await store.apply(b.store_prompt(tokens[:12]))
        await store.apply(c.store_prompt(tokens[:16]))
        await store.apply(c.batch([c.removed([hashes[0]])]))
        other.model = "another-model"
        await store.apply(other.store_prompt(tokens[:20]))
        assert await store.match(MODEL, hashes) == {"ex-a": 5, "ex-b": 3}
        assert await store.match(MODEL, hashes[:2]) == {"ex-a": 2, "ex-b": 2}
        assert await store.match(MODEL, hashes[1:]) == {"ex-a": 4, "ex-b": 2, "ex-c": 3}
        assert await store.match(MODEL, []) == {}
        assert await store.match("no-such-model", hashes) == {}
        # A hole in A's run ends it there, even though it holds later blocks.
        await store.apply(a.batch([a.removed([hashes[2]])]))
        assert await store.match(MODEL, hashes) == {"ex-a": 2, "ex-b": 3}

    with_store(main)


def test_match_reads_runs_longer_than_one_call_takes(with_store):
    # The script asks for a run 1,000 hashes a call: runs that end in the second and third chunk.
    async def main(store: PrefixStore, key_prefix: str) -> None:
        tokens = list(range(4 * 2500))  # 2,500 blocks of 4
        a, b = KVExecutorModel("ex-a", MODEL), KVExecutorModel("ex-b", MODEL)
        hashes = a.stored(tokens).block_hashes
        await store.apply(a.store_prompt(tokens))
        await store.apply(b.store_prompt(tokens[: 4 * 1200]))
        assert await store.match(MODEL, hashes) == {"ex-a": 2500, "ex-b": 1200}
        await store.apply(a.batch([a.removed([hashes[2100]])]))
        assert await store.match(MODEL, hashes) == {"ex-a": 2100, "ex-b": 1200}
        assert await store.match(MODEL, hashes[:1000]) == {"ex-a": 1000, "ex-b": 1000}

    with_store(main)


def test_63_bit_hashes_stay_exact(with_store):
    async def main(store: PrefixStore, key_prefix: str) -> None:
        a = KVExecutorModel("ex-a", MODEL)
        # Neighbours that a double cannot tell apart: the Lua side must keep them strings.
        big = [(1 << 63) - 1, (1 << 63) - 2, (1 << 53) + 1, (1 << 53)]
        event = BlockStored(
            block_hashes=big[:2], parent_block_hash=None, token_ids=[], block_size=0
        )
        await store.apply(a.batch([event]))
        assert await store.match(MODEL, big[:2]) == {"ex-a": 2}
        assert await store.match(MODEL, [big[0], big[2]]) == {"ex-a": 1}
        assert await store.match(MODEL, [big[3]]) == {}
        dump = await dump_keys(store.client, key_prefix)
        assert index_of(dump, key_prefix) == {"ex-a": set(big[:2])}

    with_store(main)


async def _two_executors(store: PrefixStore) -> tuple[KVExecutorModel, KVExecutorModel]:
    a, b = KVExecutorModel("ex-a", MODEL), KVExecutorModel("ex-b", MODEL)
    shared_prefix = list(range(16))
    for ex in (a, b):
        await store.apply(ex.store_prompt(shared_prefix + [ord(ex.executor_id[-1])] * 8))
        await store.apply(ex.store_prompt(list(range(1000, 1012))))
    return a, b


async def _assert_only_a_changed(
    store: PrefixStore, key_prefix: str, before: dict[str, Any], others: dict[str, bytes | None]
) -> None:
    """The keys that neither name ex-a nor hold it are byte-identical; the block sets it shared
    with others lost ex-a and nothing else."""
    assert await dump_bytes(store.client, list(others)) == others
    shared = [
        key for key, value in before.items() if ":b:" in key and "ex-a" in value and len(value) > 1
    ]
    after = await dump_keys(store.client, key_prefix)
    for key in shared:
        assert after[key] == before[key] - {"ex-a"}, key
    # Nothing else appeared or went away outside ex-a's own keys (and the executors set, which
    # the caller checks).
    executors_key = f"{{{key_prefix}}}:executors"
    now_without_a = set(await keys_without(store.client, key_prefix, "ex-a")) - {executors_key}
    assert now_without_a == {*others, *shared}


@pytest.mark.parametrize("how", ["new epoch batch", "new epoch heartbeat", "cleared", "purged"])
def test_restart_clear_or_death_purges_exactly_that_executor(with_store, how):
    async def main(store: PrefixStore, key_prefix: str) -> None:
        a, b = await _two_executors(store)
        before = await dump_keys(store.client, key_prefix)
        others = await keys_without(store.client, key_prefix, "ex-a")
        if how == "new epoch batch":
            a.restart()
            assert (
                await store.apply(a.store_prompt(list(range(500, 508))))
            ).result is ApplyResult.APPLIED
        elif how == "new epoch heartbeat":
            a.restart()
            assert await store.observe("ex-a", a.epoch, MODEL) == "restarted"
        elif how == "cleared":
            assert (await store.apply(a.batch([a.cleared()]))).result is ApplyResult.APPLIED
        else:
            assert await store.purge("ex-a", a.epoch) == "purged"
            assert await store.purge("ex-a", a.epoch) == "absent"
        await _assert_only_a_changed(store, key_prefix, before, others)
        held_a = set() if how == "purged" else a.held
        index = index_of(await dump_keys(store.client, key_prefix), key_prefix)
        assert index.get("ex-a", set()) == held_a and index["ex-b"] == b.held
        live = {"ex-b": b.epoch} if how == "purged" else {"ex-a": a.epoch, "ex-b": b.epoch}
        assert await store.executors() == live
        assert await store.stats() == (1 + bool(held_a), len(held_a) + len(b.held))

    with_store(main)


def test_cleared_mid_batch_keeps_what_is_stored_after_it(with_store):
    async def main(store: PrefixStore, key_prefix: str) -> None:
        a = KVExecutorModel("ex-a", MODEL)
        await store.apply(a.store_prompt(list(range(12))))
        events: list[KVEvent] = [
            a.stored(list(range(50, 58))),
            a.cleared(),
            a.stored(list(range(70, 78))),
        ]
        assert (await store.apply(a.batch(events))).result is ApplyResult.APPLIED
        assert len(a.held) == 2
        assert index_of(await dump_keys(store.client, key_prefix), key_prefix) == {"ex-a": a.held}

    with_store(main)


def test_gap_and_stale_batches_write_nothing(with_store):
    async def main(store: PrefixStore, key_prefix: str) -> None:
        a = KVExecutorModel("ex-a", MODEL)
        old_epoch = a.epoch
        await store.apply(a.store_prompt(list(range(8))))
        before = await dump_keys(store.client, key_prefix)
        a.store_prompt(list(range(30, 38)))  # seq 2, never delivered
        # A gap says how far the executor's batches are applied.
        assert await store.apply(a.store_prompt(list(range(60, 68)))) == (ApplyResult.GAP, 1)
        wrong_model = KVEventsMessage(
            executor_id="ex-a", epoch=old_epoch, model="other", batch=KVEventBatch(seq=2, events=[])
        )
        assert (await store.apply(wrong_model)).result is ApplyResult.GAP
        assert await dump_keys(store.client, key_prefix) == before
        a.restart()
        await store.apply(a.store_prompt(list(range(90, 98))))
        after_restart = await dump_keys(store.client, key_prefix)
        stale = KVEventsMessage(
            executor_id="ex-a",
            epoch=old_epoch,
            model=MODEL,
            batch=KVEventBatch(seq=2, events=[AllBlocksCleared()]),
        )
        assert (await store.apply(stale)).result is ApplyResult.STALE
        assert await dump_keys(store.client, key_prefix) == after_restart
        # A new epoch whose first batch is lost: the old entries go, the rest waits for a resync.
        a.restart()
        a.store_prompt(list(range(8)))
        assert (await store.apply(a.store_prompt(list(range(8))))).result is ApplyResult.GAP
        assert index_of(await dump_keys(store.client, key_prefix), key_prefix) == {}

    with_store(main)


def test_snapshot_install_replaces_entries_unless_the_index_is_ahead(with_store):
    async def main(store: PrefixStore, key_prefix: str) -> None:
        a, b = await _two_executors(store)
        a.store_prompt(list(range(200, 216)))  # lost
        a.batch([a.removed(sorted(a.held)[:2])])  # lost
        others = await keys_without(store.client, key_prefix, "ex-a")
        snapshot = a.snapshot()
        assert await store.install_snapshot(snapshot) == "installed"
        dump = await dump_keys(store.client, key_prefix)
        assert index_of(dump, key_prefix) == {"ex-a": a.held, "ex-b": b.held}
        assert dump["{" + key_prefix + "}:x:ex-a"] == {
            "epoch": a.epoch,
            "seq": str(a.seq),
            "model": MODEL,
        }
        assert await dump_bytes(store.client, list(others)) == others
        # The next batch follows the snapshot; an older snapshot changes nothing.
        assert (
            await store.apply(a.store_prompt(list(range(300, 304))))
        ).result is ApplyResult.APPLIED
        assert await store.install_snapshot(snapshot) == "current"
        assert index_of(await dump_keys(store.client, key_prefix), key_prefix)["ex-a"] == a.held

    with_store(main)


def test_a_purged_epoch_stays_dead_until_a_snapshot_or_a_restart(with_store):
    async def main(store: PrefixStore, key_prefix: str) -> None:
        a, _ = await _two_executors(store)
        assert await store.purge("ex-a", a.epoch) == "purged"
        record = f"{{{key_prefix}}}:x:ex-a"
        assert 0 < await store.client.ttl(record) <= 600
        assert "ex-a" not in await store.executors()
        # Its epoch's later batches (still in the stream) do not bring it back...
        late = a.store_prompt(list(range(400, 408)))
        assert (await store.apply(late)).result is ApplyResult.STALE
        # ...but if it beats, it is alive: the service resyncs it.
        assert await store.observe("ex-a", a.epoch, MODEL) == "dead"
        assert await store.install_snapshot(a.snapshot()) == "installed"
        assert await store.client.ttl(record) == -1
        assert await store.observe("ex-a", a.epoch, MODEL) == "ok"
        assert index_of(await dump_keys(store.client, key_prefix), key_prefix)["ex-a"] == a.held
        # A restart after a death starts clean.
        assert await store.purge("ex-a") == "purged"
        a.restart()
        assert (await store.apply(a.store_prompt(list(range(8))))).result is ApplyResult.APPLIED
        assert (await store.executors())["ex-a"] == a.epoch
        # A purge for an older epoch leaves a restarted executor alone.
        assert await store.purge("ex-a", "0") == "newer"
        assert await store.observe("ex-a", "0", MODEL) == "stale"
        assert await store.observe("ex-nobody", a.epoch, MODEL) == "unknown"

    with_store(main)


def test_malformed_arguments_are_refused_before_any_write(with_store):
    async def main(store: PrefixStore, key_prefix: str) -> None:
        argv = ["ex-a", "1", MODEL, 1, "S", 2, "11", "R", 5, "12"]  # 'R' claims 5 hashes, has 1
        with pytest.raises(IndexStoreError) as err:
            await store._call("apply", argv)
        assert not isinstance(err.value, IndexUnavailable)
        assert await dump_keys(store.client, key_prefix) == {}

    with_store(main)


def test_a_server_that_forgot_the_scripts_gets_them_again(with_store):
    async def main(store: PrefixStore, key_prefix: str) -> None:
        a = KVExecutorModel("ex-a", MODEL)
        await store.apply(a.store_prompt(list(range(8))))
        # What a restarted Redis (without persistence) has forgotten.
        await store.client.script_flush()
        if store._use_functions:
            await store.client.function_flush()
        assert (await store.apply(a.store_prompt(list(range(8))))).result is ApplyResult.APPLIED
        assert index_of(await dump_keys(store.client, key_prefix), key_prefix) == {"ex-a": a.held}

    with_store(main)


def test_functions_are_used_where_the_server_has_them(redis_url, redis7):
    async def main() -> None:
        for url, expected in [(redis_url, False), *([(redis7.url, True)] if redis7 else [])]:
            store = PrefixStore(connect_redis(url, 5.0), "test:pi:detect", tombstone_ttl_s=60)
            assert await store.match(MODEL, [1]) == {}
            assert store._use_functions is expected
            await store.close()

    asyncio.run(main())


def test_an_unreachable_redis_is_a_typed_fast_error():
    async def main() -> None:
        port = free_port()  # nothing listens there
        store = PrefixStore(
            aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=0.5),
            "test:pi",
            tombstone_ttl_s=60,
            use_functions=False,
        )
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(IndexUnavailable):
            await store.match(MODEL, [1, 2, 3])
        assert loop.time() - started < 2.0
        await store.close()

    asyncio.run(main())


def test_thousands_of_hashes_in_one_call(with_store):
    async def main(store: PrefixStore, key_prefix: str) -> None:
        a = KVExecutorModel("ex-a", MODEL)
        many = list(range(10**12, 10**12 + 2500))  # past the per-call chunk of the held set
        stored = BlockStored(block_hashes=many, parent_block_hash=None, token_ids=[], block_size=0)
        assert (await store.apply(a.batch([stored]))).result is ApplyResult.APPLIED
        assert await store.stats() == (1, 2500)
        removed = a.batch([BlockRemoved(block_hashes=many[:1500])])
        assert (await store.apply(removed)).result is ApplyResult.APPLIED
        assert await store.match(MODEL, many[1500:]) == {"ex-a": 1000}
        snapshot = KVCacheSnapshot(
            executor_id="ex-a", epoch=a.epoch, model=MODEL, seq=a.seq + 1, block_hashes=many
        )
        assert await store.install_snapshot(snapshot) == "installed"
        assert await store.match(MODEL, many) == {"ex-a": 2500}
        dump = await dump_keys(store.client, key_prefix)
        assert index_of(dump, key_prefix) == {"ex-a": set(many)}
        assert dump[f"{{{key_prefix}}}:xb:ex-a"] == {str(h) for h in many}

    with_store(main)
