"""The quantization schemes the engine accepts, importable without torch (for the command lines).

``EngineConfig.quantization``: "int8": int8 weights and activations in every decoder linear, see
``shared/engine/models/int8_linear.py``.
``EngineConfig.kv_cache_dtype``: "auto" keeps K/V in the model dtype; "int8": one int8 per element
and an fp32 scale per (token, KV head) row; "fp8": the same with e4m3 elements; see
``shared/engine/kv_cache.py``."""

QUANTIZATIONS = ("int8",)
QUANTIZATION_HELP = (
    "int8: int8 weights and activations in the decoder linears "
    "(the CPU kernels; faster, slightly less exact)"
)

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# The caches whose rows are one byte per element followed by an fp32 scale (KV_SCALE_BYTES).
SCALED_KV_CACHE_DTYPES = ("int8", "fp8")
KV_SCALE_BYTES = 4  # the fp32 scale after the values of each (token, KV head) row of a scaled cache

KV_CACHE_DTYPE_HELP = (
    "KV cache element type. auto: the model dtype; int8: int8 with a scale per token and "
    "KV head (about half the bytes: 1.9x the tokens in the same memory, faster decode "
    "attention; slightly less exact); fp8: e4m3 with the same scales and bytes (on CPUs "
    "int8 is faster and closer to bf16; fp8 is for accelerators with fp8 arithmetic)"
)


def kv_dtype_name(kv_cache_dtype: str, dtype: str) -> str:
    """The element type a KV cache holds, by the memory ledger's names: ``dtype`` (the model's) for
    "auto", else ``kv_cache_dtype`` itself."""
    return dtype if kv_cache_dtype == "auto" else kv_cache_dtype
