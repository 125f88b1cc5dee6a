"""The tokenizer process's config, from flags over the environment (a flag beats its variable).

A tokenizer serves every model of its stack: ``--model PATH`` repeated, each named by
``--model-name NAME`` repeated in the same order (``services.served_models``; default: the file's
name), or, without ``--model``, the one model of ``LLMSERVE_MODEL`` or the bundled default. The
context length and block size are engine settings, declared once in ``shared.engine.config``; the
launcher gives the tokenizer the values it gives the executors, and each model's context length is
capped by the model's own, as the engine caps it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from services.connections import add_nats_auth_arguments, nats_auth_from_args
from services.runtime import env_int, env_str, env_value
from services.served_models import pair_models, split_names
from services.tokenizer.prompts import PromptLimits, model_context_len
from shared.engine.config import EngineConfig, add_engine_arguments
from shared.wire.bus_auth import BusAuth

# The engine settings a tokenizer needs: which model, and the prompt limits it checks.
TOKENIZER_LIMIT_SETTINGS = ("max_model_len", "block_size")
TOKENIZER_ENGINE_SETTINGS = ("model", *TOKENIZER_LIMIT_SETTINGS)


@dataclass(frozen=True)
class TokenizerModel:
    name: str  # the served name requests select it by
    path: str  # GGUF file or Hugging Face directory
    limits: PromptLimits  # its context length and block size


@dataclass(frozen=True)
class TokenizerConfig:
    nats_url: str
    models: tuple[TokenizerModel, ...]
    name: str = "tokenizer"
    bus_auth: BusAuth = field(default_factory=BusAuth)  # who it is on NATS (services.connections)

    def __post_init__(self) -> None:
        if not self.nats_url:
            raise ValueError("nats_url must not be empty")
        if not self.models:
            raise ValueError("a tokenizer serves at least one model")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"two models share a name: {names}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.tokenizer",
        description="Chat template, encoding and prompt validation (queue group).",
    )
    p.add_argument("--nats-url", default=env_str("NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--name", default="tokenizer", help="connection name")
    add_nats_auth_arguments(p)
    p.add_argument(
        "--model-name",
        action="append",
        default=None,
        help="the name requests select a model by: once per --model, in the same order "
        "(default: $LLMSERVE_MODEL_NAME, comma-separated, else each model's file name)",
    )
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=env_int("LLMSERVE_MAX_PROMPT_CHARS", None),
        metavar="N",
        help="refuse (400) a prompt, or messages, of more characters than this before tokenizing "
        "(env LLMSERVE_MAX_PROMPT_CHARS; default: 16 per token of each model's context)",
    )
    add_engine_arguments(
        p,
        include=TOKENIZER_ENGINE_SETTINGS,
        repeatable=("model",),
        help={
            "model": "GGUF file or Hugging Face directory, repeated for several models (default: "
            "the bundled SmolLM2-135M-Instruct)",
            "max_model_len": "context length prompts are checked against (default: the model's)",
        },
    )
    return p


def parse_config(argv: list[str] | None = None) -> TokenizerConfig:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        engine = EngineConfig.from_args(
            a,
            EngineConfig.from_env(env_value, include=TOKENIZER_ENGINE_SETTINGS),
            exclude=("model",),
        )
        # Names from the flags, else from the variable the executor reads too (one per model).
        names = a.model_name or split_names(env_str("LLMSERVE_MODEL_NAME", None))
        served = pair_models(getattr(a, "model", None) or [engine.model], names)
        models = []
        for m in served:
            path = m.path
            if path is None:
                from shared.engine.default_model import default_model_path

                path = default_model_path()
            context_len = model_context_len(path)
            limits = PromptLimits(
                max_model_len=min(engine.max_model_len or context_len, context_len),
                block_size=engine.block_size,
                max_prompt_chars=a.max_prompt_chars,
            )
            models.append(TokenizerModel(m.name, path, limits))
        return TokenizerConfig(
            nats_url=a.nats_url,
            models=tuple(models),
            name=a.name,
            bus_auth=nats_auth_from_args(a),
        )
    except ValueError as e:
        p.error(str(e))
        raise
