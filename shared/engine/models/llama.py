"""The Llama family (Llama 2/3, Mistral, SmolLM, Qwen2 with its QKV bias) over a paged KV cache.

One forward takes a flattened batch of new tokens from many sequences (decodes and prefill chunks
mixed); attention reads and writes the paged cache through an ``AttentionBackend``. Weights use
Hugging Face names on load; Q/K/V and gate/up are fused into one matrix each so a layer is four
matmuls.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from shared.engine.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from shared.engine.models.config import ModelConfig, rope_inv_freq


def run_to_end(forward: Generator[None, None, torch.Tensor]) -> torch.Tensor:
    """The result of a layer-by-layer forward (``LlamaModel.forward_layers``), all layers run."""
    while True:
        try:
            next(forward)
        except StopIteration as done:
            return done.value


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op (it accumulates in fp32 for bf16 inputs); the reference's separate cast
        # before the scale can differ in the last bf16 bit, which only moves near-tie greedy
        # choices.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the context, in the half-split layout
    (dimension i pairs with i + head_dim/2)."""

    # Buffers, registered by reset().
    cos_half: torch.Tensor
    sin_half: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

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

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.backend = backend

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        # Q and K heads are adjacent in the fused output: rotate them in one go.
        qk = apply_rope(
            qkv[:, : self.q_size + self.kv_size].view(n, -1, self.head_dim), cos, sin
        ).view(n, -1)
        q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        v = qkv[:, self.q_size + self.kv_size :]
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


class LlamaModel(nn.Module):
    """The model: its modules, its weights by Hugging Face name, and the plain torch forward (the
    reference every kernel path is tested against). Running it on the CPU kernels (weight layouts,
    the fused forward) is ``models/runtime.py``'s concern, not the model's."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        backend = backend or TorchAttentionBackend(
            config.num_heads, config.num_kv_heads, config.head_dim
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        if not config.tie_word_embeddings:
            # An nn.Linear, or a drop-in for one once models/runtime.py has packed it.
            self.lm_head: nn.Module = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.backend = backend

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

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
        """``forward`` one decoder layer at a time: yields between two layers and returns the
        final-normed hidden states after the last. Between two layers the forward holds only its
        own tensors, so other forwards may run on the same cache meanwhile (they write other
        slots); abandoned, it leaves K/V in its own slots only, which nothing reads before they
        are written again. ``num_layers``: only the first that many layers run (``kv_caches``
        holds theirs), then the final norm."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(meta.positions, x.dtype)
        layers = self.layers[:num_layers]
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches, strict=True)):
            if i:
                yield
            x = layer(x, cos, sin, k_cache, v_cache, meta)
        return self.norm(x)

    def output_head(self) -> nn.Module | None:
        """The head as a module: the untied ``lm_head``, possibly replaced by a drop-in with another
        weight layout (packed_linear), or a tied head's own copy in one (a GGUF file's blocks,
        gguf_linear); None where the head is the embedding itself."""
        return self._modules.get("lm_head")

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 for the rows that need sampling (one per sequence, not every prompt token:
        the vocabulary projection is the largest matmul in a small model)."""
        head = self.output_head()
        if head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up. Every parameter row must be
        set exactly once, so a truncated or mismatched checkpoint fails here rather than generating
        noise."""
        params = dict(self.named_parameters())
        rows_loaded = dict.fromkeys(params, 0)
        c = self.config
        fused = {
            "q_proj": ("qkv_proj", 0, c.q_size),
            "k_proj": ("qkv_proj", c.q_size, c.kv_size),
            "v_proj": ("qkv_proj", c.q_size + c.kv_size, c.kv_size),
            "gate_proj": ("gate_up_proj", 0, c.intermediate_size),
            "up_proj": ("gate_up_proj", c.intermediate_size, c.intermediate_size),
        }
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and c.tie_word_embeddings
            ):
                continue
            parts = name.split(".")
            target, offset, size = name, 0, None
            for i, part in enumerate(parts):
                if part in fused:
                    dst, offset, size = fused[part]
                    target = ".".join(parts[:i] + [dst] + parts[i + 1 :])
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in a {c.architecture} model"
                )
            dst_view = param if size is None else param.narrow(0, offset, size)
            if tuple(dst_view.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst_view.shape)}"
                )
            with torch.no_grad():
                dst_view.copy_(tensor)
            rows_loaded[target] += dst_view.shape[0]
        incomplete = [n for n, rows in rows_loaded.items() if rows != params[n].shape[0]]
        if incomplete:
            raise ValueError(
                f"checkpoint does not fill {len(incomplete)} tensors, e.g. {incomplete[:3]}"
            )
