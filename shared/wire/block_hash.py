"""Chained KV block hashes, identical in every process and every run.

hash(block i) = H(hash(block i-1), tokens of block i), so equal hashes mean equal whole prefixes,
and a prefix index can find a prompt's cached prefix as the leading run of known hashes.

Byte layout fed to keyed BLAKE2b (8-byte digest):

    [1 byte: 0 = no parent, 1 = parent][8 bytes: parent hash, little-endian]
        [4 bytes per token: uint32 LE]

The result is the digest read little-endian and masked to 63 bits: non-negative and within a signed
int64, so it survives msgspec, Redis, numpy/torch int64 and SQL BIGINT unchanged. Changing the key,
the layout or the mask changes every hash: bump _HASH_KEY's version so old and new never mix.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["hash_block", "hash_prompt_blocks"]

_HASH_KEY = b"llmserve.kv-block-hash.v1"
_MASK_63 = (1 << 63) - 1
_NO_PARENT = b"\x00" + bytes(8)
_MAX_PARENT = 1 << 64


def _parent_bytes(parent_hash: int | None) -> bytes:
    if parent_hash is None:
        return _NO_PARENT
    if not 0 <= parent_hash < _MAX_PARENT:
        raise ValueError(f"parent_hash must be in [0, 2**64), got {parent_hash}")
    return b"\x01" + parent_hash.to_bytes(8, "little")


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None


def _digest(parent: bytes, packed_tokens: bytes | memoryview) -> int:
    h = hashlib.blake2b(parent, digest_size=8, key=_HASH_KEY)
    h.update(packed_tokens)
    return int.from_bytes(h.digest(), "little") & _MASK_63


def hash_block(parent_hash: int | None, block_token_ids: Sequence[int]) -> int:
    """Hash of one block given the hash of the block before it (None for a prompt's first block)."""
    return _digest(_parent_bytes(parent_hash), _pack_tokens(block_token_ids))


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every FULL block of token_ids; a trailing partial block is not hashed."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_full_blocks = len(token_ids) // block_size
    packed = memoryview(_pack_tokens(token_ids[: num_full_blocks * block_size]))
    stride = 4 * block_size
    hashes: list[int] = []
    parent = _NO_PARENT
    for i in range(num_full_blocks):
        block_hash = _digest(parent, packed[i * stride : (i + 1) * stride])
        hashes.append(block_hash)
        parent = b"\x01" + block_hash.to_bytes(8, "little")
    return hashes
