"""Huge pages for packed weights and the KV pool: the memory is advised, the data is unchanged, and
the memory accounting stays exact."""

from __future__ import annotations

import sys

import pytest
import torch

from helpers.levels import best_ops
from shared.engine import huge_pages

linux = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux-only"
)


@linux
def test_zeros_advises_whole_pages_of_a_large_tensor():
    t = huge_pages.zeros((8, 1 << 20), torch.float32)  # 32 MiB
    assert torch.count_nonzero(t) == 0
    advised = huge_pages.advise(t)
    nbytes = t.numel() * 4
    assert nbytes - 2 * 4096 < advised <= nbytes and advised % 4096 == 0
    assert huge_pages.advise(torch.empty(1000)) == 0  # under one huge page: nothing to gain


def test_relocate_copies_into_one_aligned_buffer():
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=g),
        torch.randint(-128, 127, (7, 9), generator=g, dtype=torch.int8),
        torch.randn(4, 48, generator=g).bfloat16(),
    ]
    moved = huge_pages.relocate(tensors)
    for a, b in zip(tensors, moved, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
        assert b.data_ptr() % 64 == 0 and b.data_ptr() != a.data_ptr()
    storages = {t.untyped_storage().data_ptr() for t in moved}
    assert len(storages) == 1
    # 60 bytes at 0, 63 at 64, 384 at 128: 512 in all.
    assert moved[0].untyped_storage().nbytes() == 128 + 384
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        huge_pages.relocate([torch.randn(4, 4).T])


def test_model_weights_live_in_one_buffer_and_are_counted_once(runtime_bf16):
    """After loading, every kernel-layout weight shares one storage, and the ledger's weight bytes
    are the parameters plus exactly that buffer."""
    from shared.engine.models.packed_linear import PackedLinear

    best_ops()
    packed = [
        m.packed
        for m in runtime_bf16.modules()
        if isinstance(m, PackedLinear) and m.ops is not None
    ]
    storages = {t.untyped_storage().data_ptr() for t in packed}
    assert len(storages) == 1
    arena = packed[0].untyped_storage().nbytes()
    assert arena >= sum(t.numel() * t.element_size() for t in packed)
    params = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
        for p in runtime_bf16.parameters()
    }
    assert runtime_bf16.weight_bytes() == sum(params.values()) + arena
