"""The package rules: the wire layer (``shared.wire``) imports neither the engine, the services nor
torch; the engine never imports the services or the tooling; the gateway, tokenizer and scheduler
services run without torch. Checked statically (every import statement, at any depth of a module)
and by importing each service in a fresh interpreter (what it pulls in transitively)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# package prefix -> module prefixes it must never import
FORBIDDEN = {
    "shared/wire": ("shared.engine", "services", "kernels", "torch", "triton"),
    "shared/metrics": ("shared.engine", "services", "kernels", "torch", "triton"),
    "shared/engine": ("services", "opentelemetry"),  # the engine reports, the shell traces
    "services/gateway": ("torch", "kernels", "shared.engine.models", "services.cli"),
    "services/tokenizer": ("torch", "kernels", "shared.engine.models", "services.cli"),
    "services/scheduler": ("torch", "kernels", "shared.engine", "services.cli"),
    "services/prefix_index": ("torch", "kernels", "shared.engine", "services.cli"),
    "services/executor": ("services.cli",),
}
TORCH_FREE_SERVICES = (
    "services.gateway",
    "services.tokenizer",
    "services.scheduler",
    "services.prefix_index",
)


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every absolute module an import statement in ``path`` names (``from a import b``: a and
    a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in sorted(imported_modules(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_follow_the_rules(package):
    assert (ROOT / package).is_dir()
    assert violations(package, FORBIDDEN[package]) == []


def test_the_rule_check_sees_a_violation(tmp_path, monkeypatch):
    (tmp_path / "shared" / "wire").mkdir(parents=True)
    (tmp_path / "shared" / "wire" / "bad.py").write_text(
        "def f():\n    from shared.engine.engine import LLMEngine\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("shared/wire", FORBIDDEN["shared/wire"]) == [
        "shared/wire/bad.py imports shared.engine.engine",
        "shared/wire/bad.py imports shared.engine.engine.LLMEngine",
    ]


@pytest.mark.parametrize("package", TORCH_FREE_SERVICES)
def test_service_runs_without_torch(package):
    # Every module of the service but __main__ (which would start it), in a fresh interpreter.
    modules = sorted(
        p.stem for p in (ROOT / package.replace(".", "/")).glob("*.py") if p.stem != "__main__"
    )
    code = (
        f"import sys; from {package} import {', '.join(modules)}; "
        "print(','.join(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('torch', 'triton', 'kernels'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
