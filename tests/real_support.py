"""For tests against real kube-apiservers: the binaries, or a skip (a failure in CI).

The binaries are built by ``python3 scripts/dev.py kube-binaries`` into a cache outside
the clone (minutes per version, so never by a test). A machine without them skips
these tests; with ``CI`` set (``.ci/run`` sets it, and builds them first) a missing
binary is a failure, so CI never passes by skipping them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest

from mvproxy.devcluster import kubebinaries


def require_binaries(versions: Sequence[str]) -> Path:
    """The cache root holding every version's binaries; skip (fail under CI) otherwise."""
    root = kubebinaries.cache_root()
    missing = [v for v in versions if kubebinaries.find_binaries(v, root) is None]
    if not missing:
        return root
    why = (f"no real Kubernetes binaries for {', '.join(missing)} under {root}; build them "
           f"with `{kubebinaries.BUILD_COMMAND} {','.join(missing)}`")
    if os.environ.get("CI"):
        pytest.fail(f"{why} (CI is set: these tests must run)")
    pytest.skip(why)


def upstream_comparison() -> ModuleType:
    """``scripts/upstream_comparison.py`` as a module (registered, so its dataclasses
    work; loaded once for every test module that uses it)."""
    name = "mvproxy_script_upstream_comparison"
    if name not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "scripts" / "upstream_comparison.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
