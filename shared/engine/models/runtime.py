"""A ``LlamaModel`` as the engine runs it on a ``CpuBackend``: its weights in the layout the
backend's linears read, on huge pages, and the fused forward when the backend has kernels.

The model stays the model (modules and the plain torch forward); everything here is about running it
on this CPU. The runtime lays the model's linears out in place (``PackedLinear``/``Int8Linear`` are
drop-ins for ``nn.Linear``), so one model has one runtime at a time.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import cast

import torch
from torch import nn

from shared.engine import huge_pages
from shared.engine.attention import AttentionMetadata, TorchAttentionBackend
from shared.engine.cpu_backend import KERNEL_DTYPES, CpuBackend
from shared.engine.models.fused_forward import FusedLayer, fused_forward_layers, fused_layers
from shared.engine.models.gguf_linear import GGUFLinear
from shared.engine.models.int8_linear import Int8Linear
from shared.engine.models.llama import LlamaModel, run_to_end
from shared.engine.models.loader import load_model, resolve_dtype
from shared.engine.models.packed_linear import PackedLinear, can_prepack, prepack_linears

_KERNEL_LINEARS = (PackedLinear, Int8Linear, GGUFLinear)


class ModelRuntime(nn.Module):
    """``model`` on ``backend``. Called like the model (``runtime(input_ids, kv_caches, meta)`` ->
    final-normed hidden states; ``compute_logits``), with the same results up to the kernels'
    summation order."""

    def __init__(self, model: LlamaModel, backend: CpuBackend) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        # A tied output head gets a packed copy here; the embedding keeps the original for lookups.
        # An untied head is packed in place of the model's ``lm_head``. A head on GGUF blocks (an
        # ``lm_head`` the loader made, tied or not) runs on them as it is.
        self.tied_head: PackedLinear | None = None
        self._check(backend)
        self.backend = backend
        self.attention = self._attention(backend)
        ops = backend.ops
        prepack_linears(model.layers, ops)
        for module in model.modules():
            if isinstance(module, GGUFLinear):  # loaded on its blocks (quantization="gguf")
                module.use_cpu_kernels(ops)
        head_module = model.output_head()
        if not isinstance(head_module, GGUFLinear):
            head = (
                model.embed_tokens.weight
                if head_module is None
                else cast(nn.Linear, head_module).weight  # not packed yet
            )
            if can_prepack(head, ops):
                if head_module is None:
                    self.tied_head = PackedLinear(head, None, ops)
                else:
                    model.lm_head = PackedLinear(head, None, ops)
        # The fused path's per-layer callables, built on first use; refresh() drops them.
        self._layers: list[FusedLayer] | None = None
        self.relocate()

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def _check(self, backend: CpuBackend) -> None:
        if backend.enabled and (self.device.type != "cpu" or self.dtype not in KERNEL_DTYPES):
            raise ValueError(
                f"the CPU kernels take float32 or bfloat16 weights on the CPU; this model "
                f"holds {self.dtype} on {self.device} (pick the backend with CpuBackend.pick)"
            )

    def _attention(self, backend: CpuBackend) -> TorchAttentionBackend:
        c = self.config
        return TorchAttentionBackend(
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            backend.attention_ops(c.num_heads, c.num_kv_heads, c.head_dim),
        )

    def use(self, backend: CpuBackend) -> None:
        """Run on ``backend`` from now on: every linear re-laid out for it (bit for bit the same
        weights), attention and the forward switched with them. ``CpuBackend.off()`` gives the plain
        torch path, the reference the kernels are tested against."""
        self._check(backend)
        self.backend = backend
        self.attention = self._attention(backend)
        for module in self.modules():
            if isinstance(module, _KERNEL_LINEARS):
                module.use_cpu_kernels(
                    backend.ops
                )  # each takes the kernels where they fit its weight
        self.relocate()

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden] final-normed hidden states
        return run_to_end(self.forward_layers(input_ids, kv_caches, meta))

    @torch.inference_mode()
    def forward_layers(
        self,
        input_ids: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        num_layers: int | None = None,
    ) -> Generator[None, None, torch.Tensor]:
        """``forward`` one decoder layer at a time (``LlamaModel.forward_layers``, ``num_layers``
        as there); ``forward`` is this run to the end, so the two compute the same thing by
        construction."""
        ops = self.backend.ops
        if ops is None:
            return (yield from self.model.forward_layers(input_ids, kv_caches, meta, num_layers))
        layers = (self._layers or self._build_layers())[:num_layers]
        return (
            yield from fused_forward_layers(
                self.model, layers, self.attention, ops, input_ids, kv_caches, meta
            )
        )

    def _build_layers(self) -> list[FusedLayer]:
        self._layers = fused_layers(self.model)
        return self._layers

    def refresh(self) -> None:
        """Make the fused path look the model's layers up again: call after replacing a decoder
        linear (``relocate`` does) or adding or removing forward hooks on one."""
        self._layers = None

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's ``compute_logits``, through the tied head's packed copy where there is
        one."""
        if self.tied_head is not None:
            return self.tied_head(hidden).float()
        return self.model.compute_logits(hidden)

    def relocate(self) -> int:
        """Move every weight in a kernel layout into one buffer on huge pages (``shared/engine/
        huge_pages``: decode streams them all each step); returns how many. Call after the layouts
        change."""
        self.refresh()
        slots: list[tuple[nn.Module, str]] = [
            (m, "packed")
            for m in self.modules()
            if isinstance(m, PackedLinear) and m.ops is not None
        ]
        slots += [
            (m, "weight") for m in self.modules() if isinstance(m, Int8Linear) and m.ops is not None
        ]
        slots += [
            (m, attr)
            for m in self.modules()
            if isinstance(m, GGUFLinear) and m.ops is not None
            for attr in ("qs", "scales", "mins")
            if getattr(m, attr) is not None
        ]
        for (module, attr), moved in zip(
            slots, huge_pages.relocate([getattr(m, a) for m, a in slots]), strict=True
        ):
            setattr(module, attr, moved)
        return len(slots)

    def weight_bytes(self) -> int:
        """Bytes of every weight tensor held (parameters and packed weights), each storage counted
        once: what the memory ledger must subtract from the budget."""
        tensors: list[torch.Tensor] = list(self.parameters())
        for module in self.modules():
            if isinstance(module, _KERNEL_LINEARS):
                tensors += module.tensors()
        seen: dict[object, int] = {}
        for t in tensors:
            if t.is_mkldnn:  # packed: opaque, no shared storage to find
                seen[id(t)] = t.numel() * t.element_size()
            else:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())


def load_runtime(
    path: str | None = None,
    *,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "cpu",
    backend: CpuBackend | None = None,
    progress: bool = True,
    quantization: str | None = None,
) -> ModelRuntime:
    """``load_model`` on ``backend`` (default: ``CpuBackend.pick`` for this device and dtype);
    ``quantization``: as ``load_model`` takes it ("gguf"; None for every other)."""
    model = load_model(
        path, dtype=dtype, device=device, progress=progress, quantization=quantization
    )
    return ModelRuntime(model, backend or CpuBackend.pick(device, resolve_dtype(dtype))).eval()
