"""Which modules of the pure core run compiled (mypyc), and the switch to pure Python.

The wheel, the development venv, the standalone binary and the image compile
``MODULES`` with mypyc when it is there at build time (``setup.py``); each ``.py`` stays
beside its extension, so a tree built without mypyc or without a C compiler is pure
Python and works the same. ``MVPROXY_PURE=1`` in the environment makes ``mvproxy``
import the ``.py`` of each even where the extension exists: that is how the pure
fallback is tested (``.ci/run``). Stdlib only, imported by ``mvproxy/__init__.py``
before any other module of the package. See docs/compiled.md.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

MODULES = ("accept", "cache", "discovery", "failover", "flow", "forwarding", "handlers",
           "listener", "live", "requestcheck", "requestinfo", "routing", "transport", "wire")
"""Compiled when built with mypyc (``setup.py`` reads this tuple): what the profile of a
small GET names (bench/compiled.py, docs/compiled.md)."""
PURE_ENV = "MVPROXY_PURE"
_PACKAGE = Path(__file__).resolve().parent


def pure_requested(environ: dict[str, str] | None = None) -> bool:
    """Whether ``MVPROXY_PURE`` asks for pure Python (``1``, ``true`` or ``yes``)."""
    value = (os.environ if environ is None else environ).get(PURE_ENV, "")
    return value.strip().lower() in ("1", "true", "yes")


class _PureFinder(importlib.abc.MetaPathFinder):
    """Finds the ``.py`` of a compiled module before the extension would be found."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != __package__ or name not in MODULES:
            return None
        source = _PACKAGE / f"{name}.py"
        if not source.is_file():  # the frozen binary carries the extensions alone
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def install_pure_finder() -> None:
    """Import ``MODULES`` from their ``.py`` from now on (once; before they are imported)."""
    if not any(isinstance(finder, _PureFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PureFinder())


def is_compiled(module: ModuleType) -> bool:
    """Whether ``module`` was loaded from an extension module, not from Python source."""
    where = getattr(module, "__file__", None) or ""
    return where.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def in_use() -> tuple[str, ...]:
    """The modules of ``MODULES`` that this process runs compiled (imports them)."""
    modules = [importlib.import_module(f"{__package__}.{name}") for name in MODULES]
    return tuple(name for name, module in zip(MODULES, modules, strict=True)
                 if is_compiled(module))


def describe() -> str:
    """What ``mvproxy --version`` says after the version: compiled, and what, or not."""
    compiled = in_use()
    if not compiled:
        return "pure Python"
    return f"compiled: {', '.join(compiled)}"
