"""Where real kube-apiserver, kube-controller-manager and etcd binaries are kept.

``python3 scripts/dev.py kube-binaries`` builds them into a cache outside the clone,
in controller-runtime envtest's layout: ``<root>/<version>/{kube-apiserver,
kube-controller-manager,etcd}``. The root is ``$MVPROXY_KUBE_BINARIES``, else
``${XDG_CACHE_HOME:-~/.cache}/mvproxy/kube``. :func:`find_binaries` also accepts a
``v<version>`` directory and setup-envtest's ``k8s/<version>-<os>-<arch>``.

Shared by ``mvproxy demo --real`` and ``scripts/kube_binaries.py`` (which loads this
file by path), so it imports the standard library only.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from collections.abc import Mapping
from pathlib import Path

ENV_ROOT = "MVPROXY_KUBE_BINARIES"
KUBE_BINARIES = ("kube-apiserver", "kube-controller-manager")
BINARIES = (*KUBE_BINARIES, "etcd")
#: How to build what is missing, from a checkout of the mvproxy sources.
BUILD_COMMAND = "python3 scripts/dev.py kube-binaries"


def cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    """``$MVPROXY_KUBE_BINARIES`` if set, else ``~/.cache/mvproxy/kube`` (outside the clone)."""
    if environ.get(ENV_ROOT):
        return Path(environ[ENV_ROOT]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mvproxy" / "kube"


def parse_version(text: str) -> tuple[int, int, int]:
    """``1.36.3`` or ``v1.36.3`` as (1, 36, 3); ValueError for anything else."""
    match = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)", text.strip())
    if not match:
        raise ValueError(f"not a Kubernetes version X.Y.Z: {text!r}")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def normalize(text: str) -> str:
    """The cache key: ``1.36.3`` (envtest names its directories without the ``v``)."""
    return "%d.%d.%d" % parse_version(text)


def version_dir(root: Path, version: str) -> Path:
    """Where the builder puts a version's binaries."""
    return root / normalize(version)


def candidate_dirs(root: Path, version: str) -> list[Path]:
    """The directories that may hold a version's binaries, in lookup order: ours,
    ``v``-prefixed, and setup-envtest's ``k8s/<version>-<os>-<arch>``."""
    key = normalize(version)
    osname = sys.platform  # linux, darwin: the names setup-envtest uses
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    return [root / key, root / f"v{key}", root / "k8s" / f"{key}-{osname}-{arch}",
            root / f"{key}-{osname}-{arch}"]


def missing_binaries(directory: Path) -> list[str]:
    """Which of kube-apiserver, kube-controller-manager and etcd are not executable files
    in ``directory``."""
    return [name for name in BINARIES
            if not ((directory / name).is_file() and os.access(directory / name, os.X_OK))]


def find_binaries(version: str, root: Path | None = None) -> Path | None:
    """The first candidate directory holding all three binaries for ``version``, else
    None."""
    root = cache_root() if root is None else root
    for directory in candidate_dirs(root, version):
        if not missing_binaries(directory):
            return directory
    return None


__all__ = [
    "BINARIES",
    "BUILD_COMMAND",
    "ENV_ROOT",
    "KUBE_BINARIES",
    "cache_root",
    "candidate_dirs",
    "find_binaries",
    "missing_binaries",
    "normalize",
    "parse_version",
    "version_dir",
]
