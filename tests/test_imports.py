"""Import boundaries of docs/architecture.md ("What is pure and what does I/O"), checked
by import-linter.

The contracts live in pyproject.toml (``[tool.importlinter]``): the layers, top to
bottom, and three forbidden imports (the daemon never imports the simulator, PKI
generation or PyYAML; the pure modules do no I/O; nothing on the request path reaches
aiohttp or PyYAML). import-linter reads the source, so lazy imports inside functions
count too. This file runs them, shows that they bite, and keeps the checks
import-linter cannot express:

* every module of the package is placed in a layer (a new module must be placed);
* no pure module reaches ``urllib.request`` (import-linter sees ``urllib`` whole, and
  ``urllib.parse`` is pure).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mvproxy"
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package under ``cwd`` (it puts ``cwd`` first on sys.path)."""
    command = Path(sys.executable).with_name("lint-imports")
    if not command.exists():
        found = shutil.which("lint-imports")
        if found is None:
            pytest.fail("lint-imports is not installed (pip install import-linter)")
        command = Path(found)
    return subprocess.run([str(command), "--no-cache", "--no-logo"], cwd=cwd,
                          capture_output=True, text=True, timeout=300, check=False)


def test_the_import_contracts_are_kept():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    kept = len(CONTRACTS["contracts"])
    assert f"Contracts: {kept} kept, 0 broken." in result.stdout, result.stdout


@pytest.mark.parametrize(("module", "added", "broken"), [
    pytest.param("errors.py", "from mvproxy import listener  # noqa\n",
                 "mvproxy.errors is not allowed to import mvproxy.listener", id="upward"),
    pytest.param("routing.py", "def late():\n    import asyncio  # noqa\n",
                 "mvproxy.routing is not allowed to import asyncio", id="lazy-io"),
    pytest.param("tls.py", "from mvproxy import configfile  # noqa\n",
                 "mvproxy.listener is not allowed to import yaml", id="yaml-on-request-path"),
])
def test_the_contracts_bite(tmp_path, module, added, broken):
    """A copy of the package with one bad import added fails the contracts."""
    shutil.copytree(PACKAGE, tmp_path / "mvproxy",
                    ignore=shutil.ignore_patterns("__pycache__", "*.json", "*.gz"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "mvproxy" / module, "a") as file:
        file.write("\n" + added)
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert broken in result.stdout, result.stdout


def test_every_module_is_in_a_layer():
    layers = next(c for c in CONTRACTS["contracts"] if c["type"] == "layers")["layers"]
    placed = {name.strip() for layer in layers for name in layer.replace(":", "|").split("|")}
    modules = {f"mvproxy.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    modules.add("mvproxy.devcluster")
    assert modules - placed == set(), "place each new module in the layers of pyproject.toml"
    assert placed - modules == set()


# ------------------------------------------------ what import-linter cannot express

MODULES = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
           for p in sorted(PACKAGE.rglob("*.py"))}
PURE = next(c for c in CONTRACTS["contracts"]
            if c["type"] == "forbidden" and "asyncio" in c["forbidden_modules"])["source_modules"]


@cache
def direct_imports(module: str) -> frozenset[str]:
    """Every module named by an import statement anywhere in ``module`` (absolute names)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                stem = ".".join(base[:len(base) - (node.level - 1)]
                                + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            found.add(stem)
            found.update(f"{stem}.{alias.name}" for alias in node.names)
    return frozenset(found)


def reachable(module: str) -> set[str]:
    """Every name imported by ``module`` or by the mvproxy modules it reaches."""
    seen: set[str] = set()
    todo, visited = [module], set()
    while todo:
        current = todo.pop()
        if current in visited:
            continue
        visited.add(current)
        for name in direct_imports(current):
            seen.add(name)
            parts = name.split(".")
            # Importing a.b.c runs the packages a and a.b first.
            todo.extend(m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                        if m in MODULES)
    return seen


def test_the_walk_sees_lazy_and_indirect_imports():
    assert "mvproxy.devcluster.simserver" in direct_imports("mvproxy.commands")  # lazy
    assert "urllib.parse" in direct_imports("mvproxy.membership")  # lazy, stdlib
    assert "mvproxy.errors" in direct_imports("mvproxy.discovery")
    # heapq only through mvproxy.discovery: the walk follows mvproxy's own imports.
    assert "heapq" not in direct_imports("mvproxy.cache") and "heapq" in reachable("mvproxy.cache")


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_never_reach_urllib_request(module):
    assert not {n for n in reachable(module) if n == "urllib.request"
                or n.startswith("urllib.request.")}
