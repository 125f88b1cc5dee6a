import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.wire.block_hash import hash_block, hash_prompt_blocks

# Pinned: a change here invalidates every hash published to the prefix index (bump the key version).
KNOWN_HASH = 1261512939271970269  # hash_block(None, range(16))

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_known_value() -> None:
    assert hash_block(None, list(range(16))) == KNOWN_HASH


def test_stable_across_processes() -> None:
    code = (
        "from shared.wire.block_hash import hash_block, hash_prompt_blocks;"
        "print(hash_block(None, list(range(16))));"
        "print(hash_prompt_blocks(list(range(100)), 16))"
    )
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1]
    assert outputs[0].splitlines()[0] == str(KNOWN_HASH)
    assert outputs[0].splitlines()[1] == str(hash_prompt_blocks(list(range(100)), 16))


def test_range_and_input_types() -> None:
    h = hash_block(None, [5, 6, 7, 8])
    assert 0 <= h < 2**63
    assert hash_block(None, (5, 6, 7, 8)) == h
    assert hash_block(h, [1]) == hash_block(h, (1,))


def test_chaining() -> None:
    tokens = [1, 2, 3, 4]
    root = hash_block(None, tokens)
    assert hash_block(root, tokens) != root
    assert hash_block(root, tokens) != hash_block(root + 1, tokens)
    assert hash_block(0, tokens) != root  # parent 0 is not "no parent"
    assert hash_block(None, [1, 2, 3]) != hash_block(None, [1, 2, 3, 0])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])


def test_prompt_blocks_are_chained_full_blocks_only() -> None:
    tokens = list(range(1000, 1038))
    hashes = hash_prompt_blocks(tokens, 16)
    assert len(hashes) == 2  # 38 tokens: 2 full blocks, the 6-token tail is not hashed
    first = hash_block(None, tokens[:16])
    assert hashes == [first, hash_block(first, tokens[16:32])]
    assert hash_prompt_blocks(tokens[:15], 16) == []
    assert hash_prompt_blocks([], 16) == []
    assert hash_prompt_blocks(tokens[:32], 16) == hashes


def test_same_block_different_prefix_differs() -> None:
    a = hash_prompt_blocks([1] * 4 + [9] * 4, 4)
    b = hash_prompt_blocks([2] * 4 + [9] * 4, 4)
    assert a[1] != b[1]


def test_long_prompt_matches_incremental() -> None:
    tokens = [(i * 7919) % 128_000 for i in range(8192)]
    hashes = hash_prompt_blocks(tokens, 16)
    assert len(hashes) == 512
    parent = None
    for i in (0, 1, 2):
        parent = hash_block(parent, tokens[i * 16 : (i + 1) * 16])
        assert hashes[i] == parent
    assert len(set(hashes)) == 512


def test_invalid_input() -> None:
    with pytest.raises(ValueError):
        hash_block(None, [-1])
    with pytest.raises(ValueError):
        hash_block(None, [2**32])
    with pytest.raises(ValueError):
        hash_block(-5, [1])
    with pytest.raises(ValueError):
        hash_prompt_blocks([1, 2], 0)
