"""pytest marks for tests that need a CPU feature of the fused kernels."""

from __future__ import annotations

import pytest

from kernels.cpu import cpu_ops
from shared.engine.models.int8_linear import int8_supported

needs_vnni = pytest.mark.skipif(not int8_supported(cpu_ops()), reason="needs the CPU kernels with AVX512-VNNI")
