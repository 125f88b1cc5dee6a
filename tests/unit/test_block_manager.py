import random

import pytest

from shared.engine.block_manager import BlockManager
from shared.wire.block_hash import hash_block, hash_prompt_blocks
from shared.wire.kv_events import (
    KV_EVENTS_MESSAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsMessage,
)

BS = 4


def wire_round_trip(batch: KVEventBatch) -> KVEventBatch:
    """``batch`` as the prefix index receives it: inside the executor's KVEventsMessage."""
    message = KVEventsMessage(executor_id="e", epoch="1", model="m", batch=batch)
    return KV_EVENTS_MESSAGE.decode(KV_EVENTS_MESSAGE.encode(message)).batch


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def prefill(bm: BlockManager, seq_id: str, tokens: list[int]) -> int:
    """Allocate the whole uncached prompt and commit it as computed; returns the cached tokens."""
    cached = bm.match_prefix(tokens)
    assert bm.allocate(seq_id, tokens, len(tokens) - cached) == cached
    bm.commit(seq_id, tokens, len(tokens))
    return cached


# ---- allocation order and prefix hits -----------------------------------------------------------


def test_fresh_allocation_order() -> None:
    bm = BlockManager(8, BS)
    assert bm.num_free_blocks == 7 and bm.num_used_blocks == 0 and bm.usage == 0.0
    assert bm.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]
    assert bm.allocate("a", toks(10), 10) == 0
    assert bm.block_table("a") == [1, 2, 3]
    assert bm.allocate("b", toks(5, 100), 5) == 0
    assert bm.block_table("b") == [4, 5]
    assert bm.free_block_ids() == [6, 7]
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.usage) == (2, 5, 5 / 7)
    assert bm.allocate("a", toks(10), 2) == 0  # 12 tokens: still 3 blocks
    assert bm.block_table("a") == [1, 2, 3]
    assert bm.allocate("a", toks(13), 1) == 0
    assert bm.block_table("a") == [1, 2, 3, 6]
    assert bm.num_reserved_tokens("a") == 13
    assert (
        bm.num_blocks_needed(0) == 0
        and bm.num_blocks_needed(4) == 1
        and bm.num_blocks_needed(5) == 2
    )


def test_prefix_hit_reuses_same_block_ids() -> None:
    bm = BlockManager(8, BS)
    prompt = toks(10)
    assert prefill(bm, "a", prompt) == 0
    assert bm.block_table("a") == [1, 2, 3]
    other = prompt[:8] + [77, 78, 79]
    assert bm.match_prefix(other) == 8
    assert bm.allocate("b", other, 3) == 8
    assert bm.block_table("b") == [1, 2, 4]
    assert [bm.ref_count(b) for b in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert bm.prefix_cache_queries_tokens == 10 + 11
    assert bm.prefix_cache_hits_tokens == 8
    assert bm.allocate("b", other, 1) == 0  # later calls return 0


def test_hit_on_free_block_removes_it_from_middle_of_queue() -> None:
    bm = BlockManager(8, BS)
    a = toks(12)
    prefill(bm, "a", a)  # blocks 1,2,3, all hashed
    prefill(bm, "c", toks(4, 500))  # block 4
    bm.free("a")
    bm.free("c")
    assert bm.free_block_ids() == [5, 6, 7, 3, 2, 1, 4]
    assert bm.num_free_blocks == 7
    b = a[:4] + [99]
    assert bm.allocate("b", b, 1) == 4
    assert bm.block_table("b") == [1, 5]
    assert bm.free_block_ids() == [6, 7, 3, 2, 4]
    assert bm.ref_count(1) == 1
    assert bm.block_hash(2) is not None and bm.block_hash(3) is not None  # lazily kept


def test_free_hit_blocks_count_against_availability() -> None:
    bm = BlockManager(4, BS)  # usable: 1, 2, 3
    a = toks(9)
    prefill(bm, "a", a)  # 1, 2 hashed; 3 partial
    bm.free("a")
    assert bm.free_block_ids() == [3, 2, 1]
    b = a[:8] + toks(8, 200)
    assert bm.match_prefix(b) == 8
    # 16 tokens = 4 blocks: hits 1, 2 (free) + 2 new, but only block 3 is left once 1, 2 are taken.
    assert bm.allocate("b", b, 8) is None
    assert "b" not in bm
    assert bm.free_block_ids() == [3, 2, 1]
    assert bm.prefix_cache_queries_tokens == 9 and bm.prefix_cache_hits_tokens == 0
    assert bm.allocate("b", b, 4) == 8
    assert bm.block_table("b") == [1, 2, 3]
    assert bm.num_free_blocks == 0


def test_reallocate_same_id_after_free_hits_own_blocks() -> None:
    bm = BlockManager(8, BS)
    prompt = toks(10)
    prefill(bm, "a", prompt)
    bm.free("a")
    assert bm.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    assert bm.allocate("a", prompt, 2) == 8
    assert bm.block_table("a") == [1, 2, 4]  # 1, 2 revived; 4 is the LRU front
    assert bm.free_block_ids() == [5, 6, 7, 3]


# ---- eviction ------------------------------------------------------------------------------------


def test_lru_eviction_is_tail_first_and_drops_hash() -> None:
    bm = BlockManager(8, BS)
    a = toks(12)
    prefill(bm, "a", a)
    h1, h2, h3 = hash_prompt_blocks(a, BS)
    assert [bm.block_hash(b) for b in (1, 2, 3)] == [h1, h2, h3]
    bm.take_events()
    bm.free("a")
    assert bm.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    assert bm.match_prefix(a + [0]) == 12

    assert bm.allocate("b", toks(20, 300), 20) == 0
    assert bm.block_table("b") == [4, 5, 6, 7, 3]
    assert bm.block_hash(3) is None
    assert bm.cached_block_id(h3) is None
    assert bm.cached_block_id(h2) == 2 and bm.cached_block_id(h1) == 1
    assert bm.match_prefix(a + [0]) == 8
    batch = bm.take_events()
    assert batch is not None and batch.events == [BlockRemoved(block_hashes=[h3])]

    assert bm.allocate("b", toks(24, 300), 4) == 0
    assert bm.block_table("b")[-1] == 2
    assert bm.match_prefix(a + [0]) == 4
    assert bm.allocate("b", toks(28, 300), 4) == 0
    assert bm.match_prefix(a + [0]) == 0
    assert bm.free_block_ids() == []
    batch = bm.take_events()
    assert batch is not None
    assert batch.events == [BlockRemoved(block_hashes=[h2]), BlockRemoved(block_hashes=[h1])]
    assert bm.num_cached_blocks == 0


def test_duplicate_block_stays_unregistered_and_eviction_removes_only_registered() -> None:
    bm = BlockManager(8, BS)
    prompt = toks(9)
    # Both admitted before either computed: two copies of the same content.
    assert bm.allocate("a", prompt, 9) == 0
    assert bm.allocate("b", prompt, 9) == 0
    assert bm.block_table("a") == [1, 2, 3] and bm.block_table("b") == [4, 5, 6]
    bm.commit("a", prompt, 9)
    bm.commit("b", prompt, 9)
    h1, h2 = hash_prompt_blocks(prompt, BS)
    assert bm.block_hash(4) == h1 and bm.block_hash(5) == h2
    assert bm.cached_block_id(h1) == 1 and bm.cached_block_id(h2) == 2
    bm.take_events()
    bm.free("b")
    bm.free("a")
    assert bm.free_block_ids() == [7, 6, 5, 4, 3, 2, 1]
    assert bm.allocate("c", toks(16, 400), 16) == 0
    assert bm.block_table("c") == [7, 6, 5, 4]
    assert bm.take_events() is None  # duplicates evicted: the cache map did not change
    assert bm.match_prefix(prompt) == 8


# ---- fork and copy-on-write ---------------------------------------------------------------------


def test_fork_ref_counts_and_copy_on_write() -> None:
    bm = BlockManager(8, BS)
    prompt = toks(6)
    prefill(bm, "a", prompt)  # block 1 full, block 2 holds 2 tokens
    bm.fork("a", "b")
    assert bm.block_table("b") == [1, 2]
    assert bm.ref_count(1) == 2 and bm.ref_count(2) == 2
    assert bm.num_reserved_tokens("b") == 6

    assert bm.allocate("b", prompt + [50], 1) == 0
    assert bm.block_table("b") == [1, 3]
    assert bm.ref_count(1) == 2 and bm.ref_count(2) == 1 and bm.ref_count(3) == 1

    assert bm.allocate("a", prompt + [60], 1) == 0  # a is the sole owner of 2 now: no copy
    assert bm.block_table("a") == [1, 2]
    assert bm.take_pending_copies() == [(2, 3)]
    assert bm.take_pending_copies() == []

    bm.free("a")
    assert bm.ref_count(1) == 1 and bm.ref_count(2) == 0
    bm.free("b")
    assert bm.num_free_blocks == 7


def test_fork_on_block_boundary_never_copies_full_blocks() -> None:
    bm = BlockManager(8, BS)
    prompt = toks(8)
    prefill(bm, "a", prompt)
    bm.fork("a", "b")
    bm.fork("a", "c")
    assert bm.ref_count(1) == 3 and bm.ref_count(2) == 3
    assert bm.allocate("b", prompt + [1], 1) == 0
    assert bm.allocate("c", prompt + [2], 1) == 0
    assert bm.block_table("b") == [1, 2, 3] and bm.block_table("c") == [1, 2, 4]
    assert bm.take_pending_copies() == []


def test_copy_on_write_needs_a_free_block() -> None:
    bm = BlockManager(3, BS)  # usable: 1, 2
    prompt = toks(6)
    prefill(bm, "a", prompt)
    bm.fork("a", "b")
    assert bm.num_free_blocks == 0
    assert bm.allocate("b", prompt + [9], 1) is None
    assert bm.block_table("b") == [1, 2] and bm.ref_count(2) == 2
    assert bm.num_reserved_tokens("b") == 6
    assert bm.take_pending_copies() == []
    assert bm.allocate("b", prompt + [9], 0) == 0  # nothing written: no copy needed


def test_pending_copy_into_freed_block_is_dropped() -> None:
    bm = BlockManager(8, BS)
    prefill(bm, "a", toks(6))
    bm.fork("a", "b")
    assert bm.allocate("b", toks(7), 1) == 0
    bm.free("b")
    assert bm.take_pending_copies() == []


def test_commit_after_fork_hashes_shared_block_once() -> None:
    bm = BlockManager(8, BS)
    prompt = toks(8)
    assert bm.allocate("a", prompt, 8) == 0
    bm.fork("a", "b")  # forked before the forward committed the prompt
    bm.commit("a", prompt, 8)
    bm.commit("b", prompt, 8)
    h1, h2 = hash_prompt_blocks(prompt, BS)
    assert (bm.block_hash(1), bm.block_hash(2)) == (h1, h2)
    assert bm.num_cached_blocks == 2
    batch = bm.take_events()
    assert batch is not None and len(batch.events) == 2
    assert all(isinstance(e, BlockStored) and e.block_hashes == [h1, h2] for e in batch.events)


# ---- allocation failure --------------------------------------------------------------------------


def test_allocate_returns_none_without_side_effects() -> None:
    bm = BlockManager(4, BS)
    prefill(bm, "a", toks(8))
    assert bm.take_events() is not None
    before = (bm.free_block_ids(), bm.block_table("a"), bm.prefix_cache_queries_tokens)
    assert bm.allocate("b", toks(8, 100), 8) is None
    assert "b" not in bm
    assert bm.allocate("a", toks(16), 8) is None
    assert bm.num_reserved_tokens("a") == 8
    assert (bm.free_block_ids(), bm.block_table("a"), bm.prefix_cache_queries_tokens) == before
    assert bm.take_events() is None
    assert bm.allocate("b", toks(8, 100), 4) == 0
    assert bm.block_table("b") == [3]


def test_request_larger_than_cache_is_refused() -> None:
    bm = BlockManager(4, BS)
    assert bm.allocate("a", toks(13), 13) is None
    assert bm.allocate("a", toks(12), 12) == 0


def test_given_block_hashes_are_used_as_computed() -> None:
    """With the chain given (the engine's way), nothing is hashed and the outcome is the same."""
    prompt = toks(10)
    hashes = hash_prompt_blocks(prompt, BS)
    bm = BlockManager(8, BS)
    assert bm.allocate("a", prompt, 10, hashes) == 0
    bm.commit("a", prompt, 10, hashes)
    assert [bm.block_hash(b) for b in bm.block_table("a")[:2]] == hashes
    other = prompt[:8] + [77, 78, 79, 80]
    other_hashes = hash_prompt_blocks(other, BS)
    assert bm.match_prefix(other, other_hashes) == bm.match_prefix(other) == 8
    assert bm.allocate("b", other, 4, other_hashes) == 8
    with pytest.raises(ValueError, match="block_hashes has 1 hashes; 2 full blocks"):
        bm.match_prefix(other, other_hashes[:1])
    with pytest.raises(ValueError, match="block_hashes has 2 hashes; 3 full blocks"):
        bm.commit("b", other, 12, other_hashes[:2])
    bm.commit("b", other, 12, other_hashes)
    assert bm.cached_block_id(other_hashes[2]) == bm.block_table("b")[2]


# ---- match_prefix --------------------------------------------------------------------------------


def test_match_prefix_never_covers_whole_prompt() -> None:
    bm = BlockManager(8, BS)
    prompt = toks(12)
    prefill(bm, "a", prompt + [12])  # blocks 1, 2, 3 full and cached, 4 partial
    assert bm.num_cached_blocks == 3
    assert bm.match_prefix(prompt) == 8  # exactly 3 full blocks: the last one is recomputed
    assert bm.match_prefix(prompt + [12]) == 12
    assert bm.match_prefix(prompt[:5]) == 4
    assert bm.match_prefix(prompt[:4]) == 0
    assert bm.match_prefix(prompt[:1]) == 0
    assert bm.match_prefix([]) == 0
    assert bm.match_prefix([1] + prompt[1:]) == 0  # first block differs: chain breaks
    assert bm.allocate("b", prompt, 4) == 8
    assert bm.block_table("b") == [1, 2, 5]


# ---- events --------------------------------------------------------------------------------------


def test_events_and_sequence_numbers() -> None:
    bm = BlockManager(6, BS)
    assert bm.take_events() is None
    prompt = toks(10)
    assert bm.allocate("a", prompt, 10) == 0
    bm.commit("a", prompt, 6)  # 1 full block
    bm.commit("a", prompt, 7)  # nothing new
    h1, h2 = hash_prompt_blocks(prompt, BS)
    b1 = bm.take_events()
    assert b1 == KVEventBatch(
        seq=1,
        events=[
            BlockStored(block_hashes=[h1], parent_block_hash=None, token_ids=toks(4), block_size=BS)
        ],
    )
    bm.commit("a", prompt, 10)
    b2 = bm.take_events()
    assert b2 is not None and b2.seq == 2
    assert b2.events == [
        BlockStored(block_hashes=[h2], parent_block_hash=h1, token_ids=toks(4, 4), block_size=BS)
    ]
    assert bm.take_events() is None

    bm.free("a")
    assert bm.reset_prefix_cache() is True
    assert bm.num_cached_blocks == 0 and bm.block_hash(1) is None
    assert bm.match_prefix(prompt) == 0
    b3 = bm.take_events()
    assert b3 == KVEventBatch(seq=3, events=[AllBlocksCleared()])

    assert bm.allocate("x", prompt, 1) == 0
    assert bm.reset_prefix_cache() is False  # blocks in use
    assert bm.take_events() is None

    assert wire_round_trip(b2) == b2
    assert wire_round_trip(b3) == b3


def test_event_token_ids_are_plain_ints() -> None:
    class IntLike(int):
        pass

    bm = BlockManager(4, BS)
    prompt = [IntLike(t) for t in toks(4)]
    assert bm.allocate("a", prompt, 4) == 0
    bm.commit("a", prompt, 4)
    batch = bm.take_events()
    assert batch is not None
    assert wire_round_trip(batch) == batch


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    prompt = toks(10)
    prefill(bm, "a", prompt)
    assert bm.block_hash(1) is None and bm.num_cached_blocks == 0
    bm.free("a")
    assert bm.match_prefix(prompt) == 0
    assert bm.allocate("b", prompt, 10) == 0
    assert bm.block_table("b") == [4, 5, 6]
    assert bm.take_events() is None
    assert bm.prefix_cache_queries_tokens == 0 and bm.prefix_cache_hits_tokens == 0
    bm.free("b")
    assert bm.reset_prefix_cache() is True and bm.take_events() is None


# ---- errors --------------------------------------------------------------------------------------


def test_errors() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(1, BS)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(8, 0)
    bm = BlockManager(8, BS)
    for call in (
        lambda: bm.commit("nope", [1], 1),
        lambda: bm.free("nope"),
        lambda: bm.fork("nope", "child"),
        lambda: bm.block_table("nope"),
    ):
        with pytest.raises(KeyError, match="unknown sequence"):
            call()
    assert bm.allocate("a", toks(5), 5) == 0
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate("a", toks(5), -1)
    with pytest.raises(ValueError, match="reserved"):
        bm.commit("a", toks(6), 6)
    with pytest.raises(ValueError, match="token_ids"):
        bm.commit("a", toks(3), 4)
    bm.fork("a", "b")
    with pytest.raises(ValueError, match="already exists"):
        bm.fork("a", "b")
    bm.free("a")
    with pytest.raises(KeyError, match="already freed"):
        bm.free("a")
    with pytest.raises(KeyError):
        bm.commit("a", toks(5), 5)


# ---- randomized workload against a model of the KV contents --------------------------------------


class _Sim:
    """Drives a BlockManager like an executor and keeps a fake KV cache: kv[block][slot] = token.

    Every step checks that each sequence's computed positions still read back its own tokens
    (no write into a shared block, no eviction of a live block, cached prefixes really cached), and
    that the prefix index rebuilt from the events equals the manager's cache map.
    """

    def __init__(self, rng: random.Random, num_blocks: int, block_size: int) -> None:
        self.rng = rng
        self.bm = BlockManager(num_blocks, block_size)
        self.bs = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tokens: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}
        self.index: set[int] = set()
        self.last_event_seq = 0
        self.next_id = 0
        self.system_prompts = [
            [rng.randrange(1000) for _ in range(rng.randrange(1, 20))] for _ in range(3)
        ]
        self.hits = 0

    def slot(self, seq_id: int, pos: int) -> tuple[int, int]:
        table = self.bm.block_table(seq_id)
        return table[pos // self.bs], pos % self.bs

    def apply_copies(self) -> None:
        for src, dst in self.bm.take_pending_copies():
            assert self.bm.ref_count(dst) == 1
            self.kv[dst] = list(self.kv[src])

    def apply_events(self) -> None:
        batch = self.bm.take_events()
        if batch is None:
            return
        assert batch.seq == self.last_event_seq + 1
        self.last_event_seq = batch.seq
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    block_tokens = event.token_ids[i * self.bs : (i + 1) * self.bs]
                    assert hash_block(parent, block_tokens) == h
                    self.index.add(h)
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self.index.remove(h)
            else:
                self.index.clear()

    def new_seq(self) -> None:
        prompt = list(self.rng.choice(self.system_prompts)) + [
            self.rng.randrange(1000) for _ in range(self.rng.randrange(1, 12))
        ]
        seq_id, self.next_id = self.next_id, self.next_id + 1
        cached = self.bm.match_prefix(prompt)
        num_new = min(len(prompt) - cached, self.rng.randrange(1, 10))
        got = self.bm.allocate(seq_id, prompt, num_new)
        if got is None:
            return
        assert got == cached
        self.hits += cached
        self.tokens[seq_id], self.num_computed[seq_id] = prompt, cached
        self.forward(seq_id, num_new)

    def step(self, seq_id: int) -> None:
        tokens, done = self.tokens[seq_id], self.num_computed[seq_id]
        num_new = min(len(tokens) - done, self.rng.randrange(1, 10))
        if self.bm.allocate(seq_id, tokens, num_new) is None:
            self.finish(seq_id)  # preempt
            return
        self.forward(seq_id, num_new)

    def forward(self, seq_id: int, num_new: int) -> None:
        self.apply_copies()
        tokens, start = self.tokens[seq_id], self.num_computed[seq_id]
        for pos in range(start, start + num_new):
            block_id, offset = self.slot(seq_id, pos)
            assert block_id != 0
            assert self.bm.ref_count(block_id) == 1, "write into a shared block"
            assert self.bm.block_hash(block_id) is None, "write into an immutable hashed block"
            self.kv[block_id][offset] = tokens[pos]
        self.num_computed[seq_id] = start + num_new
        self.bm.commit(seq_id, tokens, start + num_new)
        if self.num_computed[seq_id] == len(tokens):
            tokens.append(self.rng.randrange(1000))  # sampled token: computed by the next step

    def fork(self, parent: int) -> None:
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.num_computed[child] = self.num_computed[parent]
        self.tokens[child][-1] = self.rng.randrange(1000)  # siblings sample different tokens

    def finish(self, seq_id: int) -> None:
        self.bm.free(seq_id)
        del self.tokens[seq_id], self.num_computed[seq_id]

    def check(self) -> None:
        bm = self.bm
        owners: dict[int, int] = {}
        for seq_id, tokens in self.tokens.items():
            table = bm.block_table(seq_id)
            assert len(table) == bm.num_blocks_needed(bm.num_reserved_tokens(seq_id))
            for block_id in table:
                owners[block_id] = owners.get(block_id, 0) + 1
            for pos in range(self.num_computed[seq_id]):
                block_id, offset = self.slot(seq_id, pos)
                assert self.kv[block_id][offset] == tokens[pos], (seq_id, pos)
        free = bm.free_block_ids()
        assert len(free) == len(set(free)) == bm.num_free_blocks
        assert 0 not in free and 0 not in owners
        assert set(free).isdisjoint(owners)
        assert len(free) + len(owners) == bm.num_blocks - 1
        for block_id in range(1, bm.num_blocks):
            assert bm.ref_count(block_id) == owners.get(block_id, 0)
        self.apply_events()
        assert len(self.index) == bm.num_cached_blocks
        for h in self.index:
            cached = bm.cached_block_id(h)
            assert cached is not None and bm.block_hash(cached) == h


@pytest.mark.parametrize("seed", range(12))
def test_randomized_workload_no_leak(seed: int) -> None:
    rng = random.Random(seed)
    sim = _Sim(rng, num_blocks=rng.choice([12, 24, 48]), block_size=rng.choice([1, 2, 4]))
    for _ in range(400):
        live = list(sim.tokens)
        op = rng.random()
        if op < 0.3 or not live:
            sim.new_seq()
        elif op < 0.75:
            sim.step(rng.choice(live))
        elif op < 0.85:
            sim.fork(rng.choice(live))
        else:
            sim.finish(rng.choice(live))
        sim.check()
    for seq_id in list(sim.tokens):
        sim.finish(seq_id)
    sim.check()
    assert sim.bm.num_free_blocks == sim.bm.num_blocks - 1
    assert sim.bm.num_used_blocks == 0 and sim.bm.usage == 0.0
    assert sim.hits > 0
    assert sim.bm.reset_prefix_cache()
    sim.check()
    assert sim.index == set()
