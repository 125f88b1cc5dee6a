"""Attention backends: one interface, driven by the same paged metadata on every device.

The torch backend is the CPU path and the reference every Triton kernel is tested against.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

from shared.engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,        # [num_tokens, num_heads * head_dim], RoPE applied
        k: torch.Tensor,        # [num_tokens, num_kv_heads * head_dim], RoPE applied
        v: torch.Tensor,        # [num_tokens, num_kv_heads * head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:          # [num_tokens, num_heads * head_dim]
        ...


class TorchAttentionBackend:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = q.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        k = k.view(num_tokens, kvh, d)
        v = v.view(num_tokens, kvh, d)
        # Write first: a sequence's new tokens attend to themselves through the cache.
        k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        q3 = q.view(num_tokens, h, d)
        for i in range(nd, meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            q_len, seq_len = end - start, meta.seq_lens[i]
            qi = q3[start:end].transpose(0, 1)  # [h, q_len, d]
            if seq_len == q_len:
                # Nothing cached before this chunk: attend to the fresh K/V with a plain causal mask.
                ki, vi = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale,
                                                    enable_gqa=True)
            else:
                ki, vi = self._gather(k_cache, v_cache, meta.block_tables[i], seq_len)
                # Query j sits at position (seq_len - q_len + j) and sees keys up to it.
                ctx = seq_len - q_len
                mask = (torch.arange(seq_len, device=q.device)[None, :]
                        <= (ctx + torch.arange(q_len, device=q.device))[:, None])
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale,
                                                    enable_gqa=True)
            out[start:end] = oi.transpose(0, 1).reshape(q_len, h * d)
        return out

    def _gather(self, k_cache, v_cache, block_table, seq_len):
        num_blocks = -(-seq_len // k_cache.shape[1])
        ids = block_table[:num_blocks]
        kvh, d = self.num_kv_heads, self.head_dim
        ki = k_cache[ids].view(-1, kvh, d)[:seq_len].transpose(0, 1)
        vi = v_cache[ids].view(-1, kvh, d)[:seq_len].transpose(0, 1)
        return ki, vi

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """All single-token queries at once: gather each sequence's blocks padded to the longest,
        mask the padding, and attend per KV head with the query heads of its group stacked.
        The math runs in fp32: at these tiny shapes bf16 matmuls are slower on CPU, not faster."""
        nd = q.shape[0]
        kvh, d, g = self.num_kv_heads, self.head_dim, self.group
        assert meta.decode_mask is not None
        max_len = meta.decode_mask.shape[-1]
        ids = meta.block_tables[:nd, : max_len // meta.block_size].reshape(-1)
        keys = k_cache.index_select(0, ids).view(nd, max_len, kvh, d).transpose(1, 2).float()
        values = v_cache.index_select(0, ids).view(nd, max_len, kvh, d).transpose(1, 2).float()
        qg = q.view(nd, kvh, g, d).float()
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scale + meta.decode_mask  # [nd, kvh, g, L]
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, values).reshape(nd, kvh * g * d).to(q.dtype)
