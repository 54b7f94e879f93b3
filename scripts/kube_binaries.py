"""Build real kube-apiserver, kube-controller-manager and etcd from Go modules, and a
client-go informer for the tests, cached outside the clone (``python3 scripts/dev.py
kube-binaries [VERSIONS]``).

Why from modules: the machines have Go and the module proxy, not a release download.
``go install k8s.io/kubernetes/cmd/kube-apiserver@vX`` is refused (that module's go.mod
has replaces), so a tiny module per version requires ``k8s.io/kubernetes vX.Y.Z`` and
replaces every staging module (``v0.0.0`` in that tag's own go.mod) with its published
``v0.Y.Z`` tag. The replace lines are generated from the tag's go.mod
(:func:`generate_gomod`), never kept by hand: 1.35 has no ``streaming`` modules, 1.36
has, and the next release will differ again.

The cache (``$MVPROXY_KUBE_BINARIES``, default ``${XDG_CACHE_HOME:-~/.cache}/mvproxy/kube``) has
controller-runtime envtest's layout: ``<root>/<version>/{kube-apiserver,
kube-controller-manager,etcd}``; :func:`find_binaries` also accepts ``v<version>`` and
setup-envtest's ``k8s/<version>-<os>-<arch>`` directories. That lookup lives in
``mvproxy/devcluster/kubebinaries.py`` (stdlib only, loaded here by path), so
``mvproxy demo --real`` finds what this script builds. Build modules live under
``<root>/build/``; the module and build caches are Go's own (``go env GOMODCACHE
GOCACHE``). A version whose binaries are all present is not touched (no Go run).

``<root>/<version>/informer`` (tests/realk8s/informer: a dynamic shared informer that
prints every event as a JSON line) is built per version against that version's
``k8s.io/client-go v0.Y.Z`` only, in a module of its own (``<root>/build/
informer-<version>/``, go.mod generated from client-go's the same way; it has no
``v0.0.0`` requirements, so no replaces today). Per version rather than one binary of the
oldest client-go, which the skew policy would allow for plain list and watch: each
minor's reflector differs (watch-list on by default since 0.35, its fallbacks), and the
controllers that meet mvproxy during an upgrade run both versions' client-go; the build
costs about a minute cold, seconds warm, and runs the informer's unit tests
(``main_test.go``, ``go test``) before building. It is an extra file (with
``informer.sha256``, the digest of the Go files it was built from: an edited main.go
or main_test.go is rebuilt) in an
envtest directory and not one of :data:`BINARIES`: :func:`find_binaries` still means the
servers, :func:`find_informer` finds an up-to-date informer.

Stdlib only: dev.py runs it with whichever python3 is at hand.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WRAPPERS = ROOT / "tests" / "realk8s"


def _finder() -> Any:
    """mvproxy's cache lookup, loaded from its file: no package import, no venv needed."""
    path = ROOT / "mvproxy" / "devcluster" / "kubebinaries.py"
    spec = importlib.util.spec_from_file_location("mvproxy_kubebinaries", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_lookup = _finder()
ENV_ROOT: str = _lookup.ENV_ROOT
KUBE_BINARIES: tuple[str, ...] = _lookup.KUBE_BINARIES
BINARIES: tuple[str, ...] = _lookup.BINARIES
cache_root = _lookup.cache_root
parse_version = _lookup.parse_version
normalize = _lookup.normalize
version_dir = _lookup.version_dir
candidate_dirs = _lookup.candidate_dirs
missing_binaries = _lookup.missing_binaries
find_binaries = _lookup.find_binaries

DEFAULT_VERSIONS = ("1.35.4", "1.36.3", "1.37.2")
INFORMER = "informer"
CLIENT_GO = "k8s.io/client-go"
# What ``informer --client-go-version`` prints, each at v0.Y.Z.
INFORMER_MODULES = (CLIENT_GO, "k8s.io/apimachinery", "k8s.io/api")
ETCD_MODULE = "go.etcd.io/etcd/server/v3"
# v3.6.13 is the oldest 3.6 the proxy is known to serve; kubeadm 1.36 wants etcd >= 3.6.
ETCD_MIN = (3, 6, 13)
# The stamp upstream's hack/lib/version.sh puts into component-base; without it
# /version says v0.0.0-master+$Format:%H$.
VERSION_PKG = "k8s.io/component-base/version"
TIMEOUT = 3600


def informer_sources() -> list[Path]:
    """tests/realk8s/informer's Go files: main.go and its unit tests, in name order."""
    return sorted((WRAPPERS / INFORMER).glob("*.go"))


def informer_source_digest() -> str:
    """sha256 over tests/realk8s/informer's Go files (names and contents): the informer
    is rebuilt, and its unit tests rerun, when one changes (the file
    ``informer.sha256`` beside the binary records what it was built from)."""
    digest = hashlib.sha256()
    for source in informer_sources():
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def find_informer(version: str, root: Path | None = None) -> Path | None:
    """The informer built against ``version``'s client-go from the current main.go:
    from the first candidate directory that has it as an executable file with a
    matching ``informer.sha256``, else None (not built, or built from older source)."""
    root = cache_root() if root is None else root
    digest = informer_source_digest()
    for directory in candidate_dirs(root, version):
        binary = directory / INFORMER
        stamp = directory / f"{INFORMER}.sha256"
        if (binary.is_file() and os.access(binary, os.X_OK) and stamp.is_file()
                and stamp.read_text().strip() == digest):
            return binary
    return None


def plan(versions: Iterable[str], root: Path) -> dict[str, list[str]]:
    """For each requested version, what is still to build into :func:`version_dir`:
    the servers missing there unless a candidate directory has all three, then the
    informer unless one is found. Empty: nothing runs for that version."""
    todo: dict[str, list[str]] = {}
    for version in versions:
        key = normalize(version)
        servers = [] if find_binaries(key, root) else missing_binaries(version_dir(root, key))
        todo[key] = servers + ([] if find_informer(key, root) else [INFORMER])
    return todo


def staging_tag(version: str) -> str:
    """A staging module's tag for Kubernetes ``version``: 1.36.3 -> ``v0.36.3``."""
    _, minor, patch = parse_version(version)
    return f"v0.{minor}.{patch}"


def generate_gomod(kube_gomod: Mapping[str, Any], version: str,
                   module: str = "mvproxy.test/realk8s",
                   source: str = "k8s.io/kubernetes") -> str:
    """Our module's go.mod text from ``go mod edit -json`` of ``source``'s go.mod at
    ``version`` (k8s.io/kubernetes at ``vX.Y.Z``, a staging module such as client-go at
    ``v0.Y.Z``): require that tag, replace each ``v0.0.0`` requirement (the staging
    modules, indirect ones included) with ``v0.Y.Z``, and copy the ``go`` and ``godebug``
    lines (the tag was tested with those defaults). Other requirements are left to MVS."""
    major, minor, patch = parse_version(version)
    tag = f"v{major}.{minor}.{patch}" if source == "k8s.io/kubernetes" else staging_tag(version)
    staging = sorted({req["Path"] for req in kube_gomod.get("Require") or ()
                      if req.get("Version") == "v0.0.0"})
    lines = [f"// Generated by scripts/kube_binaries.py from {source}@{tag}'s go.mod."
             " Do not edit.",
             f"module {module}", ""]
    if kube_gomod.get("Go"):
        lines += [f"go {kube_gomod['Go']}", ""]
    godebug = kube_gomod.get("GoDebug") or kube_gomod.get("Godebug") or ()
    if godebug:
        lines += [f"godebug {entry['Key']}={entry['Value']}" for entry in godebug] + [""]
    lines += [f"require {source} {tag}", ""]
    if staging:
        lines.append("replace (")
        lines += [f"\t{path} => {path} v0.{minor}.{patch}" for path in staging]
        lines.append(")")
    return "\n".join(lines).rstrip("\n") + "\n"


def generate_informer_gomod(client_go_gomod: Mapping[str, Any], version: str) -> str:
    """The informer module's go.mod, from client-go ``v0.Y.Z``'s own go.mod."""
    return generate_gomod(client_go_gomod, version, module="mvproxy.test/realinformer",
                          source=CLIENT_GO)


def informer_modules_expected(version: str) -> str:
    """What ``informer --client-go-version`` must print for ``version``."""
    return "\n".join(f"{path} {staging_tag(version)}" for path in INFORMER_MODULES)


def generate_etcd_gomod(etcd_gomod: Mapping[str, Any], version: str,
                        module: str = "mvproxy.test/realetcd") -> str:
    """The etcd module's go.mod: require the server at ``version``, its ``go`` line."""
    lines = [f"// Generated by scripts/kube_binaries.py for {ETCD_MODULE}@{version}. Do not edit.",
             f"module {module}", ""]
    if etcd_gomod.get("Go"):
        lines += [f"go {etcd_gomod['Go']}", ""]
    lines.append(f"require {ETCD_MODULE} {version}")
    return "\n".join(lines) + "\n"


def newest_etcd(versions: Iterable[str]) -> str | None:
    """The newest ``v3.6.z`` (z >= 13, no pre-release) of a ``go list -m -versions`` list."""
    best: tuple[int, int, int] | None = None
    for text in versions:
        match = re.fullmatch(r"v3\.6\.(\d+)", text)
        if match and (3, 6, int(match.group(1))) >= ETCD_MIN:
            candidate = (3, 6, int(match.group(1)))
            best = max(best or candidate, candidate)
    return None if best is None else "v%d.%d.%d" % best


def ldflags(version: str, build_date: str) -> str:
    """-s -w plus component-base's version stamp, so ``/version`` and ``--version``
    report the real release."""
    major, minor, patch = parse_version(version)
    stamp = {"gitVersion": f"v{major}.{minor}.{patch}", "gitMajor": str(major),
             "gitMinor": str(minor), "gitTreeState": "clean", "buildDate": build_date}
    return " ".join(["-s", "-w", *(f"-X {VERSION_PKG}.{k}={v}" for k, v in stamp.items())])


class BuildError(Exception):
    """A step failed; the message says which and the tail of Go's output."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


def _go() -> str:
    found = shutil.which("go") or "/usr/local/go/bin/go"
    if not Path(found).exists():
        raise BuildError("no Go toolchain (go on PATH or /usr/local/go/bin/go)")
    return found


def _env() -> dict[str, str]:
    return {**os.environ, "CGO_ENABLED": "0"}


def _run_go(args: list[str], cwd: Path | None = None) -> str:
    """Run ``nice -n 10 go ARGS`` (the machine is shared), return stdout; BuildError
    with the output's tail on failure."""
    cmd = ["nice", "-n", "10", _go(), *args] if shutil.which("nice") else [_go(), *args]
    done = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT, check=False)
    if done.returncode:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-12:])
        raise BuildError(f"`go {' '.join(args[:3])} ...` failed:\n{tail}", done.stdout)
    return done.stdout


def _gomod_json(module: str, version: str) -> dict[str, Any]:
    """The parsed go.mod of ``module@version`` (downloaded through the module proxy)."""
    try:
        info = json.loads(_run_go(["mod", "download", "-json", f"{module}@{version}"]))
    except BuildError as exc:
        # On failure Go still prints the JSON, whose Error says why (e.g. not served).
        info = {"Error": exc.output.strip() or str(exc)}
        try:
            info = json.loads(exc.output)
        except ValueError:
            pass
    if info.get("Error") or not info.get("GoMod"):
        reason = " ".join(str(info.get("Error", "no go.mod")).split())
        raise BuildError(f"{module}@{version} cannot be downloaded: {reason}")
    parsed: dict[str, Any] = json.loads(_run_go(["mod", "edit", "-json", info["GoMod"]]))
    return parsed


def _module_dir(directory: Path, gomod: str, packages: Iterable[str]) -> None:
    """A fresh module in ``directory``: go.mod plus the wrapper mains from tests/realk8s."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    (directory / "go.mod").write_text(gomod)
    for package in packages:
        (directory / package).mkdir()
        for source in sorted((WRAPPERS / package).glob("*.go")):  # main.go (+ its tests)
            shutil.copy2(source, directory / package / source.name)


def _build(module: Path, package: str, output: Path, flags: str) -> None:
    """``go build`` one wrapper into ``output`` (written beside it, then renamed, so a
    half-built binary is never taken for a built one)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    _run_go(["build", "-trimpath", "-ldflags", flags, "-o", str(partial), f"./{package}"],
            cwd=module)
    os.replace(partial, output)


def _check_version(binary: Path, version: str) -> str:
    """``<binary> --version``, which must print ``Kubernetes vX.Y.Z``."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                         timeout=60, check=False).stdout.strip()
    if out != f"Kubernetes v{normalize(version)}":
        binary.unlink(missing_ok=True)
        raise BuildError(f"{binary.name} --version printed {out!r}")
    return out


def _step(label: str) -> float:
    print(f"kube-binaries: {label}", flush=True)
    return time.monotonic()


def _done(label: str, started: float) -> None:
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    print(f"kube-binaries: {label} in {time.monotonic() - started:.0f} s "
          f"(largest Go process so far: {peak} MiB)", flush=True)


def build_kube(version: str, names: list[str], root: Path) -> None:
    """Generate ``<root>/build/<version>``, tidy it, build ``names`` into the version's
    directory and check their ``--version``."""
    key = normalize(version)
    started = _step(f"{key}: generating the module from k8s.io/kubernetes@v{key}'s go.mod")
    module = root / "build" / key
    _module_dir(module, generate_gomod(_gomod_json("k8s.io/kubernetes", f"v{key}"), key),
                KUBE_BINARIES)
    _run_go(["mod", "tidy"], cwd=module)
    _done(f"{key}: go mod tidy", started)
    flags = ldflags(key, datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    for name in names:
        started = _step(f"{key}: building {name}")
        _build(module, name, version_dir(root, key) / name, flags)
        _done(f"{key}: {name} ({_check_version(version_dir(root, key) / name, key)})", started)


def build_informer(version: str, root: Path) -> Path:
    """Generate ``<root>/build/informer-<version>`` from client-go ``v0.Y.Z``'s go.mod,
    tidy it, build the informer into the version's directory and check that it links
    client-go, apimachinery and api at ``v0.Y.Z``."""
    key = normalize(version)
    started = _step(f"{key}: building the informer against {CLIENT_GO}@{staging_tag(key)}")
    digest = informer_source_digest()
    module = root / "build" / f"informer-{key}"
    _module_dir(module, generate_informer_gomod(_gomod_json(CLIENT_GO, staging_tag(key)), key),
                (INFORMER,))
    _run_go(["mod", "tidy"], cwd=module)
    # Its unit tests first (-trimpath, as the build, so they share Go's build cache): an
    # informer that misreports what it sees is not installed.
    _run_go(["test", "-trimpath", "-count=1", f"./{INFORMER}"], cwd=module)
    binary = version_dir(root, key) / INFORMER
    _build(module, INFORMER, binary, "-s -w")
    printed = subprocess.run([str(binary), "--client-go-version"], capture_output=True,
                             text=True, timeout=60, check=False).stdout.strip()
    if printed != informer_modules_expected(key):
        binary.unlink(missing_ok=True)
        raise BuildError(f"informer --client-go-version printed {printed!r}")
    # Written last: a binary without a matching digest is rebuilt.
    (binary.parent / f"{INFORMER}.sha256").write_text(digest + "\n")
    _done(f"{key}: informer ({printed.splitlines()[0]})", started)
    return binary


def build_etcd(root: Path) -> Path:
    """etcd at the newest v3.6.z the proxy serves, built once into
    ``<root>/etcd/<version>/etcd`` (every Kubernetes version links to it)."""
    listed = _run_go(["list", "-m", "-versions", ETCD_MODULE], cwd=root).split()[1:]
    version = newest_etcd(listed)
    if not version:
        raise BuildError(f"the module proxy serves no {ETCD_MODULE} v3.6.z >= v3.6.13")
    binary = root / "etcd" / version / "etcd"
    if binary.is_file():
        return binary
    started = _step(f"building etcd {version}")
    module = root / "build" / f"etcd-{version}"
    _module_dir(module, generate_etcd_gomod(_gomod_json(ETCD_MODULE, version), version),
                ("etcd",))
    _run_go(["mod", "tidy"], cwd=module)
    _build(module, "etcd", binary, "-s -w")
    _done(f"etcd {version}", started)
    return binary


def _link(source: Path, target: Path) -> None:
    """Hard-link (one copy on disk), else copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def main(argv: list[str]) -> int:
    """Build what is missing for each version; a version that fails is reported and
    skipped. Exit status 1 only if none of the requested versions ends up complete."""
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        versions = [normalize(v) for arg in argv or [",".join(DEFAULT_VERSIONS)]
                    for v in arg.split(",") if v.strip()]
    except ValueError as exc:
        print(f"kube-binaries: {exc}", file=sys.stderr)
        return 2
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    todo = plan(versions, root)
    failed: dict[str, str] = {}
    etcd: Path | None = None
    for version, names in todo.items():
        if not names:
            print(f"kube-binaries: {version}: present in {find_binaries(version, root)}",
                  flush=True)
            continue
        try:
            kube = [name for name in names if name in KUBE_BINARIES]
            if kube:
                build_kube(version, kube, root)
            if "etcd" in names:
                etcd = etcd or build_etcd(root)
                _link(etcd, version_dir(root, version) / "etcd")
            if INFORMER in names:
                build_informer(version, root)
        except (BuildError, OSError, subprocess.SubprocessError) as exc:
            failed[version] = str(exc)
            print(f"kube-binaries: {version} could not be built: {exc}", flush=True)
            continue
        print(f"kube-binaries: {version}: built in {version_dir(root, version)}", flush=True)
    for version, reason in failed.items():
        print(f"kube-binaries: NOT BUILT {version}: {reason.splitlines()[0]}", file=sys.stderr)
    return 1 if len(failed) == len(todo) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
