"""Loading or running a model the runtime cannot handle fails with a clear, typed error that names
the problem (the path, the architecture, the quantization type, the context), not a traceback from
deep inside numpy or torch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers.greedy import make_runner
from shared.engine.model_runner import ScheduledChunk
from shared.engine.models.config import ModelConfig, UnsupportedModelError
from shared.engine.models.llama import LlamaModel
from shared.engine.models.loader import load_config, load_model

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def write_gguf(path, arch: str, tensors: dict[str, tuple[np.ndarray, int | None]]) -> str:
    """A minimal GGUF: enough metadata for ``arch`` plus the given tensors (raw bytes when a type is
    given)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(32)
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def f32(*shape: int) -> tuple[np.ndarray, None]:
    return np.ones(shape, dtype=np.float32), None


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_model(str(missing), progress=False)


def test_directory_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(str(tmp_path), progress=False)


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"this is not a GGUF file" * 10)
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF"):
        load_model(str(path), progress=False)


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_gguf_with_unsupported_architecture(arch, tmp_path):
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, {"token_embd.weight": f32(32, 8)})
    with pytest.raises(UnsupportedModelError, match=f"unsupported architecture '{arch}'") as info:
        load_model(path, progress=False)
    assert "llama" in str(info.value)  # and it says what is supported


def test_hf_directory_with_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "vocab_size": 32,
                "n_embd": 8,
            }
        )
    )
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_config(str(tmp_path))


@pytest.mark.parametrize("qtype", [Q.Q8_1, Q.Q8_K], ids=lambda t: t.name)
def test_gguf_with_unsupported_quantization_type(qtype, tmp_path):
    # The gguf package cannot dequantize these (NotImplementedError); every other tensor is fine.
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 32, 256  # cols: a whole number of blocks for every block size
    raw = np.zeros((rows, cols // block_size * type_size), dtype=np.uint8)
    tensors = {
        "token_embd.weight": (raw, qtype),
        "output_norm.weight": f32(8),
        "blk.0.attn_norm.weight": f32(8),
    }
    path = write_gguf(tmp_path / "quant.gguf", "llama", tensors)
    with pytest.raises(UnsupportedModelError, match=f"quantization type {qtype.name}") as info:
        load_model(path, progress=False)
    assert "token_embd.weight" in str(info.value)


def test_prompt_longer_than_the_context_is_refused():
    config = ModelConfig(
        architecture="llama",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=40,
    )
    torch.manual_seed(0)
    model = LlamaModel(config).eval()
    runner = make_runner(model, num_blocks=8)
    table = [1, 2, 3, 4]
    with pytest.raises(ValueError, match="prompt of 41 tokens exceeds the model's context of 40"):
        runner.execute([ScheduledChunk([1] * 41, 0, table)])
    # A continuation chunk counts what is already cached too; a decode one past the end likewise.
    with pytest.raises(ValueError, match="prompt of 45 tokens exceeds the model's context of 40"):
        runner.execute([ScheduledChunk([1] * 10, 35, table)])
    with pytest.raises(ValueError, match="prompt of 41 tokens"):
        runner.execute([ScheduledChunk([1], 40, table), ScheduledChunk([1, 2], 0, [5])])
    # Exactly the context is fine.
    assert runner.execute([ScheduledChunk([i % 32 for i in range(40)], 0, table)]).shape == (1, 32)
