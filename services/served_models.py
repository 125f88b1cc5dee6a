"""The models a stack serves, each under the name clients send as ``model``.

One rule, shared by ``llmserve up`` (and its launcher) and the tokenizer, turns a command line's
``--model PATH`` (repeated) and ``--model-name NAME`` (repeated in the same order) into
``ServedModel``s: names pair with paths by position, and with no names each model is named after
its file. Without any ``--model`` the one model is the engine's (``LLMSERVE_MODEL``, else the
bundled default), with at most one name.

Pure and torch-free: the launcher, the tokenizer and their tests import it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_SERVED_MODEL_NAME",
    "ServedModel",
    "check_model_name",
    "default_model_name",
    "pair_models",
    "split_names",
]

# The bundled model's name (shared.engine.default_model): its plain name, not its file's.
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"


def check_model_name(name: str) -> None:
    """A served name goes into JSON and onto command lines as is: non-empty, no whitespace."""
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"a model name must be non-empty and without whitespace, got {name!r}")


def default_model_name(path: str | None) -> str:
    """The name a model is served under when none is given: its file or directory name without
    ``.gguf``, whitespace runs turned into '-' (the bundled default model: its plain name)."""
    if path is None:
        return DEFAULT_SERVED_MODEL_NAME
    base = os.path.basename(os.path.normpath(path))
    for suffix in (".gguf", ".GGUF"):
        base = base.removesuffix(suffix)
    return "-".join(base.split())


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients send as ``model``, /v1/models lists and executors advertise
    path: str | None  # GGUF file or Hugging Face directory; None: the engine's default model

    def __post_init__(self) -> None:
        check_model_name(self.name)
        if self.path is not None and not self.path:
            raise ValueError(f"model {self.name!r}: the path must not be empty")


def split_names(text: str | None) -> list[str]:
    """The names of a comma-separated list (``LLMSERVE_MODEL_NAME=a,b``), blanks dropped."""
    return [name.strip() for name in (text or "").split(",") if name.strip()]


def pair_models(paths: Sequence[str | None], names: Sequence[str]) -> tuple[ServedModel, ...]:
    """``--model`` paths and ``--model-name`` names, paired by position. ``paths`` is never empty:
    a command line without ``--model`` passes its engine's one model (None: the default). Names are
    either absent (each model named after its file) or given once per model, and no two models
    may share a name (the stack routes by name alone)."""
    if not paths:
        raise ValueError("no model to serve")
    if names and len(names) != len(paths):
        raise ValueError(
            f"--model-name was given {len(names)} time(s) for {len(paths)} model(s): give it "
            "once per --model, in the same order, or not at all to name each model after its file"
        )
    models = tuple(
        ServedModel(name, path)
        for path, name in zip(paths, names or [default_model_name(p) for p in paths], strict=True)
    )
    check_unique(models)
    return models


def check_unique(models: Sequence[ServedModel]) -> None:
    seen: dict[str, ServedModel] = {}
    for m in models:
        if m.name in seen:
            raise ValueError(
                f"two models are served as {m.name!r} ({seen[m.name].path or 'the default model'} "
                f"and {m.path or 'the default model'}); give each its own --model-name"
            )
        seen[m.name] = m
