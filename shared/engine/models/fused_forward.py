"""``LlamaModel.forward`` on the CPU kernels: the same computation, fused where the kernels fuse it.

RoPE and the KV cache write are one kernel (in place on the QKV projection's output), the residual
add is fused into the next RMSNorm, and SiLU·up is one kernel. Every add rounds to the model dtype
exactly where the plain forward's adds do, so the two paths differ only by summation order inside
the kernels (tests/test_cpu_kernels.py holds them to that).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from shared.engine.attention import AttentionBackend, AttentionMetadata
from shared.engine.models.gguf_linear import GGUFLinear
from shared.engine.models.int8_linear import Int8Linear
from shared.engine.models.llama import DecoderLayer, LlamaModel
from shared.engine.models.packed_linear import PackedLinear


class FusedLayer(NamedTuple):
    """A decoder layer's norms and linears as the fused path calls them, looked up once so that the
    per-token loop makes no module calls or attribute lookups (a real share of a one-token forward
    on a small model). Linears take [rows, in_features] contiguous."""

    input_norm: torch.Tensor
    input_eps: float
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    post_norm: torch.Tensor
    post_eps: float
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]


def _rows_linear(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The cheapest call of a linear layer on 2-D rows; the module itself (a full ``__call__``)
    while it has forward hooks, so that they fire."""
    if module._forward_hooks or module._forward_pre_hooks:
        return module
    return (
        module.rows
        if isinstance(module, (PackedLinear, Int8Linear, GGUFLinear))
        else module.forward
    )


def fused_layers(model: LlamaModel) -> list[FusedLayer]:
    """The model's layers as ``fused_forward`` runs them. They hold the linears as they are now:
    look them up again after replacing a linear or adding or removing forward hooks on one."""
    return [
        FusedLayer(
            layer.input_layernorm.weight,
            layer.input_layernorm.eps,
            _rows_linear(layer.self_attn.qkv_proj),
            _rows_linear(layer.self_attn.o_proj),
            layer.post_attention_layernorm.weight,
            layer.post_attention_layernorm.eps,
            _rows_linear(layer.mlp.gate_up_proj),
            _rows_linear(layer.mlp.down_proj),
        )
        for layer in cast("Iterable[DecoderLayer]", model.layers)
    ]


def fused_forward_layers(
    model: LlamaModel,
    layers: list[FusedLayer],
    attention: AttentionBackend,
    ops: Any,
    input_ids: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
) -> Generator[None, None, torch.Tensor]:
    """``model.forward`` on the kernels ``ops``, through ``layers`` (``fused_layers(model)``) and
    ``attention`` (whose ``attend`` reads the cache the RoPE-and-cache kernel wrote), a layer at a
    time as ``LlamaModel.forward_layers`` runs: it yields between two decoder layers and returns
    the final-normed hidden states. The residual stream is kept apart, as the add+norm kernel wants
    it: a layer's input is ``residual + x`` (``residual`` None before the first)."""
    x = model.embed_tokens(input_ids)
    c = model.config
    # The kernel reads fp32 tables (a no-op unless the model was cast after loading).
    cos_half, sin_half = model.rotary.cos_half.float(), model.rotary.sin_half.float()
    attend, rms_norm = attention.attend, ops.rms_norm
    qkv_sizes = [c.q_size, c.kv_size, c.kv_size]
    positions, slot_mapping = meta.positions, meta.slot_mapping
    residual = None
    for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches, strict=True)):
        if i:
            yield
        if residual is None:
            residual = x
            h = rms_norm(x, layer.input_norm, layer.input_eps, None)
        else:
            h = rms_norm(x, layer.input_norm, layer.input_eps, residual)  # residual += x, in place
        qkv = layer.qkv(h)
        ops.rope_and_cache(
            qkv,
            positions,
            cos_half,
            sin_half,
            k_cache,
            v_cache,
            slot_mapping,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
        )
        q, k, v = qkv.split(qkv_sizes, dim=-1)
        h = rms_norm(
            layer.o(attend(q, k, v, k_cache, v_cache, meta)),
            layer.post_norm,
            layer.post_eps,
            residual,
        )
        x = layer.down(ops.silu_mul(layer.gate_up(h)))
    return rms_norm(x, model.norm.weight, model.norm.eps, residual)
