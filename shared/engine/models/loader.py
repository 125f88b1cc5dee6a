"""Load a model from a GGUF file or a Hugging Face safetensors directory, with progress."""

from __future__ import annotations

import glob
import json
import os
import sys

import torch
from tqdm import tqdm

from shared.engine.models.config import ModelConfig, UnsupportedModelError
from shared.engine.models.gguf_linear import GGUFLinear, native_linears
from shared.engine.models.gguf_loader import gguf_model_config, iter_gguf_weights, open_gguf
from shared.engine.models.llama import LlamaModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def resolve_model_path(path: str | None) -> str:
    if path is None:
        from shared.engine.default_model import default_model_path

        return default_model_path()
    if not os.path.exists(path):
        raise FileNotFoundError(f"model not found: {path}")
    return path


def load_config(path: str) -> ModelConfig:
    if os.path.isdir(path):
        config_file = os.path.join(path, "config.json")
        if not os.path.exists(config_file):
            raise FileNotFoundError(f"{path} has no config.json")
        with open(config_file) as f:
            return ModelConfig.from_hf_config(json.load(f))
    return gguf_model_config(open_gguf(path))


def _iter_safetensors(path: str, dtype: torch.dtype):
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name).to(dtype)


def load_model(
    path: str | None = None,
    *,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "cpu",
    progress: bool = True,
    quantization: str | None = None,
) -> LlamaModel:
    """Build the model for ``path`` (default: SmolLM2-135M-Instruct) and load its weights in
    ``dtype``: the plain model (``models/runtime.py`` lays it out for the CPU kernels and runs it on
    them). ``quantization="gguf"`` (a GGUF file only): the decoder linears whose tensors are in a
    block format the kernels run keep their blocks (``models/gguf_linear.py``) and are never
    dequantized; every other quantization is applied after loading, by the engine."""
    path = resolve_model_path(path)
    dtype = resolve_dtype(dtype)
    native: dict[str, GGUFLinear] = {}
    if os.path.isdir(path):
        if quantization == "gguf":
            raise ValueError(
                f"quantization='gguf' runs a GGUF file's blocks; {path} is a safetensors directory"
            )
        config = load_config(path)
        weights, total = _iter_safetensors(path, dtype), None
    else:
        reader = open_gguf(path)
        config = gguf_model_config(reader)
        taken: frozenset[str] = frozenset()
        if quantization == "gguf":
            native, taken = native_linears(reader, config, dtype)
        weights = iter_gguf_weights(reader, config, dtype, skip=taken)
        total = len(reader.tensors) - len(taken)
    # Parameters are created without initialisation (meta), then filled from the checkpoint;
    # load_weights refuses a checkpoint that leaves any row unset.
    with torch.device("meta"):
        model = LlamaModel(config)
    model = model.to_empty(device=device).to(dtype)
    model.rotary.reset(device)
    for name, layer in native.items():  # their tensors are no parameters: load_weights skips them
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    bar = tqdm(
        weights,
        total=total,
        desc=f"loading {os.path.basename(path)}",
        unit="tensor",
        disable=not progress,
        file=sys.stderr,
    )
    model.load_weights(bar)
    return model.eval()


__all__ = [
    "UnsupportedModelError",
    "load_config",
    "load_model",
    "resolve_dtype",
    "resolve_model_path",
]
