"""The throughput a run cannot beat on this host: its arithmetic (counted from the model's shapes)
at the host's measured peak.

``run_flops`` counts what an offline run must compute whatever the engine: every decoder linear for
each token fed through the model (the prompt, then each output token but the last), the lm_head for
each sampled token, and causal attention (QK^T and PV) over every fed token's context. Decode
attention's KV reads (a bandwidth cost) are left out, so the ceiling is generous.

The peak, per kernel level (kernels/cpu/isa.py): each thread runs independent chains of the
instruction that level's linear kernels are built on, on registers only (no loads, no dependencies
between chains), so it runs at the units' throughput:

- ``avx512_bf16``: ``vdpbf16ps`` (32 bf16 products summed into 16 fp32 lanes, 64 FLOP) and
  ``vpdpbusd`` (64 u8 x s8 products into 16 int32 lanes, 128 ops);
- ``avx2``: ``vfmadd231ps`` on 8 fp32 lanes (16 FLOP; bf16 runs as fp32 after widening) and
  ``vpmaddwd`` + ``vpaddd`` on 16 int16 products (32 ops).

A C file per level compiled by the system's compiler with that level's flags and called through
ctypes (no torch headers: it builds in well under a second).

    python -m loadtests.ceiling                     # this host's peaks at its best level
    LLMSERVE_CPU_ISA=avx2 python -m loadtests.ceiling  # ... at the AVX2 level
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import subprocess
import tempfile

from kernels.cpu import isa
from shared.engine.memory import decoder_linear_shapes
from shared.engine.models.config import ModelConfig

_HEADER = r"""
#include <immintrin.h>
#include <omp.h>

"""

# Each function: (iters, threads) -> G(FL)OP/s, or -1 if its sums came out wrong.
_SOURCES = {
    "avx512_bf16": (
        ["-mavx512f", "-mavx512bw", "-mavx512bf16", "-mavx512vnni"],
        r"""
/* 16 independent accumulators: enough chains to hide the instruction's latency (5-6 cycles) at
   up to two issues per cycle, with registers to spare (32 zmm). */
#define CHAINS 16

double bf16_peak(long iters, int threads) {
  double t0 = 0, t1 = 0, sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m512 acc[CHAINS];
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_setzero_ps();
    const __m512bh one = (__m512bh)_mm512_set1_epi16(0x3f80);  /* bf16 1.0: sums stay exact */
#pragma omp barrier
#pragma omp master
    t0 = omp_get_wtime();
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
      for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], one, one);
    }
#pragma omp barrier
#pragma omp master
    t1 = omp_get_wtime();
    for (int i = 0; i < CHAINS; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  }
  /* Each lane adds 2 per iteration: exact in fp32 below 2^23 iterations. */
  if (sink != (double)threads * CHAINS * 16 * 2 * iters) return -1.0;
  return 64.0 * CHAINS * (double)iters * threads / (t1 - t0) / 1e9;
}

double int8_peak(long iters, int threads) {
  double t0 = 0, t1 = 0;
  long sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m512i acc[CHAINS];
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_setzero_si512();
    const __m512i one = _mm512_set1_epi8(1);
#pragma omp barrier
#pragma omp master
    t0 = omp_get_wtime();
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
      for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], one, one);
    }
#pragma omp barrier
#pragma omp master
    t1 = omp_get_wtime();
    for (int i = 0; i < CHAINS; ++i) sink += _mm512_reduce_add_epi32(acc[i]);
  }
  if (sink != (long)threads * CHAINS * 16 * 4 * iters) return -1.0;
  return 128.0 * CHAINS * (double)iters * threads / (t1 - t0) / 1e9;
}
""",
    ),
    "avx2": (
        ["-mavx2", "-mfma"],
        r"""
/* 12 chains: 16 ymm registers hold them and the constant operand without spilling; 12 still hide
   a 4-cycle latency at two issues per cycle. */
#define CHAINS 12

static double hsum(__m256 v) {
  float x[8];
  _mm256_storeu_ps(x, v);
  return (double)x[0] + x[1] + x[2] + x[3] + x[4] + x[5] + x[6] + x[7];
}

double bf16_peak(long iters, int threads) {  /* fp32 FMA: what bf16 runs as at this level */
  double t0 = 0, t1 = 0, sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m256 acc[CHAINS];
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_setzero_ps();
    const __m256 one = _mm256_set1_ps(1.f);
#pragma omp barrier
#pragma omp master
    t0 = omp_get_wtime();
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_fmadd_ps(one, one, acc[i]);
    }
#pragma omp barrier
#pragma omp master
    t1 = omp_get_wtime();
    for (int i = 0; i < CHAINS; ++i) sink += hsum(acc[i]);
  }
  if (sink != (double)threads * CHAINS * 8 * iters) return -1.0;
  return 16.0 * CHAINS * (double)iters * threads / (t1 - t0) / 1e9;
}

double int8_peak(long iters, int threads) {  /* int16 pair products, as the AVX2 int8 linear runs */
  double t0 = 0, t1 = 0;
  long sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m256i acc[CHAINS];
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_setzero_si256();
    const __m256i one = _mm256_set1_epi16(1);
#pragma omp barrier
#pragma omp master
    t0 = omp_get_wtime();
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < CHAINS; ++i)
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(one, one));
    }
#pragma omp barrier
#pragma omp master
    t1 = omp_get_wtime();
    int x[8];
    for (int i = 0; i < CHAINS; ++i) {
      _mm256_storeu_si256((__m256i*)x, acc[i]);
      for (int j = 0; j < 8; ++j) sink += x[j];
    }
  }
  if (sink != (long)threads * CHAINS * 8 * 2 * iters) return -1.0;
  return 32.0 * CHAINS * (double)iters * threads / (t1 - t0) / 1e9;
}
""",
    ),
}


def peak_level() -> str:
    """The level whose peak a ceiling uses: the one the kernels run at here (``LLMSERVE_CPU_ISA``
    caps it), measured with the instructions of the nearest level below that has a
    microbenchmark."""
    best = isa.best_level()
    if best is None:
        raise RuntimeError("no kernel level runs on this CPU: " + isa.why_not(isa.LEVELS[0]))
    names = [lv.name for lv in isa.LEVELS]
    return next(n for n in reversed(names[: names.index(best.name) + 1]) if n in _SOURCES)


@functools.cache
def _library(level: str) -> ctypes.CDLL:
    flags, body = _SOURCES[level]
    with tempfile.TemporaryDirectory(prefix="llmserve_peak_") as build:  # loaded, the file can go
        src, lib = os.path.join(build, "peak.c"), os.path.join(build, "peak.so")
        with open(src, "w") as f:
            f.write(_HEADER + body)
        cmd = [
            os.environ.get("CC", "cc"),
            "-O2",
            *flags,
            "-fopenmp",
            "-shared",
            "-fPIC",
            src,
            "-o",
            lib,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:  # no compiler
            raise RuntimeError(f"could not build the peak microbenchmark: {exc}") from exc
        if proc.returncode != 0:
            raise RuntimeError(
                f"could not build the peak microbenchmark ({' '.join(cmd)}): {proc.stderr.strip()}"
            )
        dll = ctypes.CDLL(lib)
    for name in ("bf16_peak", "int8_peak"):
        fn = getattr(dll, name)
        fn.argtypes, fn.restype = [ctypes.c_long, ctypes.c_int], ctypes.c_double
    return dll


def _best_rate(fn, threads: int, repeats: int) -> float:
    rates = [fn(4_000_000, threads) for _ in range(repeats)]  # tens of ms a run
    if min(rates) <= 0:
        raise RuntimeError("the peak microbenchmark's sums came out wrong")
    return max(rates)  # noise (another process, a busy sibling vCPU) only ever slows a run down


def _peak(fn, threads: int, repeats: int) -> float:
    """The larger of `threads` x the best single-thread rate and the best rate of `threads` threads
    at once: no run of `threads` threads beats every one of them at its own peak, so this bounds the
    host from above even where threads share a core."""
    return max(threads * _best_rate(fn, 1, repeats), _best_rate(fn, threads, repeats))


def bf16_peak_gflops(threads: int, repeats: int = 20, level: str | None = None) -> float:
    """bf16 GFLOP/s on `threads` threads at `level` (default: ``peak_level()``)."""
    return _peak(_library(level or peak_level()).bf16_peak, threads, repeats)


def int8_peak_gops(threads: int, repeats: int = 20, level: str | None = None) -> float:
    """int8 GOPS (multiply + add) on `threads` threads at `level` (default: ``peak_level()``)."""
    return _peak(_library(level or peak_level()).int8_peak, threads, repeats)


def run_flops(cfg: ModelConfig, prompt_lens: list[int], output_len: int) -> dict[str, float]:
    """FLOPs of generating `output_len` tokens after each prompt, by part."""
    h, hd, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    params_per_layer = sum(n * k for n, k in decoder_linear_shapes(cfg))  # QKV, O, gate-up, down
    fed = [n + output_len - 1 for n in prompt_lens]  # the last sampled token is never fed back
    # The token at position p attends p + 1 keys: 2 * head_dim FLOPs per key for QK^T, as many for
    # PV.
    attended = sum(m * (m + 1) // 2 for m in fed)
    return dict(
        decoder_linears=2.0 * params_per_layer * layers * sum(fed),
        lm_head=2.0 * cfg.vocab_size * h * len(prompt_lens) * output_len,
        attention=4.0 * cfg.num_heads * hd * layers * attended,
    )


def ceiling_seconds(
    flops: dict[str, float], bf16_gflops: float, int8_gops: float | None = None
) -> float:
    """Least time for `flops` with every part at peak: bf16, or the decoder linears in int8 when
    `int8_gops` is given (W8A8; the lm_head and attention stay bf16)."""
    linears = flops["decoder_linears"] / ((int8_gops or bf16_gflops) * 1e9)
    return linears + (flops["lm_head"] + flops["attention"]) / (bf16_gflops * 1e9)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    top = peak_level()
    levels = [n for n in _SOURCES if isa.LEVEL_NAMES.index(n) <= isa.LEVEL_NAMES.index(top)]
    for level in sorted(levels, key=isa.LEVEL_NAMES.index):
        lib = _library(level)
        for threads in sorted({1, args.threads}):
            print(
                f"{level:<12} {threads} thread(s) at once, best of 20: "
                f"bf16 {_best_rate(lib.bf16_peak, threads, 20):7.1f} GFLOP/s   "
                f"int8 {_best_rate(lib.int8_peak, threads, 20):7.1f} GOPS"
            )
    print(
        f"peak used for ceilings ({top}, {args.threads} threads): "
        f"bf16 {bf16_peak_gflops(args.threads):7.1f} GFLOP/s   "
        f"int8 {int8_peak_gops(args.threads):7.1f} GOPS"
    )


if __name__ == "__main__":
    main()
