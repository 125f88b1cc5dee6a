"""Paged KV block manager with prefix caching (pure logic: no torch, no asyncio).

Invariants:
- Block 0 is padding: never handed out, never in the free queue, never hashed.
- A block is in the free queue  <=>  its ref_count == 0 (and it is not block 0).
- ref_count(b) == number of live sequences whose block table holds b.
- A block with a hash is full and immutable: only full blocks are hashed, writes go only to a
  sequence's own (ref_count == 1) unhashed tail block; a shared partly filled block is copied first.
- Cache map: hash -> the one registered block with that content. A block may carry a hash without
  being registered (a duplicate computed by another sequence); evicting it removes nothing.
- Lazy eviction: a freed block keeps its hash and stays findable until popped for reuse.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

from shared.wire.block_hash import hash_block
from shared.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

__all__ = ["BlockManager"]


@dataclass(slots=True, eq=False)
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    prev_free: _Block | None = None
    next_free: _Block | None = None


class _FreeBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

        popleft (evict, LRU)                                       append (just freed, MRU)
              v                                                          v
        [sentinel] <-> b3 <-> b7 <-> b2 <-> ... <-> b5 <-> [sentinel]   (circular)

    remove(b) unlinks a block from anywhere in O(1): a prefix hit on a free block revives it.
    """

    def __init__(self, blocks: Sequence[_Block]) -> None:
        self._sentinel = _Block(-1)
        self._sentinel.prev_free = self._sentinel.next_free = self._sentinel
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[_Block]:
        node = self._sentinel.next_free
        while node is not self._sentinel:
            assert node is not None
            yield node
            node = node.next_free

    def append(self, block: _Block) -> None:
        last = self._sentinel.prev_free
        assert last is not None and block.prev_free is None and block.next_free is None
        block.prev_free, block.next_free = last, self._sentinel
        last.next_free = self._sentinel.prev_free = block
        self._len += 1

    def remove(self, block: _Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> _Block:
        first = self._sentinel.next_free
        if first is self._sentinel or first is None:
            raise IndexError("no free blocks")
        self.remove(first)
        return first


@dataclass(slots=True)
class _SeqState:
    block_ids: list[int]
    # Token slots the block table holds: positions [0, num_reserved_tokens) have a slot.
    num_reserved_tokens: int
    # block_ids[:num_hashed_blocks] carry their chained hash.
    num_hashed_blocks: int = 0


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is padding), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free = _FreeBlockQueue(self._blocks[1:])
        self._cached: dict[int, int] = {}
        self._seqs: dict[Hashable, _SeqState] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._events: list[KVEvent] = []
        self._next_event_seq = 1
        self._prefix_cache_queries_tokens = 0
        self._prefix_cache_hits_tokens = 0

    # ---- sizes and counters -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take, cached-but-free (evictable) ones included."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / (self.num_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def prefix_cache_queries_tokens(self) -> int:
        return self._prefix_cache_queries_tokens

    @property
    def prefix_cache_hits_tokens(self) -> int:
        return self._prefix_cache_hits_tokens

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- introspection ------------------------------------------------------------------------

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._seq(seq_id).block_ids)

    def num_reserved_tokens(self, seq_id: Hashable) -> int:
        return self._seq(seq_id).num_reserved_tokens

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def block_hash(self, block_id: int) -> int | None:
        return self._blocks[block_id].block_hash

    def cached_block_id(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def free_block_ids(self) -> list[int]:
        """Free queue from next-to-evict to last-to-evict; O(num_free_blocks), for tests and
        debugging."""
        return [block.block_id for block in self._free]

    # ---- prefix cache -------------------------------------------------------------------------

    def match_prefix(
        self, token_ids: Sequence[int], block_hashes: Sequence[int] | None = None
    ) -> int:
        """Leading tokens already cached (a multiple of block_size, < len(token_ids)). Read-only.

        block_hashes: the chained hashes of token_ids' leading full blocks (the engine keeps them
        per sequence, so nothing is hashed here); None hashes the blocks from token_ids."""
        return len(self._find_cached_blocks(token_ids, block_hashes)) * self.block_size

    def _find_cached_blocks(
        self, token_ids: Sequence[int], block_hashes: Sequence[int] | None
    ) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        # The last token is always recomputed: its forward pass yields the next-token logits.
        max_blocks = max(len(token_ids) - 1, 0) // bs
        if block_hashes is not None:
            _check_hashes(block_hashes, max_blocks, len(token_ids))
        hits: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            parent = _block_hash(i, parent, token_ids, block_hashes, bs)
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; only allowed while no block is in use. Returns whether it happened."""
        if self.num_used_blocks:
            return False
        if self.enable_prefix_caching:
            for block in self._blocks:
                block.block_hash = None
            self._cached.clear()
            self._events.append(AllBlocksCleared())
        return True

    # ---- sequence lifecycle -------------------------------------------------------------------

    def allocate(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        num_new_tokens: int,
        block_hashes: Sequence[int] | None = None,
    ) -> int | None:
        """Reserve slots for num_new_tokens more tokens; None (and no change) if blocks are short.

        First call for seq_id: the cached prefix is taken first and its length returned; the caller
        skips those tokens and num_new_tokens counts the tokens after them (size it with
        match_prefix). Later calls return 0. token_ids and block_hashes (as in match_prefix) are
        read only on the first call.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        seq = self._seqs.get(seq_id)
        if seq is None:
            return self._allocate_first(seq_id, token_ids, num_new_tokens, block_hashes)
        return 0 if self._grow(seq, num_new_tokens) else None

    def _allocate_first(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        num_new_tokens: int,
        block_hashes: Sequence[int] | None,
    ) -> int | None:
        hits = self._find_cached_blocks(token_ids, block_hashes)
        num_cached_tokens = len(hits) * self.block_size
        num_tokens = num_cached_tokens + num_new_tokens
        num_new_blocks = self.num_blocks_needed(num_tokens) - len(hits)
        # Free hit blocks leave the free queue, so they cannot also serve as new blocks.
        num_free_hits = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        if num_new_blocks > len(self._free) - num_free_hits:
            return None
        for block_id in hits:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                self._free.remove(block)
            block.ref_count += 1
        new_blocks = self._pop_free_blocks(num_new_blocks)
        self._seqs[seq_id] = _SeqState(hits + new_blocks, num_tokens, len(hits))
        if self.enable_prefix_caching:
            self._prefix_cache_queries_tokens += len(token_ids)
            self._prefix_cache_hits_tokens += num_cached_tokens
        return num_cached_tokens

    def can_grow(self, seq_id: Hashable, num_new_tokens: int) -> bool:
        """Whether ``allocate(seq_id, ..., num_new_tokens)`` would succeed now (the sequence holds
        blocks already)."""
        seq = self._seq(seq_id)
        return sum(self._blocks_to_grow(seq, num_new_tokens)) <= len(self._free)

    def _blocks_to_grow(self, seq: _SeqState, num_new_tokens: int) -> tuple[int, int]:
        """(new blocks, copy-on-write copies: 0 or 1) that reserving num_new_tokens more takes."""
        num_tokens = seq.num_reserved_tokens + num_new_tokens
        num_new_blocks = self.num_blocks_needed(num_tokens) - len(seq.block_ids)
        # Copy-on-write: the next token lands in a partly filled block shared with a fork sibling.
        cow = (
            num_new_tokens > 0
            and seq.num_reserved_tokens % self.block_size != 0
            and self._blocks[seq.block_ids[-1]].ref_count > 1
        )
        return max(0, num_new_blocks), int(cow)

    def _grow(self, seq: _SeqState, num_new_tokens: int) -> bool:
        num_tokens = seq.num_reserved_tokens + num_new_tokens
        num_new_blocks, cow = self._blocks_to_grow(seq, num_new_tokens)
        if num_new_blocks + cow > len(self._free):
            return False
        new_blocks = self._pop_free_blocks(num_new_blocks + cow)
        if cow:
            src, dst = seq.block_ids[-1], new_blocks.pop(0)
            self._blocks[src].ref_count -= 1  # was > 1: stays live for the sibling
            seq.block_ids[-1] = dst
            self._pending_copies.append((src, dst))
        seq.block_ids.extend(new_blocks)
        seq.num_reserved_tokens = num_tokens
        return True

    def release_tail(self, seq_id: Hashable, num_tokens: int) -> None:
        """Shrink the sequence's reservation to its first ``num_tokens`` slots, freeing the blocks
        past them (speculative slots whose proposals were rejected). Those blocks hold no cached
        prefix: only blocks full of computed tokens are committed, and these were never full of
        verified ones."""
        seq = self._seq(seq_id)
        if not 0 <= num_tokens <= seq.num_reserved_tokens:
            raise ValueError(
                f"cannot shrink sequence {seq_id!r} from {seq.num_reserved_tokens} reserved "
                f"tokens to {num_tokens}"
            )
        keep = self.num_blocks_needed(num_tokens)
        if keep < seq.num_hashed_blocks:
            raise ValueError(f"sequence {seq_id!r} would release blocks it committed")
        for block_id in reversed(seq.block_ids[keep:]):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free.append(block)
        del seq.block_ids[keep:]
        seq.num_reserved_tokens = num_tokens

    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable) -> None:
        """Child shares every block of the parent (ref++); a shared partial block is copied on
        write."""
        parent = self._seq(parent_seq_id)
        if child_seq_id in self._seqs:
            raise ValueError(f"sequence {child_seq_id!r} already exists")
        for block_id in parent.block_ids:
            self._blocks[block_id].ref_count += 1
        self._seqs[child_seq_id] = _SeqState(
            list(parent.block_ids), parent.num_reserved_tokens, parent.num_hashed_blocks
        )

    def rename(self, seq_id: Hashable, new_seq_id: Hashable) -> None:
        """Hand a sequence's blocks to another id unchanged (ref counts, hashes, reservation): a KV
        transfer holds a finished prefill's blocks under its own id, and gives them back to a
        sequence when the request is decoded here after all (shared/engine/kv_transfer.py)."""
        if new_seq_id in self._seqs:
            raise ValueError(f"sequence {new_seq_id!r} already exists")
        self._seqs[new_seq_id] = self._seqs.pop(seq_id)

    def commit(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        block_hashes: Sequence[int] | None = None,
    ) -> None:
        """Hash and cache every block now completely filled with computed tokens. block_hashes: as
        in match_prefix, covering at least the computed full blocks; None hashes them here."""
        seq = self._seq(seq_id)
        if not 0 <= num_computed_tokens <= seq.num_reserved_tokens:
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} outside the {seq.num_reserved_tokens} "
                f"reserved tokens of sequence {seq_id!r}"
            )
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        start, end = seq.num_hashed_blocks, num_computed_tokens // bs
        if end <= start:
            return
        if len(token_ids) < end * bs:
            raise ValueError(
                f"token_ids has {len(token_ids)} tokens, {num_computed_tokens} were computed"
            )
        if block_hashes is not None:
            _check_hashes(block_hashes, end, len(token_ids))
        first_parent = self._blocks[seq.block_ids[start - 1]].block_hash if start else None
        parent = first_parent
        hashes: list[int] = []
        for i in range(start, end):
            block = self._blocks[seq.block_ids[i]]
            if block.block_hash is None:  # a fork sibling may have hashed this shared block already
                block.block_hash = _block_hash(i, parent, token_ids, block_hashes, bs)
            # An identical registered block wins; this one then stays an unregistered duplicate.
            self._cached.setdefault(block.block_hash, block.block_id)
            hashes.append(block.block_hash)
            parent = block.block_hash
        seq.num_hashed_blocks = end
        self._events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=first_parent,
                token_ids=[int(t) for t in token_ids[start * bs : end * bs]],
                block_size=bs,
            )
        )

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's blocks tail first, so a prompt's tail is evicted before its
        head."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r} (never allocated or already freed)")
        for block_id in reversed(seq.block_ids):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free.append(block)
        if self._pending_copies:  # a copy into a block that just went free is moot
            self._pending_copies = [
                (src, dst) for src, dst in self._pending_copies if self._blocks[dst].ref_count > 0
            ]

    # ---- drains for the model runner and the event publisher ----------------------------------

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src_block_id, dst_block_id) KV copies to run before the next forward pass."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    @property
    def num_pending_events(self) -> int:
        """Events recorded since the last take_events (the engine takes them every step)."""
        return len(self._events)

    def snapshot(self) -> tuple[int, list[int]]:
        """(seq, every cached hash): the hashes include the effects of every batch up to ``seq``,
        the one the events not yet taken will get (if any), and of none after it."""
        seq = self._next_event_seq if self._events else self._next_event_seq - 1
        return seq, list(self._cached)

    def take_events(self) -> KVEventBatch | None:
        if not self._events:
            return None
        batch = KVEventBatch(seq=self._next_event_seq, events=self._events)
        self._events = []
        self._next_event_seq += 1
        return batch

    # ---- internals ----------------------------------------------------------------------------

    def _seq(self, seq_id: Hashable) -> _SeqState:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r} (never allocated or already freed)")
        return seq

    def _pop_free_blocks(self, n: int) -> list[int]:
        """Take n blocks from the LRU end; evicting a registered hash records one BlockRemoved."""
        block_ids: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            block = self._free.popleft()
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) == block.block_id:
                    del self._cached[block.block_hash]
                    evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_count = 1
            block_ids.append(block.block_id)
        if evicted:
            self._events.append(BlockRemoved(block_hashes=evicted))
        return block_ids


def _block_hash(
    i: int,
    parent: int | None,
    token_ids: Sequence[int],
    block_hashes: Sequence[int] | None,
    block_size: int,
) -> int:
    """Block i's chained hash: the carried one when given, else hashed from its tokens and its
    parent."""
    if block_hashes is not None:
        return block_hashes[i]
    return hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])


def _check_hashes(block_hashes: Sequence[int], num_needed: int, num_tokens: int) -> None:
    if len(block_hashes) < num_needed:
        raise ValueError(
            f"block_hashes has {len(block_hashes)} hashes; {num_needed} full blocks of the "
            f"{num_tokens} tokens need one each"
        )
