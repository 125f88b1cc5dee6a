"""The quantization schemes ``EngineConfig.quantization`` accepts, importable without torch (for the
command lines). "int8": int8 weights and activations in every decoder linear, see
``shared/engine/models/int8_linear.py``."""

QUANTIZATIONS = ("int8",)
QUANTIZATION_HELP = "int8: int8 weights and activations in the decoder linears (CPU with AVX512-VNNI; faster, slightly less exact)"
