#!/usr/bin/env python3
"""The README's commands: ``dev.py demo``, ``test``, ``lint``, ``binary``, ``kubectl``.

Needs only Python 3.11+. Creates ``.venv`` next to the repository root (or
``$MVPROXY_VENV``), installs every distribution in ``requirements.lock`` into it
(hash-checked, nothing else: the lock holds the test and lint tools and the build
backend) and mvproxy itself editable, its pure core compiled in place by the lock's
mypyc (docs/compiled.md), when the lock, ``pyproject.toml`` or a compiled module's
source changed since the last install, then runs the command there. Extra arguments go to
``mvproxy demo`` or to pytest. ``lint`` runs ruff, mypy and import-linter (what
``.ci/run`` checks before the tests), stopping at the first that fails. ``test`` also
installs Chromium (Debian's ``chromium``, with apt-get when running as root) for the
status page's browser test, and promtool (Debian's ``prometheus``) for the alert rules'
tests.
``binary`` builds the standalone executable ``dist/mvproxy`` (see ``build_binary``):
one file with its own interpreter, frozen by PyInstaller in a build venv of its own
(the lock's [runtime] and [binary] sections), cached outside the clone by the digest of
its sources. ``rootfs`` makes the Python-less Debian root file system the binary's
tests run it in (``debootstrap``, root only; see ``build_rootfs``).
``kubectl [X.Y]`` downloads the test suite's pinned kubectl into ``.tools/`` and prints
its path (for a machine with no kubectl).
``kube-binaries [VERSIONS]`` builds real kube-apiserver, kube-controller-manager and
etcd from Go modules, and the tests' client-go informer, into ``$MVPROXY_KUBE_BINARIES``
(default ``~/.cache/mvproxy/kube``; see ``scripts/kube_binaries.py``); it needs Go, not
the venv.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("MVPROXY_VENV", ROOT / ".venv"))
STAMP = VENV / ".mvproxy-installed"


def _bin(name: str) -> Path:
    return VENV / "bin" / name


def compiled_sources() -> list[Path]:
    """What the editable install compiles with mypyc (setup.py: mvproxy/compiled.py's
    MODULES), and the files that decide how."""
    setup = ROOT / "setup.py"  # imported, it only defines (setup() runs as __main__)
    names = _load(setup, "mvproxy_dev_setup").compiled_modules()
    return [setup, ROOT / "mvproxy" / "compiled.py",
            *(ROOT / "mvproxy" / f"{name}.py" for name in names)]


def _wanted_stamp() -> str:
    """Changes with the lock (a refreshed lock reinstalls), with pyproject.toml (entry
    points, package data: the editable install) and with the compiled modules' sources
    (the editable install built their extensions in place: a changed .py rebuilds
    them, so no stale extension shadows it)."""
    digest = hashlib.sha256()
    for path in (LOCK, ROOT / "pyproject.toml", *compiled_sources()):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes()
                      + b"\0")
    return digest.hexdigest()


# Never removed from the venv though the lock may not pin them: mvproxy (installed
# editable from this tree) and pip (the installer, from ensurepip).
UNLOCKED = {"mvproxy", "pip"}
LOCK = ROOT / "requirements.lock"

_INSTALLED = ("import importlib.metadata as m, re;"
              "print('\\n'.join(sorted({re.sub(r'[-_.]+', '-', d.metadata['Name']).lower()"
              " for d in m.distributions()})))")


def _remove_unlocked(pip: list[str]) -> None:
    """Uninstall what an older lock put in the venv and this one no longer pins, so
    the venv holds exactly the lock (plus mvproxy)."""
    lock = _script("lock")
    sections = lock.sections(LOCK.read_text())
    locked = set(sections["runtime"]) | set(sections["dev"])
    installed = subprocess.run([str(_bin("python")), "-c", _INSTALLED], check=True,
                               capture_output=True, text=True, timeout=120).stdout.split()
    stale = sorted(set(installed) - locked - UNLOCKED)
    if stale:
        print(f"dev.py: removing what the lock no longer pins: {' '.join(stale)}", flush=True)
        subprocess.run(pip + ["uninstall", "-y", *stale], check=True, timeout=600)


def _script(name: str):
    """``scripts/<name>.py`` as a module (scripts/ is not a package)."""
    return _load(ROOT / "scripts" / f"{name}.py", f"mvproxy_dev_{name}")


def _load(path: Path, module_name: str):
    """A Python file as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ensure_env() -> None:
    """Create the virtual environment and install the lock and the project, if not
    done already for this lock and pyproject.toml."""
    if sys.version_info < (3, 11):
        sys.exit(f"mvproxy needs Python 3.11 or newer, this is {sys.version.split()[0]}")
    if not _bin("python").exists():
        print(f"dev.py: creating virtual environment {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    if STAMP.exists() and STAMP.read_text() == _wanted_stamp():
        return
    print(f"dev.py: installing {LOCK.name} (hash-checked) and mvproxy", flush=True)
    STAMP.unlink(missing_ok=True)
    pip = [str(_bin("python")), "-m", "pip", "--disable-pip-version-check", "-q"]
    # The lock's [runtime] and [dev] sections; [binary] (PyInstaller) goes only into
    # the binary's own build venv (build_binary).
    lock = _script("lock")
    wanted = VENV / "requirements-dev.txt"
    wanted.write_text("".join(lock.select(LOCK.read_text(), section)
                              for section in ("runtime", "dev")))
    subprocess.run(pip + ["install", "--no-deps", "--require-hashes", "-r", str(wanted)],
                   check=True, timeout=1800)
    # The build backend comes from the lock too: nothing unpinned is downloaded. The
    # lock's mypy (mypyc) compiles the core in place (setup.py), so tests import the
    # extensions; tests/test_compiled.py checks that they do. Always compiled, whatever
    # MVPROXY_PURE says: that switch picks what a process imports, not what is built.
    build_env = {k: v for k, v in os.environ.items() if k != "MVPROXY_PURE"}
    subprocess.run(pip + ["install", "--no-deps", "--no-build-isolation", "-e", str(ROOT)],
                   check=True, timeout=600, env=build_env)
    _remove_unlocked(pip)
    STAMP.write_text(_wanted_stamp())


CHROMIUM = ("chromium", "chromium-browser")
PROMTOOL = ("promtool",)


def _which(names: tuple[str, ...]) -> str | None:
    return next(filter(None, map(shutil.which, names)), None)


def find_chromium() -> str | None:
    return _which(CHROMIUM)


def ensure_debian_tool(names: tuple[str, ...], package: str, used_by: str) -> str | None:
    """The path of the first of ``names`` on PATH, installing Debian's ``package`` first
    if none is there and this is root on a system with apt-get; None (with the reason
    printed) if that is impossible."""
    found = _which(names)
    if found:
        return found
    if not shutil.which("apt-get") or os.geteuid() != 0:
        print(f"dev.py: {names[0]} is missing and cannot be installed here (needs apt-get "
              f"as root): {used_by} will be skipped", flush=True)
        return None
    print(f"dev.py: installing {package} (apt-get)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(["apt-get", "update", "-q"], check=True, env=env, timeout=600,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends",
                        package], check=True, env=env, timeout=1200,
                       stdout=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"dev.py: installing {package} failed: {exc}", flush=True)
    return _which(names)


def ensure_chromium() -> str | None:
    """Chromium, for the status page's browser test."""
    return ensure_debian_tool(CHROMIUM, "chromium", "the status page's browser test")


def ensure_promtool() -> str | None:
    """promtool (Debian's ``prometheus``), which checks and unit-tests the alert rules."""
    return ensure_debian_tool(PROMTOOL, "prometheus", "the Prometheus rule tests")


def _run(*cmd: str | Path) -> None:
    subprocess.run([str(c) for c in cmd], check=True, timeout=900)


BINARY_CACHE = Path(os.environ.get("MVPROXY_BINARY_CACHE",
                                   Path.home() / ".cache" / "mvproxy" / "binary"))
"""Built binaries by source digest, and the build venvs, outside the clone: a fresh
clone (CI's) reuses what an earlier build of the same sources made."""
KEEP_BUILDS = 4
FROZEN_MAIN = "import sys\n\nfrom mvproxy.frozen import main\n\nsys.exit(main())\n"


def private_cache(path: Path) -> Path:
    """``path`` as a directory only this user can change: made (or set) 0700, and every
    directory above it owned by root or this user and not writable by others unless
    sticky (mvproxy/frozen.py's rule, loaded by path: stdlib only). What is cached there
    is run as this user, often root: a built binary copied into dist/, a root file
    system chrooted into."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid == os.geteuid():
        path.chmod(0o700)
    import importlib.util

    spec = importlib.util.spec_from_file_location("mvproxy_dev_frozen",
                                                  ROOT / "mvproxy" / "frozen.py")
    assert spec and spec.loader
    frozen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(frozen)
    found = frozen.problems(str(path))
    if found:
        raise SystemExit(f"dev.py: refusing the cache {path}, which another user could "
                         "change:\n" + "".join(f"  {line}\n" for line in found))
    return path


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """An exclusive lock on ``cache`` (its ``.lock`` file) while building into it."""
    with open(cache / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _interpreter_facts(python: Path) -> dict[str, str]:
    """What the binary inherits from the interpreter that freezes it."""
    code = ("import json, platform, sys, sysconfig; print(json.dumps({'version': sys.version,"
            " 'minor': '%d.%d' % sys.version_info[:2], 'shared': str(sysconfig.get_config_var("
            "'Py_ENABLE_SHARED')), 'base': sys.base_prefix, 'libc': ' '.join("
            "platform.libc_ver()), 'machine': platform.machine()}))")
    done = subprocess.run([str(python), "-c", code], check=True, capture_output=True,
                          text=True, timeout=60)
    facts: dict[str, str] = json.loads(done.stdout)
    return facts


def binary_sources() -> list[Path]:
    """Every file whose content goes into the binary (or decides how it is built)."""
    # This file too: it holds the recipe (PyInstaller's flags, the entry script).
    files = [ROOT / "pyproject.toml", ROOT / "setup.py", ROOT / "scripts" / "prune_runtime.py",
             ROOT / "scripts" / "dev.py"]
    # Not the extensions the editable install built beside the sources: the binary's
    # build compiles its own from these sources.
    files += sorted(p for p in (ROOT / "mvproxy").rglob("*")
                    if p.is_file() and "devcluster" not in p.parts
                    and "__pycache__" not in p.parts and p.suffix != ".so")
    return files


def binary_requirements() -> str:
    """The lock's [runtime] and [binary] sections: what the build venv holds."""
    lock = _script("lock")
    return "".join(lock.select(LOCK.read_text(), section) for section in ("runtime", "binary"))


def binary_digest(facts: dict[str, str]) -> str:
    """Of every input of the build: the recipe, the interpreter, the pins, the sources."""
    digest = hashlib.sha256()
    digest.update(binary_requirements().encode() + b"\0")
    for key in sorted(facts):
        digest.update(f"{key}={facts[key]}\0".encode())
    for path in binary_sources():
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


def _build_venv(python: Path, facts: dict[str, str], requirements: Path) -> Path:
    """A venv holding exactly the lock's [runtime] and [binary] sections (hash-checked),
    cached by their content and the interpreter; PyInstaller freezes this interpreter."""
    key = hashlib.sha256((facts["version"] + facts["base"]).encode()
                         + requirements.read_bytes()).hexdigest()[:16]
    where = BINARY_CACHE / f"venv-{key}"
    stamp = where / ".mvproxy-build-venv"
    if stamp.exists():
        return where
    shutil.rmtree(where, ignore_errors=True)
    print(f"dev.py: creating the binary's build venv {where}", flush=True)
    _run(python, "-m", "venv", "--clear", where)
    _run(where / "bin" / "python", "-m", "pip", "--disable-pip-version-check", "-q",
         "install", "--no-deps", "--require-hashes", "-r", requirements)
    stamp.write_text(requirements.read_text())
    return where


def build_binary(output: Path = ROOT / "dist" / "mvproxy", python: Path | None = None,
                 work: Path | None = None) -> Path:
    """Build the standalone executable: one file holding a CPython interpreter, the
    daemon and its locked dependencies (PyInstaller, onefile), for this machine's CPU
    architecture and any glibc at least as new as the one it is built on.

    The build venv holds the lock's [runtime] and [binary] sections (hash-checked) and
    nothing else; mvproxy comes from a wheel of this tree built there by the lock's
    setuptools (``--no-build-isolation``: nothing unpinned is downloaded), installed
    into a separate directory and pruned of the simulator, as in the image. The result
    is cached in BINARY_CACHE under the digest of every input (``binary_digest``), so
    an unchanged tree is copied, not rebuilt. ``python``: the interpreter to freeze
    (default: the one running this; CPython 3.11 built with a shared libpython).
    """
    python = python or Path(sys.executable)
    facts = _interpreter_facts(python)
    if facts["minor"] != "3.11":
        raise SystemExit(f"dev.py binary: the lock is for CPython 3.11; {python} is "
                         f"{facts['minor']}")
    if facts["shared"] != "1":
        raise SystemExit(f"dev.py binary: PyInstaller needs a CPython built with a shared "
                         f"libpython ({python} was not: build it with --enable-shared, for "
                         "pyenv PYTHON_CONFIGURE_OPTS=--enable-shared)")
    digest = binary_digest(facts)
    cached = private_cache(BINARY_CACHE) / digest / "mvproxy"
    with _locked(BINARY_CACHE):  # one build at a time (worktrees share the cache)
        if not cached.exists():
            _freeze(python, facts, cached, work or BINARY_CACHE / f"work-{digest}")
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    shutil.copyfile(cached, partial)
    partial.chmod(0o755)
    partial.replace(output)
    print(f"dev.py: {output} ({output.stat().st_size / 1e6:.1f} MB, {cached.parent.name}; "
          f"CPython {facts['minor']}, {facts['machine']}, built on {facts['libc']})",
          flush=True)
    return output


COMPILED_GROUP = "mvproxy._core__mypyc"


def _compiled_in(site: Path) -> bool:
    """Whether the wheel installed into ``site`` carries the compiled core."""
    return any((site / "mvproxy").glob("_core__mypyc.*.so"))


def _freeze(python: Path, facts: dict[str, str], cached: Path, work: Path) -> None:
    began = time.monotonic()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    requirements = work / "requirements-binary.txt"
    requirements.write_text(binary_requirements())
    venv_dir = _build_venv(python, facts, requirements)
    build_python = venv_dir / "bin" / "python"
    pip = [build_python, "-m", "pip", "--disable-pip-version-check", "-q"]
    site, wheels = work / "site-packages", work / "wheels"
    _run(*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", wheels, ROOT)
    (wheel,) = wheels.glob("mvproxy-*.whl")
    _run(*pip, "install", "--no-deps", "--target", site, wheel)
    _run(build_python, ROOT / "scripts" / "prune_runtime.py", site)
    entry = work / "mvproxy_main.py"
    entry.write_text(FROZEN_MAIN)
    # Nothing from this shell's Python settings (a PYTHONPATH would add its modules).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONHASHSEED="0", SOURCE_DATE_EPOCH="315532800")
    # --onefile: one file; --strip: symbols off libpython and the extensions (half the
    # size); no --runtime-tmpdir: the launcher unpacks under $TMPDIR with mkdtemp, and
    # mvproxy.frozen refuses a directory another user could change.
    # The compiled core's shared library is imported from C by each module's shim, which
    # PyInstaller's analysis cannot see: named here (setup.py's group_name).
    hidden = ["--hidden-import", COMPILED_GROUP] if _compiled_in(site) else []
    subprocess.run([str(build_python), "-m", "PyInstaller", "--onefile", "--strip",
                    "--noconfirm", "--clean", "--log-level", "WARN", "--name", "mvproxy",
                    *hidden,
                    "--paths", str(site), "--distpath", str(work / "dist"),
                    "--workpath", str(work / "pyinstaller"), "--specpath", str(work),
                    str(entry)], check=True, timeout=1800, env=env, cwd=work)
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_name(".mvproxy.partial")
    shutil.copyfile(work / "dist" / "mvproxy", partial)
    partial.chmod(0o755)
    partial.replace(cached)
    shutil.rmtree(work, ignore_errors=True)
    print(f"dev.py: froze {cached} in {time.monotonic() - began:.0f} s", flush=True)
    # Keep the newest few builds (another branch's tree may come back), not every one.
    builds = sorted((p for p in cached.parent.parent.iterdir()
                     if p.is_dir() and (p / "mvproxy").is_file()),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for old in builds[KEEP_BUILDS:]:
        shutil.rmtree(old, ignore_errors=True)


ROOTFS_CACHE = Path(os.environ.get("MVPROXY_ROOTFS_CACHE",
                                   Path.home() / ".cache" / "mvproxy" / "rootfs"))
ROOTFS_SUITE = "bookworm"
"""Debian 12, glibc 2.36: the oldest glibc the binary promises (README)."""
DEBIAN_MIRROR = os.environ.get("MVPROXY_DEBIAN_MIRROR", "http://deb.debian.org/debian")


def ensure_debootstrap() -> str | None:
    """debootstrap (Debian's), which makes the binary tests' Python-less root."""
    return ensure_debian_tool(("debootstrap",), "debootstrap",
                              "the binary's tests in a root file system without Python")


def python_in(tree: Path) -> list[str]:
    """Any Python interpreter or standard library in the tree ``tree``."""
    patterns = ("usr/bin/python*", "usr/local/bin/python*", "bin/python*",
                "usr/lib/python3*", "usr/local/lib/python3*")
    return sorted(str(p.relative_to(tree)) for pattern in patterns for p in tree.glob(pattern))


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path``, deepest first (from /proc/self/mountinfo)."""
    prefix = str(path.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(points, key=len, reverse=True)


def unmount_under(path: Path) -> None:
    for point in mounts_under(path):
        subprocess.run(["umount", "--lazy", point], check=False, timeout=60)


def build_rootfs() -> Path:
    """A Debian ``bookworm`` root file system from ``debootstrap --variant=minbase``:
    coreutils, bash, apt, glibc, and no Python. Made once into ROOTFS_CACHE (outside
    the clone; about 200 MB, a minute or two from the Debian mirror) and reused after.
    Needs root (debootstrap, and the tests' chroot); debootstrap is installed with
    apt-get when missing."""
    cache = private_cache(ROOTFS_CACHE)
    tree = cache / f"{ROOTFS_SUITE}-minbase"
    done = cache / f"{ROOTFS_SUITE}-minbase.done"
    if done.exists() and tree.is_dir():
        return tree
    with _locked(cache):
        if done.exists() and tree.is_dir():  # made by another process meanwhile
            return tree
        return _debootstrap(cache, tree, done)


def _debootstrap(cache: Path, tree: Path, done: Path) -> Path:
    if os.geteuid() != 0:
        raise SystemExit("dev.py rootfs: debootstrap and chroot need root")
    tool = ensure_debootstrap()
    if tool is None:
        raise SystemExit("dev.py rootfs: debootstrap is missing and cannot be installed")
    partial = cache / f".{ROOTFS_SUITE}-minbase.partial"
    unmount_under(partial)  # an interrupted debootstrap may leave /proc mounted there
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(tree, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    print(f"dev.py: debootstrap --variant=minbase {ROOTFS_SUITE} {tree} "
          f"(from {DEBIAN_MIRROR})", flush=True)
    began = time.monotonic()
    try:
        subprocess.run([tool, "--variant=minbase", ROOTFS_SUITE, str(partial), DEBIAN_MIRROR],
                       check=True, timeout=1800, stdout=subprocess.DEVNULL,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    finally:
        unmount_under(partial)
    found = python_in(partial)
    if found:
        raise SystemExit(f"dev.py rootfs: the minbase tree has Python: {found}")
    partial.rename(tree)
    done.write_text(f"{ROOTFS_SUITE} minbase from {DEBIAN_MIRROR}\n")
    print(f"dev.py: made {tree} in {time.monotonic() - began:.0f} s", flush=True)
    return tree


# What .ci/run checks before the tests, in this order; each tool reads its own
# configuration from pyproject.toml.
LINTERS = (
    ("ruff", "check", "mvproxy", "tests", "scripts", "bench", "setup.py"),
    ("mypy", "mvproxy"),
    ("lint-imports",),
)


def lint() -> int:
    """Run the linters from the venv, in the repository root; the first failure's
    exit status (later ones are not run), else 0."""
    for tool, *args in LINTERS:
        print(f"dev.py lint: {tool} {' '.join(args)}", flush=True)
        done = subprocess.run([str(_bin(tool)), *args], check=False, cwd=ROOT,
                              timeout=900)
        if done.returncode:
            print(f"dev.py lint: {tool} failed (exit status {done.returncode})", flush=True)
            return done.returncode
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test", "lint", "binary", "rootfs", "kubectl",
                                   "kube-binaries"):
        print("usage: python3 scripts/dev.py demo|test|lint|binary|rootfs|kubectl|"
              "kube-binaries [ARGS...]", file=sys.stderr)
        return 2
    if argv[0] == "kube-binaries":
        # Stdlib and Go only: no venv needed to build the real components.
        result: int = _script("kube_binaries").main(argv[1:])
        return result
    command, rest = argv[0], argv[1:]
    # The binary has a build venv of its own, and the root file system needs none.
    if command == "binary":
        build_binary(*(Path(arg).resolve() for arg in rest[:1]))
        return 0
    if command == "rootfs":
        print(build_rootfs())
        return 0
    ensure_env()
    if command == "lint":
        return lint()
    if command == "kubectl":
        # The suite's pinned kubectl (default 1.36), downloaded once into .tools/;
        # prints its path, which `mvproxy demo` then uses when kubectl is not on PATH.
        cmd = [str(_bin("python")), str(ROOT / "tests" / "kubectl.py"), *rest[:1]]
    elif command == "demo":
        # The demo runs where the user is (a relative --dir means what they expect).
        cmd = [str(_bin("mvproxy")), "demo", *rest]
    else:
        ensure_chromium()
        ensure_promtool()
        os.chdir(ROOT)
        cmd = [str(_bin("python")), "-m", "pytest", *rest]
    sys.stdout.flush()
    # Replace this process: Ctrl-C and SIGTERM then reach mvproxy (or pytest) directly,
    # which stops what it started; a wrapper in between could be killed first and
    # leave the demo's servers running.
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
