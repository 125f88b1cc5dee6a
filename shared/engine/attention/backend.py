"""Attention backends: one interface, driven by the same paged metadata on every device.

The torch backend is the CPU path and the reference every Triton kernel is tested against.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

from shared.engine.attention.metadata import AttentionMetadata
from shared.engine.kv_cache import from_cache_rows, is_scaled_cache, to_cache_rows

# Query rows per score matrix in prefill: bounds its memory at ~(heads × 256 × context × 4 bytes).
_QUERY_SLICE = 256


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim], RoPE applied
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim], RoPE applied
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        # [num_blocks, block_size, num_kv_heads, head_dim (+ 4: int8 or fp8, see kv_cache)]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        """Write k/v into their cache slots, then attend (see ``attend``)."""
        ...

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Attention only: the step's K/V are already in the cache (e.g. written by a fused
        RoPE-and-cache kernel); k/v are still passed for prefill chunks that start from nothing."""
        ...


class TorchAttentionBackend:
    """Attention in torch, or on the CPU kernels when handed their ``ops`` (the caller checks they
    cover the head shape: ``CpuBackend.attention_ops``). With them, CPU attention reads each
    sequence's blocks in place (decodes: instead of gather + padded SDPA; prefill chunks: instead of
    per-sequence fp32 matmuls over a masked square)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, ops=None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)
        if ops is not None and not ops.attention_supports(num_heads, num_kv_heads, head_dim):
            raise ValueError(
                f"the {ops.name} attention kernels do not cover {num_heads} heads, "
                f"{num_kv_heads} KV heads of {head_dim}"
            )
        self.ops = ops

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        kvh, d = self.num_kv_heads, self.head_dim
        # Write first: a sequence's new tokens attend to themselves through the cache.
        for x, cache in ((k, k_cache), (v, v_cache)):
            rows = to_cache_rows(x.view(-1, kvh, d), cache.dtype)
            cache.view(-1, kvh, cache.shape[-1]).index_copy_(0, meta.slot_mapping, rows)
        return self.attend(q, k, v, k_cache, v_cache, meta)

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = q.shape[0]
        nd = meta.num_decodes
        if nd == num_tokens:
            return self._decode(q, k_cache, v_cache, meta)  # a pure decode step: no scatter needed
        if self.ops is not None and q.device.type == "cpu":
            # Every prefill chunk in one call, reading the cache in place (K/V were written first).
            prefill = self.ops.prefill_attention(
                q[nd:].contiguous(),
                k_cache,
                v_cache,
                meta.block_tables[nd:],
                meta.prefill_query_start,
                meta.prefill_seq_lens,
                self.num_heads,
                self.scale,
            )
            return (
                torch.cat([self._decode(q[:nd], k_cache, v_cache, meta), prefill])
                if nd
                else prefill
            )
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        for i in range(nd, meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            seq_len = meta.seq_lens[i]
            if seq_len == end - start and not is_scaled_cache(k_cache):
                # Nothing cached before this chunk: its own fresh K/V are all it attends to. (An
                # int8 or fp8 cache is always read back, so a prompt attends to the same values
                # whether its prefix was cached or computed in this chunk.)
                ki, vi = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            else:
                ki, vi = self._gather(k_cache, v_cache, meta.block_tables[i], seq_len, q.dtype)
            out[start:end] = self._prefill(q[start:end], ki, vi, seq_len)
        return out

    def _prefill(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int
    ) -> torch.Tensor:
        """Causal attention of a chunk's queries (the last q_len positions of the sequence) over
        ``keys``/``values`` [kvh, seq_len, d]. Each KV head serves its group's query heads stacked
        as rows of one matmul, in fp32 (on CPU, bf16 SDPA is several times slower than this).
        Queries go in slices so the score matrix stays bounded for long contexts."""
        q_len = q.shape[0]
        kvh, d, g = self.num_kv_heads, self.head_dim, self.group
        keys_t = keys.float().transpose(1, 2)  # [kvh, d, seq_len]
        values = values.float()
        out = torch.empty(q_len, kvh * g * d, dtype=q.dtype, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        for lo in range(0, q_len, _QUERY_SLICE):
            hi = min(q_len, lo + _QUERY_SLICE)
            n = hi - lo
            # [n, h*d] → [kvh, g*n, d]: query heads of one KV group become rows.
            qg = q[lo:hi].reshape(n, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * n, d).float()
            scores = torch.bmm(qg, keys_t).mul_(self.scale).view(kvh, g, n, seq_len)
            # Query at position p (= seq_len - q_len + row) sees keys 0..p.
            query_pos = torch.arange(seq_len - q_len + lo, seq_len - q_len + hi, device=q.device)
            scores.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(kvh, g * n, seq_len)
            o = torch.bmm(probs, values).view(kvh, g, n, d).permute(2, 0, 1, 3)  # [n, kvh, g, d]
            out[lo:hi] = o.reshape(n, kvh * g * d)
        return out

    def _gather(self, k_cache, v_cache, block_table, seq_len, dtype):
        """The sequence's keys and values [kvh, seq_len, d] (an int8 or fp8 cache dequantized to
        ``dtype``)."""
        num_blocks = -(-seq_len // k_cache.shape[1])
        ids = block_table[:num_blocks]
        kvh = self.num_kv_heads
        ki = from_cache_rows(
            k_cache[ids].view(-1, kvh, k_cache.shape[-1])[:seq_len], dtype
        ).transpose(0, 1)
        vi = from_cache_rows(
            v_cache[ids].view(-1, kvh, v_cache.shape[-1])[:seq_len], dtype
        ).transpose(0, 1)
        return ki, vi

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        nd = q.shape[0]
        if self.ops is not None and q.device.type == "cpu":
            return self.ops.decode_attention(
                q.contiguous(),
                k_cache,
                v_cache,
                meta.block_tables[:nd],
                meta.decode_seq_lens,
                self.num_heads,
                self.scale,
            )
        return self._decode_gathered(q, k_cache, v_cache, meta)

    def _decode_gathered(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """All single-token queries at once: gather each sequence's blocks (in the cache dtype, one
        copy; an int8 or fp8 cache then dequantized) padded to the longest, mask the padding, and
        attend per KV head. At batch 32 the gather and any up-cast copy dominate a decode step, so a
        cache in the model dtype is not converted."""
        nd = q.shape[0]
        kvh, d = self.num_kv_heads, self.head_dim
        max_len = meta.decode_mask.shape[-1]
        ids = meta.block_tables[:nd, : max_len // meta.block_size].reshape(-1)
        keys = (
            from_cache_rows(k_cache.index_select(0, ids), q.dtype)
            .view(nd, max_len, kvh, d)
            .transpose(1, 2)
        )
        values = (
            from_cache_rows(v_cache.index_select(0, ids), q.dtype)
            .view(nd, max_len, kvh, d)
            .transpose(1, 2)
        )
        # The g query heads of a KV head go in as g query rows over that head's keys: plain SDPA,
        # no head expansion (SDPA's enable_gqa path was ~3.5x slower here at batch 32).
        out = F.scaled_dot_product_attention(
            q.reshape(nd, kvh, self.group, d),
            keys,
            values,
            attn_mask=meta.decode_mask,
            scale=self.scale,
        )
        return out.reshape(nd, self.num_heads * d)
