"""``python -m services.tokenizer``: chat template, encoding and prompt validation (queue group)."""

from __future__ import annotations

import argparse
import sys

from services.runtime import env_int, env_str, run_service
from services.tokenizer.prompts import PromptLimits, load_tokenizer, model_context_len
from services.tokenizer.service import TokenizerConfig, serve


def parse_config(argv: list[str] | None = None) -> TokenizerConfig:
    p = argparse.ArgumentParser(prog="python -m services.tokenizer", description=__doc__)
    p.add_argument("--nats-url", default=env_str("NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--model", default=env_str("LLMSERVE_MODEL", None),
                   help="GGUF file or Hugging Face directory (default: the bundled SmolLM2)")
    p.add_argument("--max-model-len", type=int, default=env_int("LLMSERVE_MAX_MODEL_LEN", None),
                   help="context length prompts are checked against (default: the model's)")
    p.add_argument("--block-size", type=int, default=env_int("LLMSERVE_BLOCK_SIZE", 16))
    p.add_argument("--name", default="tokenizer", help="connection name")
    a = p.parse_args(argv)
    model = a.model
    if model is None:
        from shared.engine.default_model import default_model_path
        model = default_model_path()
    try:
        return TokenizerConfig(nats_url=a.nats_url, model=model, max_model_len=a.max_model_len,
                               block_size=a.block_size, name=a.name)
    except ValueError as e:
        p.error(str(e))
        raise


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    tokenizer = load_tokenizer(config.model)
    limits = PromptLimits(max_model_len=config.max_model_len or model_context_len(config.model),
                          block_size=config.block_size)
    return run_service("tokenizer", lambda stop: serve(config, tokenizer, limits, stop))


if __name__ == "__main__":
    sys.exit(main())
