"""Kernels below the torch reference path.

``kernels/cpu``: fused C++ kernels for the CPU path (RMSNorm + residual, RoPE + KV-cache write,
SiLU-and-mul, paged decode and prefill attention, a bf16 matmul on pair-packed weights), built once
per machine on first use. Triton kernels for the CUDA path are still to come; on CUDA every op runs
the torch attention backend in ``shared/engine/attention/backend.py``, which is the reference all of
them are tested against.
"""
