"""A tiny random Llama saved as a Hugging Face directory, built offline in a moment: a second model
for a stack to serve beside SmolLM2, different from it in every way a model can be.

    save_tiny_tokenizer(directory)      tokenizer.json (byte-level, 256 byte tokens + <s> </s>) and
                                        tokenizer_config.json (BOS added; its own chat template)
    save_tiny_llama(directory, seed)    the above, plus config.json and model.safetensors: 2 layers,
                                        GQA, an untied head, a 256-token context (keywords give
                                        another context or width: head_dim 64 runs the CPU
                                        kernels' attention, the default 16 torch's)

Written by hand (safetensors under the Hugging Face tensor names, and the config keys the loader
reads) rather than with transformers, whose import alone takes seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_VOCAB = 258  # <s>, </s>, then the 256 byte-level characters
TINY_CONTEXT = 256
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
_HIDDEN, _INTERMEDIATE, _LAYERS, _HEADS, _KV_HEADS = 64, 128, 2, 4, 2


def save_tiny_tokenizer(directory: str | Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(alphabet)}}
    assert len(vocab) == TINY_VOCAB
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": TINY_CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def save_tiny_llama(
    directory: str | Path,
    seed: int = 0,
    *,
    context: int = TINY_CONTEXT,
    hidden_size: int = _HIDDEN,
    num_heads: int = _HEADS,
) -> str:
    """A random tiny Llama with its tokenizer in ``directory``; returns the directory's path."""
    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    save_tiny_tokenizer(directory)
    head_dim = hidden_size // num_heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": TINY_VOCAB,
        "hidden_size": hidden_size,
        "intermediate_size": _INTERMEDIATE,
        "num_hidden_layers": _LAYERS,
        "num_attention_heads": num_heads,
        "num_key_value_heads": _KV_HEADS,
        "max_position_embeddings": context,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    (directory / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm_scale() -> torch.Tensor:  # not all ones, so a scale the loader drops would show
        return 1 + normal(hidden_size, std=0.2)

    tensors = {
        "model.embed_tokens.weight": normal(TINY_VOCAB, hidden_size),
        "model.norm.weight": norm_scale(),
        "lm_head.weight": normal(TINY_VOCAB, hidden_size),
    }
    for i in range(_LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm_scale(),
            p + "post_attention_layernorm.weight": norm_scale(),
            p + "self_attn.q_proj.weight": normal(num_heads * head_dim, hidden_size),
            p + "self_attn.k_proj.weight": normal(_KV_HEADS * head_dim, hidden_size),
            p + "self_attn.v_proj.weight": normal(_KV_HEADS * head_dim, hidden_size),
            p + "self_attn.o_proj.weight": normal(hidden_size, num_heads * head_dim),
            p + "mlp.gate_proj.weight": normal(_INTERMEDIATE, hidden_size),
            p + "mlp.up_proj.weight": normal(_INTERMEDIATE, hidden_size),
            p + "mlp.down_proj.weight": normal(hidden_size, _INTERMEDIATE),
        }
    save_file(tensors, str(directory / "model.safetensors"))
    return str(directory)
