"""Int8 weights and activations (W8A8) for a model's linear layers on the CPU:
``quantization="int8"``.

Why: on a CPU, bf16 prefill linears run at ~90% of the bf16 dot-product peak and decode streams the
weights at the DRAM bandwidth. int8 dot products run at twice the bf16 rate (AVX512-VNNI; AVX2's
``vpmaddwd`` at the AVX2 level) and the weights are half the bytes (the kernels' ``linear_int8``;
figures in ``loadtests/RESULTS.md``).

The scheme, chosen by measurement on SmolLM2-135M (``python -m loadtests.bench_quality``):

- Weights: symmetric int8 per output row, ``scale = max|w| / 127``, quantized once at load.
- Activations: symmetric int8 per row (token), quantized by the kernel on every call.
- SmoothQuant (Xiao et al., 2023), because per-token activations alone lose too much: a few input
  features carry outliers (after RMSNorm) that flatten every other feature of their row to a few
  levels. Per input feature j, ``s_j = max|x_j|^0.5 / max|W[:, j]|^0.5`` moves half of that range
  into the weight: the layer holds ``W diag(s)`` and multiplies its input by ``1 / s`` while
  quantizing it, so ``(x / s)(W diag(s))^T = x W^T``. ``max|x_j|`` comes from one forward pass over
  a fixed calibration text (``calibration.txt``) in the model dtype, before any layer is quantized.
- The output head stays in the model dtype: its logits are sampled directly.

Smoothing is what keeps int8 close to bf16 (``bench_quality`` perplexity: bf16 11.54, int8 11.68,
int8 without smoothing 11.79). Quality and throughput figures: the README's benchmark table and
``loadtests/RESULTS.md``.

``int8_linear_reference`` is the same maths in torch (exact integer sums in fp64): what the kernel
is tested against, and what a layer runs with the kernels switched off (the engine refuses int8
without them: the reference is far too slow to serve with).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from shared.engine.models.packed_linear import PackedLinear
from shared.engine.models.teacher_forcing import prefill_hidden
from shared.engine.quantize_rows import quantize_rows

if TYPE_CHECKING:  # the runtime imports this module
    from shared.engine.cpu_backend import CpuBackend
    from shared.engine.models.runtime import ModelRuntime

log = logging.getLogger(__name__)

SMOOTHING_ALPHA = (
    0.5  # share of each input feature's range moved into the weight (0.3-0.8 tried: 0.4-0.6 alike)
)
_CALIBRATION_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.txt")


def int8_supported(ops) -> bool:
    """Whether ``ops`` (the CPU kernel namespace, or None) can run the int8 linear here: every
    kernel level has it (VNNI, or AVX2's byte multiply-adds)."""
    return ops is not None


def int8_linear_reference(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    smooth: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``linear_int8`` in torch: x [rows, in] (bf16/fp32), q int8 [out, in] per-row scales
    ``scale``, ``smooth`` fp32 [in] multiplied into x before it is quantized. Integer sums are exact
    (fp64); the output rounds once, to x's dtype (the kernel fuses the last multiply-add, so the two
    can differ by one rounding of the fp32 result)."""
    v = x.float() if smooth is None else x.float() * smooth
    xq, xs = quantize_rows(v)
    sums = xq.double() @ q.double().T
    y = sums.float() * (scale.unsqueeze(0) * xs.unsqueeze(1))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class Int8Linear(nn.Module):
    """A linear layer holding int8 weights (``W diag(smooth⁻¹)`` quantized per output row) that
    quantizes its input per row. ``ops``: the CPU kernel namespace (any level), else None (torch
    reference: exact, slow). ``input_maxima``: max|x| per input feature from calibration (None: no
    smoothing)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        ops=None,
        input_maxima: torch.Tensor | None = None,
        alpha: float = SMOOTHING_ALPHA,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if self.in_features % 4:
            raise ValueError(
                f"int8 linears need in_features divisible by 4, got {self.in_features}"
            )
        w = weight.detach().float()
        self.smooth: torch.Tensor | None = None  # 1 / s per input feature
        if input_maxima is not None:
            s = smoothing_factors(input_maxima, w, alpha)
            w = w * s
            self.smooth = (1.0 / s).contiguous()
        q, self.scale = quantize_rows(w)
        self.colsum = q.sum(dim=1, dtype=torch.int32)  # the kernel's unsigned-input correction
        self.bias = None if bias is None else bias.detach().clone()
        self.ops = None
        self.weight = (
            q  # int8 [out, in] row-major (torch path) or packed (kernels); one copy either way
        )
        self.use_cpu_kernels(ops)

    def use_cpu_kernels(self, ops) -> None:
        """Run on the kernels' int8 linear (``ops``, any level) or on the torch reference."""
        ops = ops if int8_supported(ops) else None
        if ops is not self.ops:
            q = self.row_major()
            self.ops = ops
            self.weight = q if ops is None else ops.pack_linear_int8(q)

    def row_major(self) -> torch.Tensor:
        """The int8 weight [out_features, in_features]."""
        if self.ops is None:
            return self.weight
        panels, quads, width = self.weight.shape  # int32 units: 4 consecutive input features each
        q = self.weight.view(torch.int8).view(panels, quads, width, 4)
        return (
            q.permute(0, 2, 1, 3)
            .reshape(panels * width, 4 * quads)[: self.out_features]
            .contiguous()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(x.reshape(-1, self.in_features).contiguous()).view(
            *x.shape[:-1], self.out_features
        )

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` for x [rows, in_features], contiguous: no reshaping on the way."""
        if self.ops is not None:
            return self.ops.linear_int8(
                x, self.weight, self.scale, self.colsum, self.smooth, self.bias
            )
        return int8_linear_reference(x, self.weight, self.scale, self.smooth, self.bias)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds (for memory accounting)."""
        return [
            t
            for t in (self.weight, self.scale, self.colsum, self.smooth, self.bias)
            if t is not None
        ]


def smoothing_factors(
    input_maxima: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHING_ALPHA
) -> torch.Tensor:
    """SmoothQuant's per-input-feature factor ``max|x_j|^alpha / max|W[:, j]|^(1 - alpha)``;
    features never seen active (or with an all-zero weight column) keep 1."""
    w_max = weight.abs().amax(dim=0).float()
    x_max = input_maxima.float()
    s = x_max.clamp_min(1e-5).pow(alpha) / w_max.clamp_min(1e-5).pow(1 - alpha)
    return torch.where((x_max > 0) & (w_max > 0), s, torch.ones_like(s))


@functools.lru_cache(maxsize=1)
def calibration_text() -> str:
    with open(_CALIBRATION_FILE, encoding="utf-8") as f:
        return f.read()


def input_maxima(runtime: ModelRuntime, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """max|x| per input feature of every linear under the model's ``layers`` (keyed by module name),
    over one prefill of ``token_ids`` (as many as the model's context holds) on the runtime's
    path."""
    token_ids = token_ids[: runtime.config.max_position_embeddings]
    maxima: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in runtime.model.layers.named_modules():
        if isinstance(module, (PackedLinear, nn.Linear)):

            def record(_module, inputs, _output, name=name):
                x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0)
                maxima[name] = x if name not in maxima else torch.maximum(maxima[name], x)

            hooks.append(module.register_forward_hook(record))
    runtime.refresh()  # so that the fused CPU path calls the hooked modules
    try:
        prefill_hidden(runtime, token_ids)
    finally:
        for hook in hooks:
            hook.remove()
        runtime.refresh()
    return maxima


def quantize_model_int8(
    runtime: ModelRuntime,
    calibration_ids: list[int],
    backend: CpuBackend,
    alpha: float | None = SMOOTHING_ALPHA,
) -> int:
    """Replace every linear of the runtime's model's ``layers`` by an ``Int8Linear`` on ``backend``
    (the one the runtime runs on), smoothed with input maxima measured over ``calibration_ids`` (all
    measured first, on the unquantized model; ``alpha=None``: no smoothing, no calibration); returns
    how many. The output head and the embedding stay as they are."""
    if backend != runtime.backend:
        raise ValueError(
            f"quantize_model_int8 was given the {backend} but the runtime runs on the "
            f"{runtime.backend}: int8 layers must run on the runtime's backend"
        )
    ops = backend.ops
    maxima = input_maxima(runtime, calibration_ids) if alpha is not None else {}
    count = 0
    for parent_name, parent in list(runtime.model.layers.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (PackedLinear, nn.Linear)):
                key = f"{parent_name}.{name}" if parent_name else name
                weight = child.row_major() if isinstance(child, PackedLinear) else child.weight
                if alpha is None:
                    layer = Int8Linear(weight, child.bias, ops)
                else:
                    layer = Int8Linear(weight, child.bias, ops, maxima[key], alpha)
                setattr(parent, name, layer)
                count += 1
    runtime.relocate()
    log.info(
        "quantized %d linears to int8 (W8A8, SmoothQuant alpha %s, %d calibration tokens, %s)",
        count,
        alpha,
        len(calibration_ids),
        "CPU kernels" if int8_supported(ops) else "torch reference",
    )
    return count
