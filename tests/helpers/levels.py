"""The CPU kernel levels the tests run at: every level this CPU has (up to ``LLMSERVE_CPU_ISA``), so
an AVX-512 host tests its AVX2 kernels too.

Where a level cannot run, its tests skip with the real reason, except under
``LLMSERVE_REQUIRE_CPU_KERNELS=1`` (CI sets it): there a kernel path this CPU should have and does
not get is a failure, so a broken build cannot pass as a row of skips.
"""

from __future__ import annotations

import contextlib
import os

import pytest

from kernels.cpu import cpu_ops, isa, ops_at, unavailable_reason
from kernels.cpu.build import KernelBuildError

REQUIRE_ENV = "LLMSERVE_REQUIRE_CPU_KERNELS"
LEVELS = [lv.name for lv in isa.supported_levels()]


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").lower() in ("1", "true", "yes", "on")


def unavailable(reason: str):
    """Fail (kernels required) or skip, saying why."""
    if required():
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
    pytest.skip(reason)


def ops_at_level(name: str):
    try:
        return ops_at(name)
    except (KernelBuildError, ValueError) as exc:
        unavailable(str(exc))


def best_ops():
    """The level the engine runs at here, or skip/fail with the reason there is none."""
    ops = cpu_ops()
    if ops is None:
        unavailable(f"the CPU kernels are unavailable: {unavailable_reason()}")
    return ops


# For pytest.mark.skipif on tests that need the engine on the kernels: evaluated at import, so it
# cannot fail; under REQUIRE_ENV the test runs and fails on its own when they are missing.
needs_kernels = pytest.mark.skipif(
    cpu_ops() is None and not required(),
    reason=f"the CPU kernels are unavailable: {unavailable_reason()}",
)


@contextlib.contextmanager
def capped_at(level: str):
    """The engine's kernels capped at `level` for the block (``LLMSERVE_CPU_ISA``), as on a CPU
    that has nothing above it."""
    if level not in LEVELS:
        unavailable(f"this CPU cannot run the {level} kernels: {isa.why_not(isa.level(level))}")
    old = os.environ.get(isa.ISA_ENV)
    os.environ[isa.ISA_ENV] = level
    cpu_ops.cache_clear()
    try:
        yield
    finally:
        if old is None:
            del os.environ[isa.ISA_ENV]
        else:
            os.environ[isa.ISA_ENV] = old
        cpu_ops.cache_clear()
