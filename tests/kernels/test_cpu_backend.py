"""The CPU kernels as one backend: picked once, handed to the model's layers, attention and the
sampler, so that a backend without ops turns the kernels off everywhere (the sampler's argmax
included)."""

from __future__ import annotations

import pytest
import torch

import kernels.cpu
from helpers.levels import needs_kernels
from shared.engine.cpu_backend import CpuBackend
from shared.engine.models.config import ModelConfig
from shared.engine.models.llama import LlamaModel
from shared.engine.models.packed_linear import PackedLinear
from shared.engine.models.runtime import ModelRuntime
from shared.engine.sampler import SamplingBatch, sample
from shared.wire.sampling_params import SamplingParams

# A head shape the attention kernels cover.
TINY = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=64,
    max_position_embeddings=128,
)


class SpyOps:
    """Stands in for a kernel namespace: records the argmaxes asked of it."""

    def __init__(self) -> None:
        self.calls = 0

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.argmax(dim=-1)


@pytest.fixture
def no_global_kernels(monkeypatch):
    """Fail any code that asks kernels.cpu for ops behind the backend's back."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("kernels.cpu was consulted outside CpuBackend.pick")

    monkeypatch.setattr(kernels.cpu, "cpu_ops", refuse)
    monkeypatch.setattr(kernels.cpu, "ops_at", refuse)


def _greedy_batch(n: int, vocab: int) -> SamplingBatch:
    return SamplingBatch.build(
        [SamplingParams(temperature=0.0)] * n, [[]] * n, [[]] * n, [None] * n, vocab, "cpu"
    )


def _mixed_batch(n: int, vocab: int) -> SamplingBatch:
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i) for i in range(n)]
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    return SamplingBatch.build(params, [[]] * n, [[]] * n, gens, vocab, "cpu")


def test_the_sampler_argmax_runs_on_the_backend_it_is_handed(no_global_kernels):
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    spy = SpyOps()
    on = CpuBackend(spy, "spy")
    assert (
        sample(logits, _greedy_batch(4, 1000), on).sampled_token_ids == logits.argmax(-1).tolist()
    )
    assert spy.calls == 1
    sample(logits, _mixed_batch(4, 1000), on)
    assert spy.calls == 3  # the random rows' race and the greedy rows

    # Off (or no backend at all): torch's argmax, the kernels untouched, the same tokens.
    for args in ((CpuBackend.off("test"),), ()):
        out = sample(logits, _greedy_batch(4, 1000), *args)
        assert out.sampled_token_ids == logits.argmax(-1).tolist()
        sample(logits, _mixed_batch(4, 1000), *args)
    assert spy.calls == 3


def test_pick_says_why_there_are_no_kernels(monkeypatch):
    assert CpuBackend.pick("meta").reason == "the model is on meta, not the CPU"
    fp16 = CpuBackend.pick("cpu", torch.float16)
    assert fp16.ops is None and "not float16" in fp16.reason
    monkeypatch.setenv(kernels.cpu.KERNELS_ENV, "0")
    kernels.cpu.cpu_ops.cache_clear()
    try:
        off = CpuBackend.pick("cpu", torch.bfloat16)
        assert (
            off.ops is None
            and off.level is None
            and off.reason == "switched off (LLMSERVE_CPU_KERNELS=0)"
        )
        assert off.paths() == ["every op: torch (switched off (LLMSERVE_CPU_KERNELS=0))"]
    finally:
        monkeypatch.delenv(kernels.cpu.KERNELS_ENV)
        kernels.cpu.cpu_ops.cache_clear()


def test_a_backend_is_whole():
    with pytest.raises(ValueError, match="must say why"):
        CpuBackend(None)
    with pytest.raises(ValueError, match="both ops and their level"):
        CpuBackend(SpyOps())
    with pytest.raises(ValueError, match="not a CPU kernel op namespace"):
        CpuBackend.of(SpyOps())


def test_kernels_are_refused_for_weights_they_do_not_take(ops):
    model = LlamaModel(TINY).to(torch.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16 weights on the CPU"):
        ModelRuntime(model, CpuBackend.of(ops))


def test_a_runtime_off_runs_nothing_on_the_kernels(ops, no_global_kernels):
    """Switched off, the runtime's linears, attention and forward leave the kernels; back on, every
    one of them takes them again."""
    torch.manual_seed(0)
    runtime = ModelRuntime(LlamaModel(TINY).bfloat16(), CpuBackend.of(ops)).eval()
    linears = [m for m in runtime.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * TINY.num_layers + 1  # the output head too
    assert all(m.ops is ops for m in linears) and runtime.attention.ops is ops
    runtime.use(CpuBackend.off("test"))
    assert all(m.ops is None for m in linears) and runtime.attention.ops is None
    runtime.use(CpuBackend.of(ops))
    assert all(m.ops is ops for m in linears) and runtime.attention.ops is ops


@needs_kernels
def test_an_engine_switched_off_samples_without_the_kernels(monkeypatch, smollm2_path):
    """LLMSERVE_CPU_KERNELS=0: the engine's one backend has no ops, and the model, attention and the
    sampler all run on it."""
    import shared.engine.engine as engine_module
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine

    handed = []
    real_sample = engine_module.sample

    def spy_sample(logits, batch, backend):
        handed.append(backend)
        return real_sample(logits, batch, backend)

    monkeypatch.setattr(engine_module, "sample", spy_sample)
    monkeypatch.setenv(kernels.cpu.KERNELS_ENV, "0")
    kernels.cpu.cpu_ops.cache_clear()
    try:
        engine = Engine(EngineConfig(model=smollm2_path, memory_budget="512MiB"), progress=False)
    finally:
        monkeypatch.delenv(kernels.cpu.KERNELS_ENV)
        kernels.cpu.cpu_ops.cache_clear()
    assert engine.backend.ops is None and "switched off" in engine.backend.reason
    assert engine.model.backend is engine.backend and engine.model.attention.ops is None
    assert all(m.ops is None for m in engine.model.modules() if isinstance(m, PackedLinear))
    monkeypatch.setattr(kernels.cpu, "cpu_ops", None)  # a step that asked kernels.cpu would fail
    engine.add_request(
        "a", "The capital of France is", SamplingParams(max_tokens=3, temperature=0.0)
    )
    while engine.has_unfinished():
        engine.step()
    assert handed and all(b is engine.backend for b in handed)
