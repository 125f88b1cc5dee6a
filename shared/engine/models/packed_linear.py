"""CPU fast path for reduced-precision linears: each weight packed once, in the layout its matmul reads.

- With the CPU kernels on an AVX512-BF16 host (bf16 weights, even ``in_features``): panels of 48
  output columns of bf16 pairs (``llmserve_cpu::pack_linear_bf16``), read by ``linear_bf16`` at every
  batch size. Decode streams the weight at the DRAM bandwidth and prefill runs level with oneDNN
  (figures in ``kernels/cpu/csrc/ops.cpp``).
- Otherwise oneDNN's blocked layout. A plain ``F.linear`` on a bf16 CPU weight re-lays the weight out
  on every call; for single-token decode that copy cost as much as the matmul itself.

Either way a layer holds one copy of its weight; ``row_major()`` recovers the original exactly.
"""

from __future__ import annotations

import torch
from torch import nn


def can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """Drop-in for ``nn.Linear`` in inference. ``ops``: the CPU kernel namespace, or None; the kernels'
    layout is used when their bf16 linear runs here (AVX512-BF16) and fits the weight, else oneDNN's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops=None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().clone()
        self._pack(weight.detach().contiguous(), ops)

    def _usable(self, ops, dtype: torch.dtype):
        """``ops`` if its bf16 linear can take this weight here, else None."""
        fits = ops is not None and dtype == torch.bfloat16 and self.in_features % 2 == 0
        return ops if fits else None

    def _pack(self, weight: torch.Tensor, ops) -> None:
        self.ops = self._usable(ops, weight.dtype)
        if self.ops is not None:
            self.packed = self.ops.pack_linear_bf16(weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    def use_cpu_kernels(self, ops) -> None:
        """Re-lay the weight out for the kernels' bf16 linear (``ops``, where it can run) or for oneDNN."""
        weight = self.row_major()
        if (self._usable(ops, weight.dtype) is None) != (self.ops is None):
            self._pack(weight, ops)

    def row_major(self) -> torch.Tensor:
        """The [out_features, in_features] weight, bit for bit."""
        if self.ops is None:
            return self.packed.to_dense()
        panels, pairs, width = self.packed.shape  # int32 pairs: low half = even input feature
        pairs_bf16 = self.packed.view(torch.bfloat16).view(panels, pairs, width, 2)
        return pairs_bf16.permute(0, 2, 1, 3).reshape(panels * width, 2 * pairs)[: self.out_features].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(x.reshape(-1, self.in_features).contiguous()).view(*x.shape[:-1], self.out_features)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` for x [rows, in_features], contiguous: no reshaping on the way."""
        if self.ops is not None:
            return self.ops.linear_bf16(x, self.packed, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds (for memory accounting)."""
        return [t for t in (self.packed, self.bias) if t is not None]


def prepack_linears(module: nn.Module, ops=None) -> int:
    """Replace every eligible ``nn.Linear`` under ``module`` by a ``PackedLinear``; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and can_prepack(child.weight):
            setattr(module, name, PackedLinear(child.weight, child.bias, ops))
            count += 1
        else:
            count += prepack_linears(child, ops)
    return count
