"""GGUF block-quantized linears run in their packed form: ``quantization="gguf"`` (and "int4").

Why: decode streams every weight once per step. The default model ships as Q4_1 (5 bits a weight:
32 4-bit values, an fp16 scale and an fp16 min per block); dequantized to bf16 at load it is 16
bits a weight. Here the decoder linears whose GGUF tensors are Q4_0, Q4_1 or Q8_0 keep their blocks
and run on the kernels' ``linear_gguf``, and so does the output head where its tensor is in one of
these formats; everything else (the embedding, norms, tensors in other formats such as Q6_K or F16)
loads as before, dequantized to the model dtype. SmolLM2 ties its head to the Q8_0 embedding: in
bf16 that head is 57 MB a step, nearly the 66 MB of all its Q4_1 decoder linears; on its blocks,
30 MB. A tied head's blocks come beside the embedding, which stays for the token lookups.

The scheme is llama.cpp's: each call quantizes its input per row and 32-block to int8 (``dx =
max|x| / 127``, round half to even), so a block's dot product is an exact integer sum scaled by the
two block scales. ``kernels/cpu/csrc/linear_gguf.h`` draws the packed layout (panels of 16 output
rows; the order of the bytes is the kernels' concern, the blocks' values are the file's, bit for
bit: ``unpack_blocks`` recovers them and ``dequantize_blocks`` equals ``gguf.quants.dequantize``).
``quantize_model_int4`` makes the same blocks from any checkpoint at load.

``gguf_linear_reference`` is the same maths in torch (exact integer sums in fp64): what the kernel
is tested against, and what a layer runs with the kernels switched off (slow: the engine refuses
``gguf`` without them, as it refuses ``int8``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from torch import nn

from shared.engine.quantization import GGUF_BLOCK as BLOCK
from shared.engine.quantization import GGUF_BLOCK_BYTES as BLOCK_BYTES
from shared.engine.quantization import GGUF_LINEAR_PARTS, INT4_HEAD_FORMAT, INT4_LINEAR_FORMAT
from shared.engine.quantization import GGUF_PANEL_ROWS as PANEL_ROWS

if TYPE_CHECKING:
    from shared.engine.models.runtime import ModelRuntime

FORMATS = tuple(BLOCK_BYTES)
# The zero point subtracted from a block's unsigned quants: Q4_0 holds q - 8, Q8_0 is held offset
# by 128 (u = q + 128) so that every format's quants are unsigned bytes for the kernels.
_ZERO = {"q4_0": 8, "q4_1": 0, "q8_0": 128}


def _units(fmt: str) -> int:
    """64-byte units per block and panel: 16 rows x 32 quants at 4 (Q4) or 8 (Q8) bits."""
    return 8 if fmt == "q8_0" else 4


def unpack_gguf_rows(
    raw: np.ndarray, fmt: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A GGUF tensor's rows of blocks (uint8 [out, blocks x BLOCK_BYTES]) -> (q uint8 [out, in]:
    the unsigned quants, Q8_0 offset by 128; d fp16 [out, blocks]; m fp16 [out, blocks] for Q4_1,
    else None)."""
    if fmt not in BLOCK_BYTES:
        raise ValueError(f"unknown GGUF block format {fmt!r}; known: {', '.join(FORMATS)}")
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, BLOCK_BYTES[fmt])
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    m = (
        torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
        if fmt == "q4_1"
        else None
    )
    if fmt == "q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).to(torch.int16) + 128
        return q.to(torch.uint8).reshape(rows, -1), d, m
    packed = torch.from_numpy(blocks[..., 4 if fmt == "q4_1" else 2 :].copy())  # [rows, b, 16]
    # ggml: byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1)
    return q.reshape(rows, -1), d, m


def dequantize_blocks(
    q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, fmt: str
) -> torch.Tensor:
    """The fp32 weight [out, in] the blocks hold, as ``gguf.quants.dequantize`` computes it."""
    rows = q.shape[0]
    qi = (q.to(torch.int32) - _ZERO[fmt]).reshape(rows, -1, BLOCK).float()
    w = qi * d.float().unsqueeze(-1)
    if m is not None:
        w = w + m.float().unsqueeze(-1)
    return w.reshape(rows, -1)


def pack_blocks(
    q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, fmt: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q, d, m) of ``unpack_gguf_rows`` -> the kernels' panels (qs uint8 [panels, blocks, units,
    64], scales fp16 [panels, blocks, 16], mins likewise or None); rows padded to a multiple of 16
    with zeros."""
    rows, k = q.shape
    if k % BLOCK:
        raise ValueError(f"GGUF blocks need in_features divisible by {BLOCK}, got {k}")
    pad = -rows % PANEL_ROWS
    panels, blocks = (rows + pad) // PANEL_ROWS, k // BLOCK

    def rows_padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t

    qp = rows_padded(q)
    if fmt == "q8_0":  # unit t of block b, row r: u[r][32b + 4t .. 32b + 4t + 3]
        units = qp.reshape(panels, PANEL_ROWS, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    else:  # unit o: low nibbles q[r][32b + 8o .. +3], high nibbles q[r][32b + 8o + 4 .. +7]
        o = qp.reshape(panels, PANEL_ROWS, blocks, 4, 2, 4)
        units = (o[..., 0, :] | (o[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
    qs = units.reshape(panels, blocks, _units(fmt), 64).contiguous()

    def per_panel(t: torch.Tensor) -> torch.Tensor:
        return rows_padded(t).reshape(panels, PANEL_ROWS, blocks).permute(0, 2, 1).contiguous()

    return qs, per_panel(d), None if m is None else per_panel(m)


def unpack_blocks(
    qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, fmt: str, out_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of ``pack_blocks``: (q, d, m) for the first ``out_features`` rows."""
    panels, blocks = qs.shape[:2]
    rows = panels * PANEL_ROWS
    if fmt == "q8_0":
        q = qs.reshape(panels, blocks, 8, PANEL_ROWS, 4).permute(0, 3, 1, 2, 4)
    else:
        u = qs.reshape(panels, blocks, 4, PANEL_ROWS, 4)
        q = torch.stack([u & 0x0F, u >> 4], dim=-2).permute(0, 3, 1, 2, 4, 5)
    q = q.reshape(rows, blocks * BLOCK)[:out_features].contiguous()

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t.permute(0, 2, 1).reshape(rows, blocks)[:out_features].contiguous()

    return q, per_row(scales), None if mins is None else per_row(mins)


def quantize_input_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, in] -> (xq int8 [rows, blocks, 32], dx fp32 [rows, blocks], sx int32 [rows,
    blocks]): symmetric int8 per 32-block, ``xq = round(x * (127 / max|x|))`` half to even, ``dx =
    max|x| / 127`` (0 for an all-zero block), and each block's sum of quants; the kernels' rounding
    bit for bit. (``127 / max|x|`` is an IEEE division of two tensors: torch computes ``127.0 /
    tensor`` as a reciprocal times 127, which can differ in the last bit and move a product that is
    exactly half an integer to the other side.)"""
    rows, k = x.shape
    v = x.float().reshape(rows, k // BLOCK, BLOCK)
    amax = v.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(v * inv.unsqueeze(-1)).to(torch.int8)
    return xq, amax / 127.0, xq.sum(dim=-1, dtype=torch.int32)


def gguf_linear_reference(
    x: torch.Tensor,
    qs: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    fmt: str,
    out_features: int,
    bias: torch.Tensor | None,
    rows_per_chunk: int = 64,
) -> torch.Tensor:
    """``linear_gguf`` in torch: ``y = sum_b d dx (q - z) . xq [+ m dx sx] (+ bias)`` with exact
    integer block sums (fp64); the output rounds once, to x's dtype. The kernel sums the blocks in
    fp32 (one product and one fused multiply-add each), so the two differ by fp32 rounding."""
    q, d, m = unpack_blocks(qs, scales, mins, fmt, out_features)
    n, k = q.shape
    w = (q.to(torch.int16) - _ZERO[fmt]).reshape(n, k // BLOCK, BLOCK).permute(1, 2, 0).double()
    d64 = d.double().T.unsqueeze(1)  # [blocks, 1, n]
    m64 = None if m is None else m.double().T.unsqueeze(1)
    out = []
    for chunk in x.reshape(-1, k).split(rows_per_chunk):
        xq, dx, sx = quantize_input_blocks(chunk)
        sums = torch.bmm(xq.permute(1, 0, 2).double(), w)  # [blocks, rows, n], exact
        dxt = dx.double().T.unsqueeze(-1)  # [blocks, rows, 1]
        y = (sums * d64 * dxt).sum(0)
        if m64 is not None:
            y = y + (m64 * (dxt * sx.double().T.unsqueeze(-1))).sum(0)
        if bias is not None:
            y = y + bias.double()
        out.append(y)
    if not out:
        return x.new_empty(0, n)
    return torch.cat(out).to(x.dtype)


class GGUFLinear(nn.Module):
    """A linear layer holding GGUF blocks (``fmt``: q4_0, q4_1 or q8_0) in the kernels' panels.
    ``q``, ``d``, ``m``: the blocks' values as ``unpack_gguf_rows`` gives them. ``ops``: the CPU
    kernel namespace (any level: the layout is the same at each), else None (torch reference)."""

    def __init__(
        self,
        q: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor | None,
        fmt: str,
        bias: torch.Tensor | None = None,
        ops=None,
    ) -> None:
        super().__init__()
        if fmt not in BLOCK_BYTES:
            raise ValueError(f"unknown GGUF block format {fmt!r}; known: {', '.join(FORMATS)}")
        if (m is not None) != (fmt == "q4_1"):
            raise ValueError(f"{fmt} blocks {'need' if fmt == 'q4_1' else 'have no'} mins")
        self.format = fmt
        self.out_features, self.in_features = q.shape
        self.qs, self.scales, self.mins = pack_blocks(q, d, m, fmt)
        self.bias = None if bias is None else bias.detach().clone()
        self.ops = ops

    def use_cpu_kernels(self, ops) -> None:
        """Run on the kernels' GGUF linear (``ops``, any level) or on the torch reference; the
        layout is the same for both."""
        self.ops = ops

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q, d, m) as ``unpack_gguf_rows`` gave them, bit for bit."""
        return unpack_blocks(self.qs, self.scales, self.mins, self.format, self.out_features)

    def row_major(self) -> torch.Tensor:
        """The dequantized fp32 weight [out_features, in_features]."""
        return dequantize_blocks(*self.blocks(), self.format)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(x.reshape(-1, self.in_features).contiguous()).view(
            *x.shape[:-1], self.out_features
        )

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` for x [rows, in_features], contiguous: no reshaping on the way."""
        if self.ops is not None:
            return self.ops.linear_gguf(
                x, self.qs, self.scales, self.mins, self.format, self.out_features, self.bias
            )
        return gguf_linear_reference(
            x, self.qs, self.scales, self.mins, self.format, self.out_features, self.bias
        )

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds (for memory accounting)."""
        return [t for t in (self.qs, self.scales, self.mins, self.bias) if t is not None]

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, format={self.format}"


def native_linears(
    reader, config, dtype: torch.dtype
) -> tuple[dict[str, GGUFLinear], frozenset[str]]:
    """The linears of a GGUF file that run on their blocks: {module path under the model
    (``layers.3.mlp.down_proj``; ``lm_head`` for the output head): layer}, and the Hugging Face
    names of the tensors they took (the loader skips those; a tied head takes nothing: the
    embedding still loads). A fused linear is native when all its parts share one block format; Q
    and K rows get the loader's RoPE row permutation, applied to the blocks. Biases load in
    ``dtype``."""
    from shared.engine.models.gguf_loader import (
        hf_name,
        native_format,
        read_tensor,
        rope_permuted,
        tensor_rows,
        unpermute_rope_rows,
    )

    tensors = {t.name: t for t in reader.tensors}
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    permute = rope_permuted(config)
    layers: dict[str, GGUFLinear] = {}
    taken: set[str] = set()
    for i in range(config.num_layers):
        for path, parts in GGUF_LINEAR_PARTS:
            found = [tensors.get(f"blk.{i}.{part}.weight") for part in parts]
            formats = {None if t is None else native_format(t) for t in found}
            if len(formats) != 1 or None in formats:
                continue
            fmt = formats.pop()
            assert fmt is not None
            qs, ds, ms, biases = [], [], [], []
            for part, t in zip(parts, found, strict=True):
                assert t is not None
                q, d, m = unpack_gguf_rows(tensor_rows(t), fmt)
                bias_tensor = tensors.get(f"blk.{i}.{part}.bias")
                b = None if bias_tensor is None else read_tensor(bias_tensor)
                if permute and part in heads:
                    q, d = unpermute_rope_rows(q, heads[part]), unpermute_rope_rows(d, heads[part])
                    m = None if m is None else unpermute_rope_rows(m, heads[part])
                    b = None if b is None else unpermute_rope_rows(b, heads[part])
                qs.append(q)
                ds.append(d)
                ms.append(m)
                biases.append(b)
                taken.add(hf_name(t.name) or "")
                if bias_tensor is not None:
                    taken.add(hf_name(bias_tensor.name) or "")
            if any(b is None for b in biases) != all(b is None for b in biases):
                raise ValueError(f"layer {i}: {path} has a bias on some of its parts only")
            bias = None if biases[0] is None else torch.cat(biases).to(dtype)  # type: ignore[arg-type]
            mins = None if ms[0] is None else torch.cat(ms)  # type: ignore[arg-type]
            layers[f"layers.{i}.{path}"] = GGUFLinear(torch.cat(qs), torch.cat(ds), mins, fmt, bias)
    head = tensors.get("token_embd.weight" if config.tie_word_embeddings else "output.weight")
    if head is not None and (fmt := native_format(head)) is not None:
        layers["lm_head"] = GGUFLinear(*unpack_gguf_rows(tensor_rows(head), fmt), fmt)
        if not config.tie_word_embeddings:
            taken.add(hf_name(head.name) or "")
    return layers, frozenset(taken)


def quantize_to_blocks(
    weight: torch.Tensor, fmt: str, bias: torch.Tensor | None = None, ops=None
) -> GGUFLinear:
    """A dense weight [out, in] quantized round-to-nearest into ``fmt`` blocks by the ``gguf``
    package's quantizer (llama.cpp's reference: Q4_1 d = (max - min) / 15 and m = min per 32
    weights, Q8_0 d = max|w| / 127), as a ``GGUFLinear``. Blocks dequantized from a GGUF file come
    back as the file's, bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if fmt not in BLOCK_BYTES:
        raise ValueError(f"unknown GGUF block format {fmt!r}; known: {', '.join(FORMATS)}")
    raw = quantize(weight.detach().float().numpy(), GGMLQuantizationType[fmt.upper()])
    return GGUFLinear(*unpack_gguf_rows(raw, fmt), fmt, bias, ops)


def quantize_model_int4(runtime: ModelRuntime) -> int:
    """``quantization="int4"`` on any checkpoint: every decoder linear of the runtime's model
    quantized group-wise to 4 bits (``INT4_LINEAR_FORMAT``: 32 weights a group with an fp16 scale
    and min, the asymmetric scheme AWQ and GPTQ hold, in groups of 32), the output head to
    ``INT4_HEAD_FORMAT`` (a tied head gets its own blocks; the embedding stays for lookups); all
    run on ``linear_gguf``. Returns how many linears."""
    from shared.engine.models.packed_linear import PackedLinear

    def dense(module: nn.Module) -> torch.Tensor:
        if isinstance(module, PackedLinear):
            return module.row_major()
        return cast(nn.Linear, module).weight

    ops = runtime.backend.ops
    model = runtime.model
    count = 0
    for parent in model.layers.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, (PackedLinear, nn.Linear)):
                layer = quantize_to_blocks(dense(child), INT4_LINEAR_FORMAT, child.bias, ops)
                setattr(parent, name, layer)
                count += 1
    head = model.output_head()
    weight = model.embed_tokens.weight if head is None else dense(head)
    model.lm_head = quantize_to_blocks(weight, INT4_HEAD_FORMAT, None, ops)
    runtime.tied_head = None
    runtime.relocate()
    return count + 1
