"""Which CPU kernel level runs where: levels from the CPU's flags, the LLMSERVE_CPU_ISA cap, a build
failure remembered instead of retried, and the diagnostics `python -m kernels.cpu` prints."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import kernels.cpu
from kernels.cpu import build, isa

# A level no process has loaded (the real ones may be: load() returns those without a look at the
# disk).
UNLOADED = isa.Level("test_only", ("avx2", "fma"), ("-mavx2", "-mfma"))
AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})  # an AVX2 laptop or cloud VM
ZEN4 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}


@pytest.fixture
def x86(monkeypatch):
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(isa.ISA_ENV, raising=False)


def names(levels):
    return [lv.name for lv in levels]


def test_levels_follow_the_cpu_flags(x86):
    assert names(isa.supported_levels(ZEN4)) == ["avx2", "avx512", "avx512_bf16"]
    assert names(isa.supported_levels(ZEN4 - {"avx512_bf16"})) == ["avx2", "avx512"]
    assert names(isa.supported_levels(AVX2_ONLY)) == ["avx2"]
    assert names(isa.supported_levels(AVX2_ONLY - {"fma"})) == []  # pre-2013 x86: the torch path


def test_the_cap_stops_at_its_level_and_rejects_unknown_names(x86, monkeypatch):
    monkeypatch.setenv(isa.ISA_ENV, "avx2")
    assert names(isa.supported_levels(ZEN4)) == ["avx2"]
    monkeypatch.setenv(isa.ISA_ENV, "AVX512")
    assert names(isa.supported_levels(ZEN4)) == ["avx2", "avx512"]
    monkeypatch.setenv(isa.ISA_ENV, "avx512_bf16")
    assert names(isa.supported_levels(AVX2_ONLY)) == ["avx2"]  # a cap never adds what the CPU lacks
    monkeypatch.setenv(isa.ISA_ENV, "sse2")
    with pytest.raises(
        ValueError, match="unknown CPU ISA level 'sse2': expected one of avx2, avx512, avx512_bf16"
    ):
        isa.supported_levels(ZEN4)


def test_an_arm_cpu_runs_the_torch_path_and_says_why(monkeypatch):
    monkeypatch.setattr(isa.platform, "machine", lambda: "aarch64")
    kernels.cpu.cpu_ops.cache_clear()
    try:
        assert isa.supported_levels() == [] and kernels.cpu.cpu_ops() is None
        assert (
            kernels.cpu.unavailable_reason()
            == "no kernel level runs on this CPU: this CPU is aarch64, not x86-64"
        )
    finally:
        kernels.cpu.cpu_ops.cache_clear()


def test_a_level_the_cpu_lacks_is_refused_before_any_compile(x86, monkeypatch):
    monkeypatch.setattr(isa, "cpu_flags", lambda: AVX2_ONLY)
    kernels.cpu.ops_at.cache_clear()
    monkeypatch.setattr(build, "load", lambda level: pytest.fail(f"compiled {level.name}"))
    try:
        with pytest.raises(
            ValueError, match="cannot run the avx512_bf16 kernels: it lacks avx512f, avx512bw"
        ):
            kernels.cpu.ops_at("avx512_bf16")
        assert isa.why_not(isa.level("avx512")).startswith("the CPU lacks avx512f")
    finally:
        kernels.cpu.ops_at.cache_clear()


def test_below_avx512_onednn_is_not_used_for_bf16(monkeypatch):
    monkeypatch.setenv(isa.ISA_ENV, "avx2")
    assert not isa.onednn_usable(torch.bfloat16) and not isa.onednn_usable(torch.float16)


def test_a_failed_build_is_remembered_not_retried(tmp_path, monkeypatch):
    """The first failure writes build.failed beside the library; every later load raises its message
    at once (one file check), without running the compiler again."""
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    level = UNLOADED
    directory = build.build_dir(level)
    directory.mkdir(parents=True)
    (directory / "build.failed").write_text(
        "ops.cpp:1:1: error: something the compiler said\nninja: stopped\n"
    )
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("compiled again"))
    t0 = time.perf_counter()
    with pytest.raises(
        build.KernelBuildError,
        match=r"test_only kernels failed to build earlier: ops.cpp:1:1: error: "
        r"something the compiler said \(the compiler's output: .*build.failed",
    ):
        build.load(level)
    assert time.perf_counter() - t0 < 0.5


def test_a_compile_error_is_reported_and_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    from torch.utils import cpp_extension

    def fails(**kw):
        raise RuntimeError(
            "Error building extension 'x': [1/2] c++ ...\n"
            "norm.cpp:3:4: error: 'vf' was not declared\n"
        )

    monkeypatch.setattr(cpp_extension, "load", fails)
    level = UNLOADED
    with pytest.raises(
        build.KernelBuildError, match=r"norm\.cpp:3:4: error: 'vf' was not declared"
    ):
        build.load(level)
    assert "'vf' was not declared" in (build.build_dir(level) / "build.failed").read_text()


def test_a_built_library_is_loaded_without_the_compiler(tmp_path, monkeypatch):
    """A library under its digest is used as it is, whichever checkout built it: cpp_extension is
    not called (it would rebuild for sources at another path), and a build lock older than the
    library (left by a killed build) does not hold it up."""
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    directory = build.build_dir(UNLOADED)
    directory.mkdir(parents=True)
    library = directory / f"{directory.name}.so"
    library.write_bytes(b"")
    os.utime(library, (1_000, 1_000))
    (directory / "lock").touch()
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("compiled again"))
    loaded: list[str] = []
    monkeypatch.setattr(build, "_import", lambda name, library: loaded.append(str(library)))
    build.load(UNLOADED)
    assert loaded == [str(library)]


def test_a_library_being_linked_is_waited_for_within_a_bound(tmp_path, monkeypatch):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(build, "_LOCK_WAIT_S", 0.2)
    directory = build.build_dir(UNLOADED)
    directory.mkdir(parents=True)
    (directory / "lock").touch()
    os.utime(directory / "lock", (1_000, 1_000))
    (directory / f"{directory.name}.so").write_bytes(
        b""
    )  # newer than the lock: still being written
    with pytest.raises(
        build.KernelBuildError,
        match=r"a kernel build has held .*lock for 0 s; if no build is running",
    ):
        build.load(UNLOADED)


def test_no_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(
        build.KernelBuildError,
        match=r"no C\+\+ compiler \('no-such-compiler' is not on PATH\): install g\+\+",
    ):
        build.load(UNLOADED)


@pytest.mark.skipif(
    not isa.supported_levels(), reason=f"no kernel level here: {isa.why_not(isa.LEVELS[0])}"
)
def test_diagnostics_name_each_ops_path_at_the_capped_level():
    env = {**os.environ, isa.ISA_ENV: "avx2"}
    out = subprocess.run(
        [sys.executable, "-m", "kernels.cpu"], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr
    assert "LLMSERVE_CPU_ISA=avx2: levels above it are not used" in out.stdout
    assert "ops at the avx2 level (llmserve_cpu_avx2):" in out.stdout
    for op in (
        "rms_norm",
        "rope_and_cache",
        "silu_mul",
        "argmax_rows",
        "decode_attention",
        "prefill_attention",
        "linear_bf16",
        "linear_int8",
        "linear_gguf",
    ):
        assert f"\n  {op}" in out.stdout, op
    assert "AVX512" not in out.stdout.split("ops at the avx2 level")[1].split("oneDNN")[0]
