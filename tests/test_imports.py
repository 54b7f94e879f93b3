"""Import boundaries of DESIGN.md "Package layout", read from the source (AST), not by importing.

* The daemon's core (everything in ``mvproxy/`` except ``devcluster/``, ``cli.py`` and
  ``commands.py``) never imports ``mvproxy.devcluster``, directly or through another
  mvproxy module, not even lazily inside a function: the simulated control plane
  must stay out of the request path and out of the container image's hot code.
* The pure modules (``config``, ``errors``, ``discovery``, ``requestinfo``,
  ``routing``, ``cache``, ``requestcheck``, ``wire``) never reach aiohttp or anything
  that opens sockets, so they are table-tested without I/O.
* Nothing on the request path (listener to upstream) reaches aiohttp.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mvproxy"
NOT_CORE = ("devcluster", "cli", "commands", "__main__")
PURE = ("config", "errors", "discovery", "requestinfo", "routing", "cache", "requestcheck",
        "wire", "status", "statuspage", "builtinmvp", "reload")
NO_IO = ("aiohttp", "asyncio", "socket", "ssl", "selectors", "http", "urllib.request",
         "multidict", "yarl", "subprocess")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


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
                base = base[:len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            if stem == "__future__":
                continue
            found.add(stem)
            # ``from mvproxy import devcluster``: the names may be submodules.
            found.update(f"{stem}.{alias.name}" for alias in node.names
                         if f"{stem}.{alias.name}" in MODULES)
    return frozenset(found)


def _owner(name: str) -> str | None:
    """The mvproxy module a dotted import name resolves to (None: not ours)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def reachable(module: str) -> dict[str, str]:
    """Every import reachable from ``module`` -> the mvproxy module that imports it."""
    seen: dict[str, str] = {}
    todo = [module]
    visited: set[str] = set()
    while todo:
        current = todo.pop()
        if current in visited:
            continue
        visited.add(current)
        for name in direct_imports(current):
            seen.setdefault(name, current)
            owner = _owner(name)
            if owner is not None:
                # Importing a.b.c runs the packages a and a.b first.
                parts = owner.split(".")
                todo.extend(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return seen


def is_core(module: str) -> bool:
    parts = module.split(".")
    return not (len(parts) > 1 and parts[1] in NOT_CORE)


CORE = sorted(m for m in MODULES if is_core(m))


def test_the_walk_sees_the_package():
    assert {"mvproxy", "mvproxy.routing", "mvproxy.app", "mvproxy.devcluster.catalog"} <= set(
        MODULES)
    assert "mvproxy.cli" not in CORE and "mvproxy.devcluster.simserver" not in CORE
    assert "mvproxy.errors" in direct_imports("mvproxy.discovery")  # a relative import
    assert "mvproxy.devcluster.simserver" in direct_imports("mvproxy.commands")  # a lazy one
    # The checks below would see a violation: the walk follows mvproxy's own imports.
    assert any(n.startswith("mvproxy.devcluster.") for n in reachable("mvproxy.cli"))
    assert "aiohttp" in reachable("mvproxy.app") and "asyncio" in reachable("mvproxy.app")
    assert "aiohttp" in reachable("mvproxy.polling") or "aiohttp" in reachable("mvproxy.admin")


@pytest.mark.parametrize("module", CORE)
def test_core_never_imports_devcluster(module):
    leaks = {name: via for name, via in reachable(module).items()
             if name == "mvproxy.devcluster" or name.startswith("mvproxy.devcluster.")}
    assert not leaks, f"{module} reaches the simulated control plane: {leaks}"


@pytest.mark.parametrize("module", [f"mvproxy.{m}" for m in PURE])
def test_pure_modules_do_no_io(module):
    bad = {name: via for name, via in reachable(module).items()
           if any(name == top or name.startswith(top + ".") for top in NO_IO)}
    assert not bad, f"{module} reaches I/O modules: {bad}"


DATA_PLANE = ("discovery", "routing", "requestinfo", "requestcheck", "identity", "wire",
              "kubestatus", "listener", "transport", "forwarding", "tunnel", "handlers",
              "discoveryhandler", "openapi", "polling")


@pytest.mark.parametrize("module", [f"mvproxy.{m}" for m in DATA_PLANE])
def test_request_path_never_touches_aiohttp(module):
    """The hot path is asyncio Protocols + llhttp; aiohttp serves only the admin
    listener and the simulator (DESIGN.md "Data plane")."""
    assert not any(_owner(name) is None and name.split(".")[0] == "aiohttp"
                   for name in reachable(module))
