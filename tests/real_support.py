"""For tests against real kube-apiservers: the binaries, or a skip (a failure in CI).

The binaries are built by ``python3 scripts/dev.py kube-binaries`` into a cache outside
the clone (minutes per version, so never by a test). A machine without them skips
these tests; with ``CI`` set (``.ci/run`` sets it, and builds them first) a missing
binary is a failure, so CI never passes by skipping them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

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
