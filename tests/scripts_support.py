"""The repository's scripts (``scripts/*.py``) as modules, and the Debian tools that
``scripts/dev.py test`` installs, for tests that need either."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def script(name: str) -> ModuleType:
    """``scripts/<name>.py`` loaded as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"mvproxy_script_{name}",
                                                  ROOT / "scripts" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def debian_tool(tool: str, ensure: str, required_by: str) -> str:
    """The path of ``tool``, installed by ``dev.py``'s ``ensure`` function if missing.
    Skips when that is impossible here; fails instead when the environment variable
    ``required_by`` is set (``.ci/run`` sets it: the test must run in CI)."""
    found = getattr(script("dev"), ensure)()
    if found:
        return found
    why = f"{tool} is not installed and cannot be installed here (needs apt-get as root)"
    if os.environ.get(required_by):
        pytest.fail(f"{why}; {required_by} is set")
    pytest.skip(why)
