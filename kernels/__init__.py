"""Kernels below the torch reference path.

``kernels/cpu``: fused C++ kernels for the CPU path (RMSNorm + residual, RoPE + KV-cache write,
SiLU-and-mul, paged decode and prefill attention, bf16 and int8 matmuls on panel-packed weights, the
greedy argmax), built once per machine for each instruction-set level the CPU has and chosen at run
time (``kernels/cpu/isa.py``). Triton kernels for the CUDA path are still to come; on CUDA every op
runs the torch attention backend in ``shared/engine/attention/backend.py``, which is the reference
all of them are tested against.
"""
