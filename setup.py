"""The build's one dynamic part: the pure core compiled with mypyc, when it can be.

Everything else is in pyproject.toml. ``mvproxy/compiled.py`` names the modules
(``MODULES``). They are compiled when mypyc imports (``build-system.requires`` has
mypy; the lock pins it) and ``MVPROXY_PURE`` is not set at build time; each extension
is optional, so a machine without a C compiler builds a pure-Python wheel instead of
failing. The ``.py`` files ship either way (docs/compiled.md).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def compiled_modules() -> list[str]:
    """``MODULES`` of mvproxy/compiled.py, read without importing the package."""
    tree = ast.parse((ROOT / "mvproxy" / "compiled.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "MODULES" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise SystemExit("setup.py: mvproxy/compiled.py defines no MODULES")


def extensions() -> list:
    if os.environ.get("MVPROXY_PURE", "").strip().lower() in ("1", "true", "yes"):
        print("setup.py: MVPROXY_PURE is set: building pure Python")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("setup.py: mypyc is not installed: building pure Python")
        return []
    paths = [f"mvproxy/{name}.py" for name in compiled_modules()]
    # One shared library inside the package (mvproxy/_core__mypyc*.so), not a
    # hash-named module at the top of site-packages.
    try:
        built = mypycify(paths, opt_level="3", group_name="mvproxy._core")
    except (Exception, SystemExit) as exc:  # mypyc exits on a type error it finds
        # An unpinned mypy (an isolated `pip install .`) may judge the code differently
        # from the lock's: build pure Python rather than no wheel. The pinned builds
        # (dev venv, binary, image) are checked to be compiled by the tests.
        print(f"setup.py: mypyc failed ({exc!r}): building pure Python")
        return []
    for extension in built:
        extension.optional = True  # no C compiler: a warning and the .py, not a failure
    return built


if __name__ == "__main__":  # as setuptools' build backend runs it; not when imported
    # (dev.py and the tests import it for compiled_modules: no setuptools then, whose
    # vendored distributions would join the importer's sys.path)
    from setuptools import setup

    setup(ext_modules=extensions())
