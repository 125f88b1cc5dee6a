"""KV cache events: what an executor's block manager tells the prefix index.

Applying a stream of batches in `seq` order reproduces the executor's set of cached block hashes:
every hash in a BlockStored is in the executor's cache map when the event is recorded, and a
BlockRemoved is recorded exactly when a hash leaves that map. BlockStored may repeat a hash the
index already holds, so applying it must be idempotent (set insert).
"""

from __future__ import annotations

import time
import uuid

import msgspec

from shared.wire.codec import Codec

__all__ = [
    "KV_CACHE_SNAPSHOT",
    "KV_EVENTS_MESSAGE",
    "KV_SNAPSHOT_REQUEST",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheSnapshot",
    "KVEvent",
    "KVEventBatch",
    "KVEventsMessage",
    "KVSnapshotRequest",
    "new_epoch",
]


class BlockStored(msgspec.Struct, kw_only=True, frozen=True, tag=True):
    """A chain of full blocks became cached.

    block_hashes[0]'s parent is parent_block_hash (None: the chain starts a prompt), and each later
    hash's parent is the one before it. token_ids are the blocks' tokens concatenated:
    len(token_ids) == len(block_hashes) * block_size.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int


class BlockRemoved(msgspec.Struct, kw_only=True, frozen=True, tag=True):
    """These hashes were evicted: the executor no longer holds them."""

    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, kw_only=True, frozen=True, tag=True):
    """The executor dropped every cached hash."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, kw_only=True, frozen=True):
    """Events of one executor in the order they happened.

    seq increases by exactly 1 per batch of one executor (first batch: 1), so a consumer that sees a
    gap knows it missed a batch and must resync.
    """

    seq: int
    events: list[KVEvent]


class KVEventsMessage(msgspec.Struct, kw_only=True, frozen=True):
    """Executor → prefix index: one engine step's batch, named by who sent it. ``epoch`` is the
    executor process's (see new_epoch); ``model`` is the served model name the blocks belong to."""

    executor_id: str
    epoch: str
    model: str
    batch: KVEventBatch


class KVSnapshotRequest(msgspec.Struct, kw_only=True, frozen=True):
    pass


class KVCacheSnapshot(msgspec.Struct, kw_only=True, frozen=True):
    """An executor's whole set of cached block hashes, taken between engine steps.

    It includes the effects of every batch up to and including ``seq`` and of none after it, so an
    index that installs it applies batches with seq > ``seq`` next and drops the others as
    replays."""

    executor_id: str
    epoch: str
    model: str
    seq: int
    block_hashes: list[int]


def new_epoch() -> str:
    """A fresh epoch for a process start: the start time in ns, zero-padded, then a random suffix,
    so a later start's epoch sorts after an earlier one's (string order) and two starts in the same
    nanosecond still differ."""
    return f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"


KV_EVENTS_MESSAGE = Codec[KVEventsMessage](KVEventsMessage)
KV_SNAPSHOT_REQUEST = Codec[KVSnapshotRequest](KVSnapshotRequest)
KV_CACHE_SNAPSHOT = Codec[KVCacheSnapshot](KVCacheSnapshot)
