"""Build (or load from cache) the CPU kernels and say which: ``python -m kernels.cpu``.

`make install` runs this so the first server start or test does not pay the compile. Exits 0 either
way: without a compiler the engine runs the plain torch path.
"""

from __future__ import annotations

import logging
import sys
import time

from kernels.cpu import cpu_ops, enabled


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not enabled():
        print("CPU kernels: switched off (LLMSERVE_CPU_KERNELS=0)")
        return 0
    t0 = time.perf_counter()
    ops = cpu_ops()
    if ops is None:
        print("CPU kernels: unavailable, the engine will use the plain torch path (see the warning above)")
    else:
        print(f"CPU kernels: ready in {time.perf_counter() - t0:.1f} s "
              f"(AVX512-BF16 linear: {'yes' if ops.has_avx512_bf16() else 'no'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
