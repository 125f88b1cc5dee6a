"""Shared pytest fixtures. Each engineer's fixtures live in their own delimited block below."""

from __future__ import annotations

# =============================================================================================
# Model runtime fixtures (real SmolLM2-135M-Instruct and its transformers reference).
# All session-scoped: loading the transformers reference alone takes ~20 s on this machine.
# =============================================================================================
import os

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Path of the default model's GGUF (SmolLM2-135M-Instruct, Q4_1)."""
    from shared.engine.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    """Our tokenizer, built from the GGUF's metadata."""
    from shared.engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="session")
def hf_reference_model(smollm2_path):
    """transformers' LlamaForCausalLM loaded from the same GGUF (dequantized), fp32, eval mode."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def runtime_fp32(smollm2_path):
    """Our LlamaModel for SmolLM2 in fp32 on this host's CPU backend (no KV cache: build one per
    test, see helpers.greedy)."""
    from shared.engine.models.runtime import load_runtime

    return load_runtime(smollm2_path, dtype="float32", progress=False)


@pytest.fixture(scope="session")
def runtime_bf16(smollm2_path):
    """Our LlamaModel for SmolLM2 in bf16 on this host's CPU backend (linears pre-packed for the
    kernels, or for oneDNN without them)."""
    from shared.engine.models.runtime import load_runtime

    return load_runtime(smollm2_path, dtype="bfloat16", progress=False)


# ============================================================================ end model runtime


# =============================================================================================
# CPU kernel levels (tests/helpers/levels.py): `ops` runs a test once per level this CPU has.
# =============================================================================================
from helpers.levels import LEVELS, ops_at_level, unavailable  # noqa: E402


@pytest.fixture(params=LEVELS or ["none"])
def ops(request):
    """The kernel ops of one ISA level (the module named llmserve_cpu_<level>)."""
    if request.param == "none":
        from kernels.cpu import isa

        unavailable(f"no CPU kernel level runs here: {isa.why_not(isa.LEVELS[0])}")
    return ops_at_level(request.param)


# =============================================================================================
# Layers: each folder under tests/ is one layer and marks its tests with the layer's name
# (registered in pyproject.toml; `make test-fast` runs `-m "wire or unit"`). A new test file gets
# its marker from its folder; one outside every layer folder is a collection error.
# The server fixtures (nats_url, redis_url, stack, pid_alive) are in helpers/servers.py.
# =============================================================================================
pytest_plugins = ["helpers.servers", "helpers.gateway_harness"]

LAYERS = ("wire", "unit", "engine", "kernels", "services", "e2e")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    for item in items:
        layer = os.path.relpath(item.path, TESTS_DIR).split(os.sep)[0]
        if layer not in LAYERS:
            folders = ", ".join(f"tests/{name}/" for name in LAYERS)
            raise pytest.UsageError(
                f"{item.nodeid}: a test file belongs in a layer folder: {folders}"
            )
        item.add_marker(getattr(pytest.mark, layer))


# ============================================================================ end layers
