"""CPU fast path for reduced-precision linears: weights pre-packed once into oneDNN's blocked layout.

A plain ``F.linear`` on a bf16 CPU weight re-lays the weight out on every call; for single-token
decode that copy costs as much as the matmul itself (measured ~1.9x slower on a 2-core AVX-512 host).
Packing once at load makes decode bound by reading each weight once, which is the floor.

With the CPU kernels built on an AVX512-BF16 host, the row-major weight is kept as well: matmuls of at
most ``SMALL_M`` rows (decode) stream it through ``llmserve_cpu::linear_bf16``, which reaches the DRAM
bandwidth where oneDNN's matrix-vector path reaches ~60% of it; larger batches stay with oneDNN. The
price is a second copy of every linear weight, which ``LlamaModel.weight_bytes`` counts.
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


# Rows up to which the small-M kernel beats oneDNN here (measured over SmolLM2's 30 layers of linears,
# 212 MB, by `python -m loadtests.bench_kernels`: 1.2-1.5x faster at 1-8 rows, 1.1x at 12, even at 16).
SMALL_M = 12


class PackedLinear(nn.Module):
    """Drop-in for ``nn.Linear`` in inference. ``small_m_kernel(x, weight, bias)``, when given, serves
    inputs of at most ``SMALL_M`` rows from the kept row-major weight; otherwise that weight is dropped."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, small_m_kernel=None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.bias = None if bias is None else bias.detach().clone()
        self.small_m_kernel = small_m_kernel if weight.dtype == torch.bfloat16 else None
        self.weight = weight.detach().contiguous() if self.small_m_kernel is not None else None

    def set_small_m_kernel(self, kernel) -> None:
        """Switch the small-M path on (only if the row-major weight was kept at construction) or off."""
        self.small_m_kernel = kernel if self.weight is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small_m_kernel is not None and x.dim() == 2 and x.shape[0] <= SMALL_M:
            return self.small_m_kernel(x.contiguous(), self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds (for memory accounting)."""
        return [t for t in (self.packed, self.bias, self.weight) if t is not None]


def prepack_linears(module: nn.Module, small_m_kernel=None) -> int:
    """Replace every eligible ``nn.Linear`` under ``module`` by a ``PackedLinear``; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and can_prepack(child.weight):
            setattr(module, name, PackedLinear(child.weight, child.bias, small_m_kernel))
            count += 1
        else:
            count += prepack_linears(child, small_m_kernel)
    return count
