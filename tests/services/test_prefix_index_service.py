"""The prefix index service over a real nats-server (JetStream) and redis-server, with the test
playing the executors: KV event batches on the stream, heartbeats, snapshot answers.

Each test gets its own nats-server, so the KV events stream and its consumers start empty, and its
own key prefix in Redis."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import pytest

from helpers.kv_executor import (
    KVExecutorModel,
    answer_snapshots,
    dump_keys,
    keys_without,
    publish,
    publish_heartbeat,
)
from helpers.prefix_index import (
    MODEL,
    counted,
    index_config,
    index_equals,
    match,
    redis_client,
    status,
)
from services.cli.servers import start_nats
from services.prefix_index.service import running
from services.prefix_index.store import PrefixStore, connect_redis
from shared.wire.block_hash import hash_prompt_blocks
from shared.wire.bus import Bus
from shared.wire.messages import PrefixMatchReply


@pytest.fixture
def own_nats_url() -> Iterator[str]:
    """A nats-server of this test's own: the KV events stream and its consumers start empty."""
    server = start_nats()
    yield server.url
    server.stop()


def test_batches_from_the_stream_are_applied_and_matched_over_nats(own_nats_url, redis_url):
    async def main() -> None:
        config = index_config(own_nats_url, redis_url)
        tokens = list(range(40))
        a, b, c = (KVExecutorModel(f"ex-{n}", MODEL) for n in "abc")
        async with (
            await Bus.connect(own_nats_url, "test") as bus,
            running(config) as service,
            redis_client(config) as client,
        ):
            hashes = hash_prompt_blocks(tokens, a.block_size)  # 10 blocks
            batches = [
                a.store_prompt(tokens[:20]),  # A holds blocks 1-5
                b.store_prompt(tokens[:12]),  # B holds 1-3
                c.store_prompt(tokens[:16]),  # C holds 1-4...
                c.batch([c.removed(hashes[:1])]),  # ...then 2-4 without 1
            ]
            for message in batches:
                await publish(bus, message)
            await index_equals(client, config.key_prefix, [a, b, c])
            assert (await match(bus, hashes)) == PrefixMatchReply(num_blocks={"ex-a": 5, "ex-b": 3})
            assert (await match(bus, hashes[1:])).num_blocks == {"ex-a": 4, "ex-b": 2, "ex-c": 3}

            # Every batch delivered again (an executor's retry, a stream replay): no change.
            before = await dump_keys(client, config.key_prefix)
            for message in batches:
                await publish(bus, message)
            await counted(service, "num_replays", len(batches))
            assert await dump_keys(client, config.key_prefix) == before

            s = await status(bus)
            assert s.redis_ok and s.num_executors == 3 and s.num_purges == 0
            assert s.num_block_entries == len(a.held) + len(b.held) + len(c.held)
            assert (s.num_batches_applied, s.num_replays) == (len(batches), len(batches))
            assert 0.0 <= s.last_apply_lag_s < 10.0

            # C clears its cache: its entries go, and the status counts a purge.
            await publish(bus, c.batch([c.cleared()]))
            await index_equals(client, config.key_prefix, [a, b, c])
            await counted(service, "num_purges", 1)
            s = await status(bus)
            assert (s.num_executors, s.num_purges) == (2, 1)
            assert s.num_block_entries == len(a.held) + len(b.held)

    asyncio.run(main())


def test_heartbeats_purge_the_silent_and_the_restarted_and_resync_the_wrongly_purged(
    own_nats_url, redis_url
):
    async def main() -> None:
        config = index_config(own_nats_url, redis_url, executor_timeout_s=1.0)
        a, b, z = (KVExecutorModel(f"ex-{n}", MODEL) for n in "abz")
        beating = {a, b}
        async with (
            await Bus.connect(own_nats_url, "test") as bus,
            redis_client(config) as client,
        ):
            # Z is in the index before the service starts and never beats: seen at start, then
            # purged once the timeout has passed.
            seed = PrefixStore(connect_redis(redis_url, 5.0), config.key_prefix, tombstone_ttl_s=60)
            await seed.apply(z.store_prompt(list(range(16))))
            await seed.close()

            async def heartbeats() -> None:
                while True:
                    for ex in list(beating):
                        await publish_heartbeat(bus, ex)
                    await asyncio.sleep(0.2)

            beat_task = asyncio.create_task(heartbeats())
            await answer_snapshots(bus, b)
            shared_prefix = list(range(100, 116))
            async with running(config) as service:
                for ex in (a, b):
                    await publish(
                        bus, ex.store_prompt(shared_prefix + [ord(ex.executor_id[-1])] * 8)
                    )
                z.held.clear()  # what the index must end with for Z
                await index_equals(client, config.key_prefix, [a, b, z])
                await counted(service, "num_purges", 1)  # Z

                # B goes silent: exactly its entries go; A's keys stay byte-identical.
                a_keys = await keys_without(client, config.key_prefix, "ex-b")
                beating.discard(b)
                b_held, b.held = b.held, set()
                await index_equals(client, config.key_prefix, [a, b])
                await counted(service, "num_purges", 2)
                assert await _dumped(client, a_keys) == a_keys

                # B beats again with the same epoch: it was alive after all, so it is resynced
                # from its snapshot.
                resyncs = service.counters.num_resyncs
                b.held = b_held
                beating.add(b)
                await index_equals(client, config.key_prefix, [a, b])
                await counted(service, "num_resyncs", resyncs + 1)

                # A restarts (a new epoch in its heartbeat): its old entries go at once.
                b_keys = await keys_without(client, config.key_prefix, "ex-a")
                a.restart()
                await index_equals(client, config.key_prefix, [a, b])
                await counted(service, "num_purges", 3)
                assert await _dumped(client, b_keys) == b_keys
                # And its new epoch's batches apply from seq 1.
                await publish(bus, a.store_prompt(shared_prefix))
                await index_equals(client, config.key_prefix, [a, b])
            beat_task.cancel()

    asyncio.run(main())


async def _dumped(client: Any, keys: dict[str, bytes | None]) -> dict[str, bytes | None]:
    return {key: await client.dump(key) for key in keys}


def test_a_gap_is_filled_from_the_executors_snapshot(own_nats_url, redis_url):
    async def main() -> None:
        config = index_config(own_nats_url, redis_url)
        a = KVExecutorModel("ex-a", MODEL)
        mute = KVExecutorModel("ex-mute", MODEL)  # misses a batch and never answers
        async with (
            await Bus.connect(own_nats_url, "test") as bus,
            running(config) as service,
            redis_client(config) as client,
        ):
            await answer_snapshots(bus, a)
            await publish(bus, a.store_prompt(list(range(16))))
            await publish(bus, a.store_prompt(list(range(200, 216))))
            a.batch([a.removed(sorted(a.held)[:3]), a.stored(list(range(300, 312)))])  # lost
            await publish(bus, a.store_prompt(list(range(400, 408))))
            await publish(bus, mute.store_prompt(list(range(16))))
            mute.store_prompt(list(range(50, 58)))  # lost
            await publish(bus, mute.store_prompt(list(range(60, 68))))
            mute.held.clear()  # no snapshot: its entries are purged
            await index_equals(client, config.key_prefix, [a, mute])
            record = await client.hgetall("{" + config.key_prefix + "}:x:ex-a")
            assert record == {"epoch": a.epoch, "seq": str(a.seq), "model": MODEL}
            await counted(service, "num_resyncs", 1)
            await counted(service, "num_purges", 1)
            num_stale = service.counters.num_stale

            # The batch after the gap was acked, not lost in a redelivery loop; A goes on.
            await publish(bus, a.store_prompt(list(range(500, 508))))
            # Later batches of the purged executor's epoch do not bring it back.
            await publish(bus, mute.store_prompt(list(range(70, 78))))
            mute.held.clear()
            await index_equals(client, config.key_prefix, [a, mute])
            await counted(service, "num_stale", num_stale + 1)

    asyncio.run(main())


def test_replicas_share_the_stream_and_wait_for_each_other_across_gaps(own_nats_url, redis_url):
    async def main() -> None:
        # Two replicas of one index (one consumer, one key prefix), with the default gap waits.
        config = index_config(
            own_nats_url,
            redis_url,
            gap_retry_delay_s=0.25,
            gap_stall_timeout_s=1.0,
            resync_after_deliveries=3,
        )
        executors = [KVExecutorModel(f"ex-{i}", MODEL) for i in range(3)]
        rng = random.Random(7)
        prefixes = [[rng.randrange(50_000) for _ in range(4 * k)] for k in (1, 3)]
        async with (
            await Bus.connect(own_nats_url, "test") as bus,
            running(config) as first,
            running(config) as second,
            redis_client(config) as client,
        ):
            # No snapshot answers: a resync would purge, so each batch must be applied in turn.
            num_steps = 150
            for step in range(num_steps):
                await publish(bus, rng.choice(executors).random_step(rng, prefixes))
                if step % 10 == 9:  # in bursts, so both replicas hold batches of one executor
                    await asyncio.sleep(0.02)
            await index_equals(client, config.key_prefix, executors)
            applied = [s.counters.num_batches_applied for s in (first, second)]
            assert sum(applied) == num_steps and min(applied) > 0, applied
            assert first.counters.num_resyncs == second.counters.num_resyncs == 0

    asyncio.run(main())


def test_a_batch_ahead_of_its_predecessor_waits_for_it_without_a_resync(own_nats_url, redis_url):
    async def main() -> None:
        config = index_config(
            own_nats_url, redis_url, gap_retry_delay_s=0.1, gap_stall_timeout_s=2.0
        )
        a = KVExecutorModel("ex-a", MODEL)
        async with (
            await Bus.connect(own_nats_url, "test") as bus,
            running(config) as service,
            redis_client(config) as client,
        ):
            # No snapshot answers: a resync would purge.
            await publish(bus, a.store_prompt(list(range(16))))
            late = a.store_prompt(list(range(100, 116)))
            ahead = a.batch([a.removed(sorted(a.held)[:2]), a.stored(list(range(200, 208)))])
            await publish(bus, ahead)  # as if the replica holding `late` were slow
            await counted(service, "num_gaps", 1, at_least=True)
            await asyncio.sleep(0.3)
            await publish(bus, late)
            await index_equals(client, config.key_prefix, [a])
            assert service.counters.num_batches_applied == 3
            assert service.counters.num_resyncs == service.counters.num_purges == 0

    asyncio.run(main())


def test_an_index_that_lost_its_data_resyncs_the_executors_that_beat(own_nats_url, redis_url):
    async def main() -> None:
        config = index_config(own_nats_url, redis_url, executor_timeout_s=1.0)
        executors = [KVExecutorModel(f"ex-{n}", MODEL) for n in "ab"]
        async with (
            await Bus.connect(own_nats_url, "test") as bus,
            running(config) as service,
            redis_client(config) as client,
        ):

            async def heartbeats() -> None:
                while True:
                    for ex in executors:
                        await publish_heartbeat(bus, ex)
                    await asyncio.sleep(0.2)

            beat_task = asyncio.create_task(heartbeats())
            for ex in executors:
                await answer_snapshots(bus, ex)
                await publish(bus, ex.store_prompt(list(range(24))))
            await index_equals(client, config.key_prefix, executors)
            resyncs = service.counters.num_resyncs
            # Redis loses every key of the index (a restart without persistence, say).
            await client.delete(*await client.keys("{" + config.key_prefix + "}:*"))
            await index_equals(client, config.key_prefix, executors)
            await counted(service, "num_resyncs", resyncs + len(executors), at_least=True)
            # And batches apply after the snapshots as before.
            for ex in executors:
                await publish(bus, ex.store_prompt(list(range(100, 124))))
            await index_equals(client, config.key_prefix, executors)
            beat_task.cancel()

    asyncio.run(main())
