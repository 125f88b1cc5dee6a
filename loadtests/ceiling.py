"""The throughput a run cannot beat on this host: its arithmetic (counted from the model's shapes)
at the host's measured peak.

``run_flops`` counts what an offline run must compute whatever the engine: every decoder linear for
each token fed through the model (the prompt, then each output token but the last), the lm_head for
each sampled token, and causal attention (QK^T and PV) over every fed token's context. Decode
attention's KV reads (a bandwidth cost) are left out, so the ceiling is generous.

The peak: each thread runs independent chains of the instruction the linear kernels are built on
(AVX512-BF16 ``vdpbf16ps``: 32 bf16 products summed into 16 fp32 lanes, 64 FLOP; AVX512-VNNI
``vpdpbusd``: 64 u8 x s8 products into 16 int32 lanes, 128 ops) on registers only: no loads, no
dependencies between chains, so it runs at the units' throughput. A C file compiled by the system's
compiler and called through ctypes (no torch headers: it builds in well under a second).

    python -m loadtests.ceiling          # this host's bf16 GFLOP/s and int8 GOPS peaks
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import subprocess
import tempfile

from shared.engine.memory import decoder_linear_shapes
from shared.engine.models.config import ModelConfig

_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>

/* 16 independent accumulators: enough chains to hide the instruction's latency (5-6 cycles) at
   up to two issues per cycle. */
#define CHAINS 16

double bf16_dot_gflops(long iters, int threads) {
  double t0 = 0, t1 = 0;
  double sink = 0;
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

double int8_dot_gops(long iters, int threads) {
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
"""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    missing = {"avx512_bf16", "avx512_vnni"} - _cpu_flags()
    if missing:
        raise RuntimeError(f"the peak microbenchmark needs {', '.join(sorted(missing))}, which this CPU lacks")
    with tempfile.TemporaryDirectory(prefix="llmserve_peak_") as build:  # loaded, the file can go
        src, lib = os.path.join(build, "peak.c"), os.path.join(build, "peak.so")
        with open(src, "w") as f:
            f.write(_SOURCE)
        cmd = [os.environ.get("CC", "cc"), "-O2", "-march=native", "-mavx512bf16", "-mavx512vnni", "-fopenmp",
               "-shared", "-fPIC", src, "-o", lib]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:  # no compiler
            raise RuntimeError(f"could not build the peak microbenchmark: {exc}") from exc
        if proc.returncode != 0:
            raise RuntimeError(f"could not build the peak microbenchmark ({' '.join(cmd)}): {proc.stderr.strip()}")
        dll = ctypes.CDLL(lib)
    for name in ("bf16_dot_gflops", "int8_dot_gops"):
        fn = getattr(dll, name)
        fn.argtypes, fn.restype = [ctypes.c_long, ctypes.c_int], ctypes.c_double
    return dll


def _best_rate(fn, threads: int, repeats: int) -> float:
    rates = [fn(4_000_000, threads) for _ in range(repeats)]  # ~20 ms a run at ~230 GFLOP/s a thread
    if min(rates) <= 0:
        raise RuntimeError("the peak microbenchmark's sums came out wrong")
    return max(rates)  # noise (another process, a busy sibling vCPU) only ever slows a run down


def _peak(fn, threads: int, repeats: int) -> float:
    """The larger of `threads` x the best single-thread rate and the best rate of `threads` threads
    at once: no run of `threads` threads beats every one of them at its own peak, so this bounds the
    host from above even where threads share a core."""
    return max(threads * _best_rate(fn, 1, repeats), _best_rate(fn, threads, repeats))


def bf16_peak_gflops(threads: int, repeats: int = 20) -> float:
    """``vdpbf16ps`` chains on `threads` threads: GFLOP/s."""
    return _peak(_library().bf16_dot_gflops, threads, repeats)


def int8_peak_gops(threads: int, repeats: int = 20) -> float:
    """``vpdpbusd`` chains on `threads` threads: GOPS (multiply + add)."""
    return _peak(_library().int8_dot_gops, threads, repeats)


def run_flops(cfg: ModelConfig, prompt_lens: list[int], output_len: int) -> dict[str, float]:
    """FLOPs of generating `output_len` tokens after each prompt, by part."""
    h, hd, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    params_per_layer = sum(n * k for n, k in decoder_linear_shapes(cfg))  # QKV, O, gate-up, down
    fed = [n + output_len - 1 for n in prompt_lens]  # the last sampled token is never fed back
    # The token at position p attends p + 1 keys: 2 * head_dim FLOPs per key for QK^T, as many for PV.
    attended = sum(m * (m + 1) // 2 for m in fed)
    return dict(decoder_linears=2.0 * params_per_layer * layers * sum(fed),
                lm_head=2.0 * cfg.vocab_size * h * len(prompt_lens) * output_len,
                attention=4.0 * cfg.num_heads * hd * layers * attended)


def ceiling_seconds(flops: dict[str, float], bf16_gflops: float, int8_gops: float | None = None) -> float:
    """Least time for `flops` with every part at peak: bf16, or the decoder linears in int8 when
    `int8_gops` is given (W8A8; the lm_head and attention stay bf16)."""
    linears = flops["decoder_linears"] / ((int8_gops or bf16_gflops) * 1e9)
    return linears + (flops["lm_head"] + flops["attention"]) / (bf16_gflops * 1e9)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    lib = _library()
    for threads in sorted({1, args.threads}):
        print(f"{threads} thread(s) at once, best of 20: bf16 {_best_rate(lib.bf16_dot_gflops, threads, 20):7.1f} "
              f"GFLOP/s   int8 {_best_rate(lib.int8_dot_gops, threads, 20):7.1f} GOPS")
    print(f"peak used for ceilings, {args.threads} threads: bf16 {bf16_peak_gflops(args.threads):7.1f} GFLOP/s   "
          f"int8 {int8_peak_gops(args.threads):7.1f} GOPS")


if __name__ == "__main__":
    main()
