"""CPU fast path for reduced-precision linears: each weight held once, in the layout its matmul
reads.

- With the CPU kernels (bf16 weights, even ``in_features``): panels of bf16 pairs
  (``pack_linear_bf16``), read by ``linear_bf16`` at every batch size, at every kernel level.
- Otherwise oneDNN's blocked layout, where oneDNN runs this dtype on this CPU (``kernels.cpu.isa.
  onednn_usable``): a plain ``F.linear`` on a bf16 CPU weight re-lays the weight out on every call.
- Otherwise the weight as it is, through ``F.linear`` (torch's own reduced-precision matmul).

Whatever the layout, ``row_major()`` recovers the original exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import isa

KERNELS, ONEDNN, DENSE = "kernels", "onednn", "dense"


def _kernels_fit(ops, dtype: torch.dtype, in_features: int) -> bool:
    return ops is not None and dtype == torch.bfloat16 and in_features % 2 == 0


def can_prepack(weight: torch.Tensor, ops=None) -> bool:
    """Whether a packed layout (the kernels' or oneDNN's) serves this weight better than
    ``nn.Linear``."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float16)
        and (_kernels_fit(ops, weight.dtype, weight.shape[1]) or isa.onednn_usable(weight.dtype))
    )


class PackedLinear(nn.Module):
    """Drop-in for ``nn.Linear`` in inference. ``ops``: the CPU kernel namespace, or None; the
    kernels' layout is used when it fits the weight, else oneDNN's where it runs, else the dense
    weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops=None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().clone()
        self._pack(weight.detach().contiguous(), ops)

    def _layout(self, ops, dtype: torch.dtype) -> str:
        if _kernels_fit(ops, dtype, self.in_features):
            return KERNELS
        return ONEDNN if isa.onednn_usable(dtype) else DENSE

    def _pack(self, weight: torch.Tensor, ops) -> None:
        self.layout = self._layout(ops, weight.dtype)
        self.ops = ops if self.layout == KERNELS else None
        if self.layout == KERNELS:
            self.packed = ops.pack_linear_bf16(weight)
        elif self.layout == ONEDNN:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        else:
            self.packed = weight

    def use_cpu_kernels(self, ops) -> None:
        """Re-lay the weight out for the kernels' bf16 linear (``ops``, where it fits) or the
        fallbacks."""
        weight = self.row_major()
        if self._layout(ops, weight.dtype) != self.layout or (
            self.layout == KERNELS and ops is not self.ops
        ):
            self._pack(weight, ops)

    def row_major(self) -> torch.Tensor:
        """The [out_features, in_features] weight, bit for bit."""
        if self.layout == DENSE:
            return self.packed
        if self.layout == ONEDNN:
            return self.packed.to_dense()
        panels, pairs, width = self.packed.shape  # int32 pairs: low half = even input feature
        pairs_bf16 = self.packed.view(torch.bfloat16).view(panels, pairs, width, 2)
        return (
            pairs_bf16.permute(0, 2, 1, 3)
            .reshape(panels * width, 2 * pairs)[: self.out_features]
            .contiguous()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(x.reshape(-1, self.in_features).contiguous()).view(
            *x.shape[:-1], self.out_features
        )

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` for x [rows, in_features], contiguous: no reshaping on the way."""
        if self.layout == KERNELS:
            assert self.ops is not None  # _pack keeps the ops with the KERNELS layout
            return self.ops.linear_bf16(x, self.packed, self.out_features, self.bias)
        if self.layout == ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.packed, self.bias)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds (for memory accounting)."""
        return [t for t in (self.packed, self.bias) if t is not None]


def prepack_linears(module: nn.Module, ops=None) -> int:
    """Replace every eligible ``nn.Linear`` under ``module`` by a ``PackedLinear``; returns how
    many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and can_prepack(child.weight, ops):
            setattr(module, name, PackedLinear(child.weight, child.bias, ops))
            count += 1
        else:
            count += prepack_linears(child, ops)
    return count
