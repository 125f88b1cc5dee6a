"""The quantization schemes the engine accepts, importable without torch (for the command lines).

``EngineConfig.quantization``: "int8": int8 weights and activations in every decoder linear, see
``shared/engine/models/int8_linear.py``.
``EngineConfig.kv_cache_dtype``: "auto" keeps K/V in the model dtype; "int8": one int8 per element
and an fp32 scale per (token, KV head) row, see ``shared/engine/kv_cache.py``."""

QUANTIZATIONS = ("int8",)
QUANTIZATION_HELP = (
    "int8: int8 weights and activations in the decoder linears "
    "(the CPU kernels; faster, slightly less exact)"
)

KV_CACHE_DTYPES = ("auto", "int8")
KV_SCALE_BYTES = 4  # the fp32 scale after the values of each (token, KV head) row of an int8 cache

KV_CACHE_DTYPE_HELP = (
    "KV cache element type. auto: the model dtype; int8: int8 with a scale per token and "
    "KV head (about half the bytes: 1.9x the tokens in the same memory, faster decode "
    "attention; slightly less exact)"
)


def kv_dtype_name(kv_cache_dtype: str, dtype: str) -> str:
    """The element type a KV cache holds, by the memory ledger's names: ``dtype`` (the model's) for
    "auto", else ``kv_cache_dtype`` itself."""
    return dtype if kv_cache_dtype == "auto" else kv_cache_dtype
