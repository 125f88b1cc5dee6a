"""The CPU kernels on their own, at SmolLM2-135M's shapes over all 30 layers (each layer its own
weights and cache, so the data comes from DRAM as in a real step, not from a warm L3).

  - decode attention: B sequences x ``--context`` tokens, blocks shuffled through a pool on huge
    pages (as the engine's); ms and the K/V bytes read per second (``--kv-cache-dtype int8`` or
    ``fp8``: the caches in the engine's int8 or e4m3 layout, rows with their scales); and "cached":
    the same calls with every sequence reading one layer's first blocks, which stay in L2, so what
    is left is the kernel's compute;
  - prefill attention: fresh prompts of 512, 300, 450, 200 and 586 tokens (2,048) in one call; ms
    and GFLOP/s over the causal half (what has to be computed);
  - linear: the four layer matmuls (QKV, O, gate-up, down) at M rows, ``linear_bf16`` on its packed
    weight vs oneDNN on its own (the two layouts ``PackedLinear`` can hold), and ``linear_int8``
    (W8A8, input quantized in the call, as ``Int8Linear`` runs it); ms and GFLOP/s. oneDNN only
    where it runs bf16 (not below the avx512 level).

Each figure is the median of ``--repeats`` timed runs after one warm-up, at the level the kernels
run at here (``LLMSERVE_CPU_ISA=avx2`` for the AVX2 kernels); past figures are in
``loadtests/RESULTS.md``.

    python -m loadtests.bench_kernels [--dtype bfloat16] \\
        [--out loadtests/results/bench_kernels.json]
    python -m loadtests.bench_kernels --kv-cache-dtype int8 --rows 1 \\
        --out loadtests/results/bench_kernels_kv_int8.json
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from kernels.cpu import cpu_ops, isa
from loadtests.results import write_json
from shared.engine import huge_pages
from shared.engine.kv_cache import to_cache_rows
from shared.engine.memory import decoder_linear_shapes
from shared.engine.models.known_configs import KNOWN_CONFIGS
from shared.engine.quantization import KV_CACHE_DTYPES
from shared.engine.quantize_rows import quantize_rows

DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "bench_kernels.json"
)
# 30 layers, 9 query heads sharing 3 KV heads of 64, hidden 576
SMOLLM2 = KNOWN_CONFIGS["smollm2-135m"]
LAYERS, HEADS, KV_HEADS, HEAD_DIM = (
    SMOLLM2.num_layers,
    SMOLLM2.num_heads,
    SMOLLM2.num_kv_heads,
    SMOLLM2.head_dim,
)
LINEARS = decoder_linear_shapes(SMOLLM2)  # (out, in): QKV, O, gate-up, down
BLOCK = 16
# The cache tensor per --kv-cache-dtype that is not the data's (the engine's layouts: kv_cache)
_CACHE_TENSOR_DTYPES = {"int8": torch.int8, "fp8": torch.uint8}
PROMPTS = [512, 300, 450, 200, 586]


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def paged_caches(num_blocks: int, dtype: torch.dtype, g: torch.Generator, kv_cache_dtype: str):
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)

    def cache() -> torch.Tensor:
        x = torch.randn(shape, generator=g).to(dtype)
        x = to_cache_rows(x, _CACHE_TENSOR_DTYPES.get(kv_cache_dtype, dtype))
        return huge_pages.zeros(tuple(x.shape), x.dtype).copy_(x)

    return [(cache(), cache()) for _ in range(LAYERS)]


def shuffled_tables(lengths: list[int], num_blocks: int) -> torch.Tensor:
    ids = list(range(num_blocks))
    random.Random(0).shuffle(ids)
    tables, used = [], 0
    for n in lengths:
        nb = -(-n // BLOCK)
        tables.append(ids[used : used + nb])
        used += nb
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])


def bench_decode(ops, dtype, batch: int, context: int, repeats: int, kv_cache_dtype: str) -> dict:
    g = torch.Generator().manual_seed(0)
    num_blocks = batch * -(-context // BLOCK)
    caches = paged_caches(num_blocks, dtype, g, kv_cache_dtype)
    tables = shuffled_tables([context] * batch, num_blocks)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, HEADS * HEAD_DIM, generator=g).to(dtype)
    scale = 1 / math.sqrt(HEAD_DIM)
    ms = median_ms(
        lambda: [ops.decode_attention(q, k, v, tables, lens, HEADS, scale) for k, v in caches],
        repeats,
    )
    # every sequence: blocks 0, 1, ... of layer 0
    cached_tables = torch.arange(tables.shape[1]).repeat(batch, 1)
    k0, v0 = caches[0]
    cached_ms = median_ms(
        lambda: [
            ops.decode_attention(q, k0, v0, cached_tables, lens, HEADS, scale)
            for _ in range(LAYERS)
        ],
        repeats,
    )
    row_bytes = caches[0][0].shape[-1] * caches[0][0].element_size()  # int8/fp8: values and scale
    kv_bytes = LAYERS * batch * context * KV_HEADS * row_bytes * 2
    return dict(
        batch=batch,
        context=context,
        ms=ms,
        cached_ms=cached_ms,
        kv_mb=kv_bytes / 1e6,
        gb_per_s=kv_bytes / ms / 1e6,
    )


def bench_prefill(ops, dtype, repeats: int, kv_cache_dtype: str) -> dict:
    g = torch.Generator().manual_seed(1)
    num_blocks = sum(-(-n // BLOCK) for n in PROMPTS)
    caches = paged_caches(num_blocks, dtype, g, kv_cache_dtype)
    tables = shuffled_tables(PROMPTS, num_blocks)
    starts = torch.tensor([0, *itertools.accumulate(PROMPTS)])
    lens = torch.tensor(PROMPTS)
    q = torch.randn(sum(PROMPTS), HEADS * HEAD_DIM, generator=g).to(dtype)
    scale = 1 / math.sqrt(HEAD_DIM)

    def run() -> None:  # each output dropped at once, as a forward drops it (see bench_linear)
        for k, v in caches:
            ops.prefill_attention(q, k, v, tables, starts, lens, HEADS, scale)

    ms = median_ms(run, repeats)
    # QK^T and PV over each query's keys up to itself: 2 matmuls x 2 FLOPs per multiply-add.
    flops = LAYERS * HEADS * sum(n * (n + 1) / 2 for n in PROMPTS) * HEAD_DIM * 4
    return dict(tokens=sum(PROMPTS), ms=ms, gflops=flops / ms / 1e6)


def bench_linear(ops, rows: list[int], repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    weights = [
        [torch.randn(n, k, generator=g).bfloat16() for n, k in LINEARS] for _ in range(LAYERS)
    ]
    # the CPU's (or the cap's) oneDNN bf16, as a baseline
    onednn = isa.onednn_usable(torch.bfloat16)
    packed = (
        [[torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in layer] for layer in weights]
        if onednn
        else []
    )
    ours_packed = [[ops.pack_linear_bf16(w) for w in layer] for layer in weights]
    int8: list[list[tuple[torch.Tensor, ...]]] = []
    for layer in weights:
        int8.append([])
        for w in layer:
            q, scale = quantize_rows(w.float())
            int8[-1].append(
                (
                    ops.pack_linear_int8(q),
                    scale,
                    q.sum(1, dtype=torch.int32),
                    torch.ones(w.shape[1]),
                )
            )
    flops_per_row = 2 * LAYERS * sum(n * k for n, k in LINEARS)
    out = []
    for m in rows:
        xs = [torch.randn(m, k, generator=g).bfloat16() for _, k in LINEARS]

        # Each output is dropped as the next call runs, as in a forward: kept alive, 120 of them
        # would be fresh memory every run, and its page faults would be timed as the kernel's.
        def layers_ms(
            layers: list[list[Any]],
            call: Callable[[torch.Tensor, Any, int], object],
            xs: list[torch.Tensor] = xs,
        ) -> float:
            def run() -> None:
                for layer in layers:
                    for x, w, (n, _) in zip(xs, layer, LINEARS, strict=True):
                        call(x, w, n)

            return median_ms(run, repeats)

        ours = layers_ms(ours_packed, lambda x, w, n: ops.linear_bf16(x, w, n, None))
        row = dict(rows=m, linear_bf16_ms=ours, linear_bf16_gflops=flops_per_row * m / ours / 1e6)
        if onednn:
            ms = layers_ms(
                packed,
                lambda x, w, n: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
            )
            row.update(onednn_packed_ms=ms, onednn_gflops=flops_per_row * m / ms / 1e6)
        ms = layers_ms(int8, lambda x, w, n: ops.linear_int8(x, *w, None))
        row.update(linear_int8_ms=ms, linear_int8_gops=flops_per_row * m / ms / 1e6)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="attention data"
    )
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="attention caches"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--context", type=int, default=400, help="decode: tokens per sequence")
    p.add_argument("--batches", default="1,8,32", help="decode: sequences per call")
    p.add_argument("--rows", default="1,4,8,16,32,64,512,2048", help="linear: input rows")
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    ops = cpu_ops()
    if ops is None:
        print("CPU kernels unavailable (see `python -m kernels.cpu`)", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    best = isa.best_level()
    assert best is not None  # cpu_ops() found kernels, so a level runs here
    res: dict = dict(
        isa=best.name,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        threads=args.threads,
        repeats=args.repeats,
        layers=LAYERS,
    )
    print(
        f"bench_kernels  {res['isa']}  {args.dtype}  kv cache {args.kv_cache_dtype}  "
        f"threads={args.threads}  "
        f"SmolLM2-135M shapes x {LAYERS} layers  load avg {os.getloadavg()[0]:.2f}"
    )
    res["decode_attention"] = []
    for b in (int(x) for x in args.batches.split(",")):
        r = bench_decode(ops, dtype, b, args.context, args.repeats, args.kv_cache_dtype)
        res["decode_attention"].append(r)
        print(
            f"  decode attention  B={b:<3} context {args.context}: {r['ms']:7.2f} ms  "
            f"({r['kv_mb']:.0f} MB of K/V, {r['gb_per_s']:.1f} GB/s); "
            f"cached {r['cached_ms']:7.2f} ms"
        )
    r = res["prefill_attention"] = bench_prefill(ops, dtype, args.repeats, args.kv_cache_dtype)
    print(
        f"  prefill attention {r['tokens']} new tokens in {len(PROMPTS)} prompts: "
        f"{r['ms']:7.1f} ms  "
        f"({r['gflops']:.0f} GFLOP/s causal)"
    )
    res["linear"] = bench_linear(ops, [int(x) for x in args.rows.split(",")], args.repeats)
    for r in res["linear"]:
        onednn = (
            f"   oneDNN {r['onednn_packed_ms']:8.2f} ms ({r['onednn_gflops']:3.0f} GFLOP/s)   "
            f"{r['onednn_packed_ms'] / r['linear_bf16_ms']:.2f}x"
            if "onednn_packed_ms" in r
            else ""
        )
        print(
            f"  linear M={r['rows']:<5} linear_bf16 {r['linear_bf16_ms']:8.2f} ms "
            f"({r['linear_bf16_gflops']:3.0f} GFLOP/s){onednn}   "
            f"linear_int8 {r['linear_int8_ms']:8.2f} ms ({r['linear_int8_gops']:3.0f} GOP/s, "
            f"{r['linear_bf16_ms'] / r['linear_int8_ms']:.2f}x bf16)"
        )
    print(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
