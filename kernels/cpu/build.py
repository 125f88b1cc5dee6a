"""Compiles the kernels of one ISA level into a Python extension module (once per machine) and
imports it.

Each level's library is named by a digest of the sources, the level's flags, the compiler and
torch, and kept under ``LLMSERVE_KERNEL_CACHE`` (default ``~/.cache/llmserve/kernels``): later
processes load it in milliseconds, whichever checkout of the sources built it; a changed source
builds anew. A build that fails leaves ``build.failed`` beside it with the compiler's message, and
every later process raises that message at once instead of compiling again (delete the file, or
change the sources, to retry). Processes building the same library at once wait on torch's build
lock.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

from kernels.cpu.isa import Level

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
CACHE_ENV = "LLMSERVE_KERNEL_CACHE"
_COMMON_FLAGS = ("-O3", "-fno-math-errno", "-fopenmp")
_FAILED = "build.failed"
_LOCK = "lock"  # torch's build lock (cpp_extension's FileBaton) inside the build directory
_LOCK_WAIT_S = 900.0


class KernelBuildError(RuntimeError):
    """The kernels of a level could not be built here; the message says why."""


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def namespace(level: Level) -> str:
    return f"llmserve_cpu_{level.name}"


def _compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise KernelBuildError(
            f"no C++ compiler ({cxx!r} is not on PATH): install g++ to build the CPU kernels"
        )
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    return out.splitlines()[0] if out else cxx


def _flags(level: Level) -> list[str]:
    return [*_COMMON_FLAGS, *level.cflags, f"-DLLMSERVE_NAMESPACE={namespace(level)}"]


def library_name(level: Level) -> str:
    import torch

    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(
        " ".join(_flags(level)).encode() + _compiler_version().encode() + torch.__version__.encode()
    )
    h.update(sys.version.encode())
    return f"{namespace(level)}_{h.hexdigest()[:12]}"


def build_dir(level: Level) -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "llmserve" / "kernels")
    return root / library_name(level)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def _built_library(directory: Path) -> Path | None:
    """The library built under ``directory``, or None if there is none and no build is under way.

    A library older than the build lock is whole (a lock left by a killed build does not hold up
    its users); one written after the lock was taken may still be being linked, so that wait is
    bounded."""
    library, lock = directory / f"{directory.name}.so", directory / _LOCK
    deadline = time.monotonic() + _LOCK_WAIT_S
    while True:
        built, locked = _mtime(library), _mtime(lock)
        if built is not None and (locked is None or built < locked):
            return library
        if locked is None:
            return None
        if time.monotonic() > deadline:
            raise KernelBuildError(
                f"a kernel build has held {lock} for {_LOCK_WAIT_S:.0f} s; if no build is "
                "running, delete it"
            )
        time.sleep(0.5)


def _summary(output: str) -> str:
    """The compiler's first error lines, or the output's last line if it names none."""
    errors = [
        line.strip()
        for line in output.splitlines()
        if "error" in line and ("error:" in line or "Error" in line)
    ]
    lines = errors[:3] or output.strip().splitlines()[-1:]
    return " | ".join(lines)[:1000]


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None, library
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def load(level: Level) -> ModuleType:
    """The level's ops, a module whose ``name`` is ``llmserve_cpu_<level>``, compiling it first if
    this machine has none. Raises KernelBuildError if it cannot be built (now or by an earlier
    process)."""
    from torch.utils import cpp_extension

    directory = build_dir(level)
    name = directory.name
    if name in sys.modules:
        return sys.modules[name]  # loaded already by this process
    failed = directory / _FAILED
    if failed.exists():
        raise KernelBuildError(
            f"{level.name} kernels failed to build earlier: {_summary(failed.read_text())} "
            f"(the compiler's output: {failed}; delete it to try again)"
        )
    directory.mkdir(parents=True, exist_ok=True)
    built = _built_library(directory)
    if built is not None:
        # The name is a digest of everything the library depends on, so a library under it is
        # current. Imported directly: cpp_extension would rebuild it for sources at another path
        # (another checkout).
        return _import(name, built)
    t0 = time.perf_counter()
    log.info("building the %s CPU kernels (once per machine, about a minute)", level.name)
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(p) for p in sources()],
            extra_cflags=_flags(level),
            extra_include_paths=[str(CSRC)],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=True,
            verbose=False,
        )
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        message = str(exc)
        failed.write_text(message)
        raise KernelBuildError(
            f"{level.name} kernels failed to build: {_summary(message)} "
            f"(the compiler's output: {failed})"
        ) from exc
    log.info("%s CPU kernels ready in %.1f s", level.name, time.perf_counter() - t0)
    sys.modules[name] = module
    return module
