"""Triton kernels for the CUDA path (paged attention and friends) will live here.

Nothing is implemented yet: every device runs the torch attention backend in
``shared/engine/attention/backend.py``, which is the reference those kernels will be tested against.
"""
