"""Build (or load from cache) the CPU kernels of every level this CPU runs, and say which path each
op takes here and why: ``python -m kernels.cpu``.

`make install` runs this so the first server start or test does not pay the compile. Exits 0
whatever it finds (without kernels the engine runs the plain torch path), unless ``--require`` is
given: then a level this CPU has whose kernels do not build is an error (CI sets it).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from kernels.cpu import KERNELS_ENV, enabled, isa
from kernels.cpu.build import KernelBuildError, load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--require", action="store_true", help="fail if a level this CPU has does not build"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    simd_flags = [f for f in sorted(isa.cpu_flags()) if f.startswith(("avx", "fma", "f16c", "amx"))]
    print(f"CPU: {isa.cpu_name()} ({', '.join(simd_flags) or 'no AVX flags'})")
    if not enabled():
        print(f"CPU kernels: switched off ({KERNELS_ENV}=0): every op runs the torch path")
        return 0
    cap = isa.cap()
    if cap:
        print(f"{isa.ISA_ENV}={cap}: levels above it are not used")
    best, failures = None, []
    for lv in isa.LEVELS:
        why = isa.why_not(lv)
        # A capped level is still built: the tests compare levels.
        if why and not why.startswith(isa.ISA_ENV):
            print(f"  {lv.name:<12} not run here: {why}")
            continue
        t0 = time.perf_counter()
        try:
            ops = load(lv)
        except KernelBuildError as exc:
            failures.append(lv.name)
            print(f"  {lv.name:<12} BUILD FAILED: {exc}")
            continue
        print(
            f"  {lv.name:<12} ready in {time.perf_counter() - t0:.1f} s"
            + (f" (not used: {why})" if why else "")
        )
        if not why:
            best = (lv, ops)
    if best is None:
        print("CPU kernels: none run here: every op takes the torch path")
    else:
        lv, ops = best
        print(f"ops at the {lv.name} level ({ops.name}):")
        for path in ops.paths():
            print(f"  {path}")
    onednn = isa.onednn_usable(torch.bfloat16)
    print(
        f"oneDNN bf16 matmul: {'usable' if onednn else 'not usable here'} "
        "(bf16 linears use it only without the kernels)"
    )
    return 1 if args.require and failures else 0


if __name__ == "__main__":
    sys.exit(main())
