"""The CPU kernels as one backend, chosen once and handed to whatever runs on it.

Invariant: ``CpuBackend.pick`` is the only place in the engine that asks ``kernels.cpu`` which
kernels run here. Everything that can take a kernel path (the linears' weight layout, the fused
decoder-layer forward, attention, the sampler's argmax) is handed a ``CpuBackend`` (or its ``ops``)
by its caller, so a backend without ops turns the kernels off everywhere at once: no component can
disagree with another about whether the kernels are on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels import cpu as kernels_cpu

_NAMESPACE_PREFIX = "llmserve_cpu_"
# The weight dtypes the fused forward's kernels take (fp16 weights run the torch path).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class CpuBackend:
    """``ops``: the kernels' ops (the module ``kernels.cpu`` loads for a level), or None: every op
    takes the torch path, for the reason in ``reason``. ``level``: the ISA level of ``ops`` (None
    without)."""

    ops: Any | None
    level: str | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if (self.ops is None) != (self.level is None):
            raise ValueError("a CpuBackend has both ops and their level, or neither")
        if self.ops is None and not self.reason:
            raise ValueError("a CpuBackend without ops must say why (reason)")

    @classmethod
    def pick(
        cls, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16
    ) -> CpuBackend:
        """The best kernel level for a model with weights of ``dtype`` on ``device``, or the torch
        path with the reason (not a CPU, a dtype the kernels do not take,
        ``LLMSERVE_CPU_KERNELS=0``, no level on this CPU, a failed build)."""
        if torch.device(device).type != "cpu":
            return cls.off(f"the model is on {device}, not the CPU")
        if dtype not in KERNEL_DTYPES:
            return cls.off(
                "the kernels take float32 or bfloat16 weights, "
                f"not {str(dtype).removeprefix('torch.')}"
            )
        ops = kernels_cpu.cpu_ops()
        return cls.off(kernels_cpu.unavailable_reason()) if ops is None else cls.of(ops)

    @classmethod
    def of(cls, ops: Any) -> CpuBackend:
        """A backend on a given level's ops (``kernels.cpu.ops_at(level)``)."""
        name = getattr(ops, "name", "")
        if not name.startswith(_NAMESPACE_PREFIX):
            raise ValueError(f"not a CPU kernel op namespace: {ops!r}")
        return cls(ops, name.removeprefix(_NAMESPACE_PREFIX))

    @classmethod
    def off(cls, reason: str = "switched off") -> CpuBackend:
        """The torch path everywhere."""
        return cls(None, None, reason)

    @property
    def enabled(self) -> bool:
        return self.ops is not None

    def attention_ops(self, num_heads: int, num_kv_heads: int, head_dim: int) -> Any | None:
        """``ops`` where the attention kernels cover this head shape, else None (torch
        attention)."""
        if self.ops is None or not self.ops.attention_supports(num_heads, num_kv_heads, head_dim):
            return None
        return self.ops

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(dim=-1)`` of a 2-D tensor, by the kernel where it applies: the same indices
        (first maximum; NaN counts as the maximum), several times faster than torch's on large
        vocabularies."""
        if (
            self.ops is not None
            and x.device.type == "cpu"
            and x.dtype in KERNEL_DTYPES
            and x.is_contiguous()
        ):
            return self.ops.argmax_rows(x)
        return x.argmax(dim=-1)

    def paths(self) -> list[str]:
        """What each op runs on here, one line each."""
        if self.ops is None:
            return [f"every op: torch ({self.reason})"]
        return [f"{self.level}: {path}" for path in self.ops.paths()]
