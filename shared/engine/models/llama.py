"""The Llama family (Llama 2/3, Mistral, SmolLM, Qwen2 with its QKV bias) over a paged KV cache.

One forward takes a flattened batch of new tokens from many sequences (decodes and prefill chunks
mixed); attention reads and writes the paged cache through an ``AttentionBackend``. Weights use Hugging
Face names on load; Q/K/V and gate/up are fused into one matrix each so a layer is four matmuls.
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import cpu_ops as load_cpu_ops
from shared.engine import huge_pages
from shared.engine.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from shared.engine.models.config import ModelConfig, rope_inv_freq
from shared.engine.models.int8_linear import Int8Linear
from shared.engine.models.packed_linear import PackedLinear, can_prepack, prepack_linears


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op (it accumulates in fp32 for bf16 inputs); the reference's separate cast before
        # the scale can differ in the last bf16 bit, which only moves near-tie greedy choices.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the context, in the half-split layout
    (dimension i pairs with i + head_dim/2)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.reset()

    def reset(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables, e.g. after the model was built on the meta device."""
        inv_freq = rope_inv_freq(self.config)
        if device is not None:
            inv_freq = inv_freq.to(device)
        pos = torch.arange(self.config.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        # fp32 [positions, head_dim/2]: what the fused CPU kernel reads.
        self.register_buffer("cos_half", cos, persistent=False)
        self.register_buffer("sin_half", sin, persistent=False)
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1), persistent=False)
        # Sign folded in: rotate_half(x) * sin == swap_halves(x) * [-sin, sin].
        self.register_buffer("sin", torch.cat([-sin, sin], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin per token, shaped [tokens, 1, head_dim] to broadcast over heads."""
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim] → x·cos + rotate_half(x)·sin, with rotate_half(x) = [-x2, x1]
    computed as the swapped halves [x2, x1] times the signed sin table (three ops, no concat)."""
    n, h, d = x.shape
    swapped = x.view(n, h, 2, d // 2).flip(2).view(n, h, d)
    return torch.addcmul(x * cos, swapped, sin_signed)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.backend = backend

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        # Q and K heads are adjacent in the fused output: rotate them in one go.
        qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(n, -1, self.head_dim), cos, sin).view(n, -1)
        q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        v = qkv[:, self.q_size + self.kv_size:]
        out = self.backend.forward(q, k, v, k_cache, v_cache, meta)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class _FusedLayer(NamedTuple):
    """A decoder layer's norms and linears as the fused CPU path calls them, looked up once: the
    module calls and attribute lookups of a per-layer ``forward`` took ~0.8 ms of a ~9 ms
    single-token forward. Linears take [rows, in_features] contiguous."""
    input_norm: torch.Tensor
    input_eps: float
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    post_norm: torch.Tensor
    post_eps: float
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]


def _rows_linear(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The cheapest call of a linear layer on 2-D rows; the module itself (a full ``__call__``) while
    it has forward hooks, so that they fire."""
    if module._forward_hooks or module._forward_pre_hooks:
        return module
    return module.rows if isinstance(module, (PackedLinear, Int8Linear)) else module.forward


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        backend = backend or TorchAttentionBackend(config.num_heads, config.num_kv_heads, config.head_dim)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._packed_head: PackedLinear | None = None
        self.backend = backend
        self.cpu_ops = None  # torch.ops.llmserve_cpu_<level> once enable_cpu_kernels() found them
        # The fused path's per-layer callables, built on first use; reset_fused_layers() drops them.
        self._fused_layers: list[_FusedLayer] | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,                  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:                            # [num_tokens, hidden] final-normed hidden states
        x = self.embed_tokens(input_ids)
        if self.cpu_ops is not None and x.device.type == "cpu":
            return self._forward_fused(x, kv_caches, meta, self.cpu_ops)
        cos, sin = self.rotary(meta.positions, x.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, k_cache, v_cache, meta)
        return self.norm(x)

    def _forward_fused(self, x, kv_caches, meta: AttentionMetadata, ops) -> torch.Tensor:
        """``forward`` on the CPU kernels: RoPE and the cache write in one kernel (in place on qkv),
        the residual add fused into the next RMSNorm, SiLU·up in one kernel. The residual stream is
        kept apart, as the add+norm kernel wants it: a layer's input is ``residual + x`` (``residual``
        None before the first), and every add rounds to the model dtype exactly where ``forward``'s
        adds do. Layers run from ``_fused_layers``, so the loop makes no module calls."""
        layers = self._fused_layers or self._build_fused_layers()
        c = self.config
        # The kernel reads fp32 tables (a no-op unless the model was cast after loading).
        cos_half, sin_half = self.rotary.cos_half.float(), self.rotary.sin_half.float()
        attend, rms_norm = self.backend.attend, ops.rms_norm
        qkv_sizes = [c.q_size, c.kv_size, c.kv_size]
        positions, slot_mapping = meta.positions, meta.slot_mapping
        residual = None
        for layer, (k_cache, v_cache) in zip(layers, kv_caches):
            if residual is None:
                residual = x
                h = rms_norm(x, layer.input_norm, layer.input_eps, None)
            else:
                h = rms_norm(x, layer.input_norm, layer.input_eps, residual)  # residual += x, in place
            qkv = layer.qkv(h)
            ops.rope_and_cache(qkv, positions, cos_half, sin_half, k_cache, v_cache, slot_mapping,
                               c.num_heads, c.num_kv_heads, c.head_dim)
            q, k, v = qkv.split(qkv_sizes, dim=-1)
            h = rms_norm(layer.o(attend(q, k, v, k_cache, v_cache, meta)), layer.post_norm, layer.post_eps,
                         residual)
            x = layer.down(ops.silu_mul(layer.gate_up(h)))
        return rms_norm(x, self.norm.weight, self.norm.eps, residual)

    def reset_fused_layers(self) -> None:
        """Make the fused CPU path look its layers up again: call after replacing a decoder linear
        (``relocate_packed_weights`` does) or adding or removing forward hooks on one."""
        self._fused_layers = None

    def _build_fused_layers(self) -> list[_FusedLayer]:
        self._fused_layers = [_FusedLayer(
            layer.input_layernorm.weight, layer.input_layernorm.eps,
            _rows_linear(layer.self_attn.qkv_proj), _rows_linear(layer.self_attn.o_proj),
            layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
            _rows_linear(layer.mlp.gate_up_proj), _rows_linear(layer.mlp.down_proj),
        ) for layer in self.layers]
        return self._fused_layers

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 for the rows that need sampling (one per sequence, not every prompt token:
        the vocabulary projection is the largest matmul in a small model)."""
        if self._packed_head is not None:
            return self._packed_head(hidden).float()
        return F.linear(hidden, self.lm_head_weight).float()

    def prepack(self) -> int:
        """Pre-pack linear weights for the CPU bf16/fp16 fast path (no-op elsewhere). The tied output
        head gets a packed copy; the embedding keeps the original for lookups. Call after
        ``enable_cpu_kernels`` so the weights are laid out for the kernels' bf16 linear."""
        count = prepack_linears(self.layers, self.cpu_ops)
        if can_prepack(self.lm_head_weight, self.cpu_ops):
            self._packed_head = PackedLinear(self.lm_head_weight, None, self.cpu_ops)
            if not self.config.tie_word_embeddings:
                del self.lm_head
            count += 1
        self.relocate_packed_weights()
        return count

    def relocate_packed_weights(self) -> int:
        """Move every weight in a kernel layout into one buffer on huge pages (``shared/engine/huge_pages``:
        decode streams them all each step); returns how many. Call after the layouts change."""
        self.reset_fused_layers()
        slots = [(m, "packed") for m in self.modules() if isinstance(m, PackedLinear) and m.ops is not None]
        slots += [(m, "weight") for m in self.modules() if isinstance(m, Int8Linear) and m.ops is not None]
        for (module, attr), moved in zip(slots, huge_pages.relocate([getattr(m, a) for m, a in slots])):
            setattr(module, attr, moved)
        return len(slots)

    def weight_bytes(self) -> int:
        """Bytes of every weight tensor held (parameters and packed weights), each storage counted
        once: what the memory ledger must subtract from the budget."""
        tensors = list(self.parameters())
        for module in self.modules():
            if isinstance(module, (PackedLinear, Int8Linear)):
                tensors += module.tensors()
        seen: dict[object, int] = {}
        for t in tensors:
            if t.is_mkldnn:  # packed: opaque, no shared storage to find
                seen[id(t)] = t.numel() * t.element_size()
            else:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def enable_cpu_kernels(self, enabled: bool = True, ops=None) -> bool:
        """Route the forward through the fused CPU kernels (kernels/cpu: ``ops``, default the best
        level here) when the weights live on the CPU in fp32 or bf16 and the kernels could be built
        (``enabled=False``: the plain torch path, the reference the kernels are tested against);
        returns whether they are in use."""
        w = self.embed_tokens.weight
        usable = enabled and w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
        ops = (ops or load_cpu_ops()) if usable else None
        self.cpu_ops = ops
        if isinstance(self.backend, TorchAttentionBackend):
            self.backend.use_cpu_ops(ops)
        for module in self.modules():
            if isinstance(module, (PackedLinear, Int8Linear)):
                module.use_cpu_kernels(ops)  # each takes the kernels where they fit its weight
        self.relocate_packed_weights()
        return ops is not None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up. Every parameter row must be set
        exactly once, so a truncated or mismatched checkpoint fails here rather than generating noise."""
        params = dict(self.named_parameters())
        rows_loaded = dict.fromkeys(params, 0)
        c = self.config
        fused = {
            "q_proj": ("qkv_proj", 0, c.q_size), "k_proj": ("qkv_proj", c.q_size, c.kv_size),
            "v_proj": ("qkv_proj", c.q_size + c.kv_size, c.kv_size),
            "gate_proj": ("gate_up_proj", 0, c.intermediate_size),
            "up_proj": ("gate_up_proj", c.intermediate_size, c.intermediate_size),
        }
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and c.tie_word_embeddings):
                continue
            parts = name.split(".")
            target, offset, size = name, 0, None
            for i, part in enumerate(parts):
                if part in fused:
                    dst, offset, size = fused[part]
                    target = ".".join(parts[:i] + [dst] + parts[i + 1:])
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in a {c.architecture} model")
            dst_view = param if size is None else param.narrow(0, offset, size)
            if tuple(dst_view.shape) != tuple(tensor.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst_view.shape)}")
            with torch.no_grad():
                dst_view.copy_(tensor)
            rows_loaded[target] += dst_view.shape[0]
        incomplete = [n for n, rows in rows_loaded.items() if rows != params[n].shape[0]]
        if incomplete:
            raise ValueError(f"checkpoint does not fill {len(incomplete)} tensors, e.g. {incomplete[:3]}")
