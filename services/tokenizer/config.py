"""The tokenizer process's config, from flags over the environment (a flag beats its variable).

Its model, context length and block size are engine settings, declared once in
``shared.engine.config``: the tokenizer takes those flags from there, and the launcher gives it the
same values it gives the executors."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.runtime import env_str, env_value
from services.tokenizer.prompts import PromptLimits, model_context_len
from shared.engine.config import EngineConfig, add_engine_arguments

# The engine settings a tokenizer needs: which model, and the prompt limits it checks.
TOKENIZER_ENGINE_SETTINGS = ("model", "max_model_len", "block_size")


@dataclass(frozen=True)
class TokenizerConfig:
    nats_url: str
    model: str  # GGUF file or Hugging Face directory
    limits: PromptLimits  # validates the context length and block size
    name: str = "tokenizer"

    def __post_init__(self) -> None:
        if not self.nats_url:
            raise ValueError("nats_url must not be empty")


def parse_config(argv: list[str] | None = None) -> TokenizerConfig:
    p = argparse.ArgumentParser(
        prog="python -m services.tokenizer",
        description="Chat template, encoding and prompt validation (queue group).",
    )
    p.add_argument("--nats-url", default=env_str("NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--name", default="tokenizer", help="connection name")
    add_engine_arguments(
        p,
        include=TOKENIZER_ENGINE_SETTINGS,
        help={"max_model_len": "context length prompts are checked against (default: the model's)"},
    )
    a = p.parse_args(argv)
    try:
        engine = EngineConfig.from_args(
            a, EngineConfig.from_env(env_value, include=TOKENIZER_ENGINE_SETTINGS)
        )
        model = engine.model
        if model is None:
            from shared.engine.default_model import default_model_path

            model = default_model_path()
        limits = PromptLimits(
            max_model_len=engine.max_model_len or model_context_len(model),
            block_size=engine.block_size,
        )
        return TokenizerConfig(nats_url=a.nats_url, model=model, limits=limits, name=a.name)
    except ValueError as e:
        p.error(str(e))
        raise
