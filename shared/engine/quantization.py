"""The quantization schemes the engine accepts, importable without torch (for the command lines).

``EngineConfig.quantization``: "int8": int8 weights and activations in every decoder linear, see
``shared/engine/models/int8_linear.py``. "gguf": a GGUF file's Q4_0/Q4_1/Q8_0 linears run on their
blocks, see ``shared/engine/models/gguf_linear.py``; "int4": any checkpoint quantized at load into
those blocks (``quantize_model_int4`` there). None (the default, a quantized GGUF file
included) dequantizes every tensor to the model dtype at load: the numerics the exactness tests hold
to the reference implementation; ``gguf`` changes them (8-bit inputs per 32-block, as llama.cpp
computes), so it is asked for, never implied.
``EngineConfig.kv_cache_dtype``: "auto" keeps K/V in the model dtype; "int8": one int8 per element
and an fp32 scale per (token, KV head) row; "fp8": the same with e4m3 elements; see
``shared/engine/kv_cache.py``."""

QUANTIZATIONS = ("int8", "int4", "gguf")
QUANTIZATION_HELP = (
    "int8: int8 weights and activations in the decoder linears "
    "(the CPU kernels; faster, slightly less exact); "
    "int4: any checkpoint's decoder linears quantized at load to 4 bits in groups of 32 "
    "(scale and min each, GGUF Q4_1 blocks) and its output head to 8 (Q8_0), run as gguf's; "
    "gguf: a GGUF file's Q4_0/Q4_1/Q8_0 linears run on their blocks, not dequantized "
    "(the CPU kernels; fewer bytes per token, 8-bit inputs as llama.cpp; default: dequantized "
    "to --dtype)"
)
# ``quantization="int4"``: the decoder linears' block format, and the output head's (8 bits: the
# head is the model's most sensitive matrix, and one of its largest).
INT4_LINEAR_FORMAT, INT4_HEAD_FORMAT = "q4_1", "q8_0"

# GGUF block formats the kernels run on their blocks: bytes per block of GGUF_BLOCK weights (int
# quants, an fp16 scale, and for Q4_1 an fp16 min), the same in the file and in the packed layout,
# whose panels pad the output rows to a multiple of GGUF_PANEL_ROWS.
GGUF_BLOCK = 32
GGUF_PANEL_ROWS = 16
GGUF_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
# The engine's fused decoder linears (module path in a layer, in ``memory.decoder_linear_shapes``
# order) and the GGUF tensors (``blk.<i>.<part>.weight``) each concatenates, in row order.
GGUF_LINEAR_PARTS = (
    ("self_attn.qkv_proj", ("attn_q", "attn_k", "attn_v")),
    ("self_attn.o_proj", ("attn_output",)),
    ("mlp.gate_up_proj", ("ffn_gate", "ffn_up")),
    ("mlp.down_proj", ("ffn_down",)),
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
