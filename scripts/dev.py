#!/usr/bin/env python3
"""The README's commands: ``dev.py demo``, ``test``, ``lint``, ``binary``, ``kubectl``.

Needs only Python 3.11+. Creates ``.venv`` next to the repository root (or
``$MVPROXY_VENV``), installs every distribution in ``requirements.lock`` into it
(hash-checked, nothing else: the lock holds the test and lint tools and the build
backend) and mvproxy itself editable, when the lock or ``pyproject.toml`` changed
since the last install, then runs the command there. Extra arguments go to
``mvproxy demo`` or to pytest. ``lint`` runs ruff, mypy and import-linter (what
``.ci/run`` checks before the tests), stopping at the first that fails. ``test`` also
installs Chromium (Debian's ``chromium``, with apt-get when running as root) for the
status page's browser test, and promtool (Debian's ``prometheus``) for the alert rules'
tests.
``binary`` builds the standalone executable ``dist/mvproxy`` (see ``build_binary``).
``kubectl [X.Y]`` downloads the test suite's pinned kubectl into ``.tools/`` and prints
its path (for a machine with no kubectl).
``kube-binaries [VERSIONS]`` builds real kube-apiserver, kube-controller-manager and
etcd from Go modules, and the tests' client-go informer, into ``$MVPROXY_KUBE_BINARIES``
(default ``~/.cache/mvproxy/kube``; see ``scripts/kube_binaries.py``); it needs Go, not
the venv.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("MVPROXY_VENV", ROOT / ".venv"))
STAMP = VENV / ".mvproxy-installed"


def _bin(name: str) -> Path:
    return VENV / "bin" / name


def _wanted_stamp() -> str:
    """Changes with the lock (a refreshed lock reinstalls) and with pyproject.toml
    (entry points, package data: the editable install)."""
    digest = hashlib.sha256()
    for name in (LOCK.name, "pyproject.toml"):
        digest.update(name.encode() + b"\0" + (ROOT / name).read_bytes() + b"\0")
    return digest.hexdigest()


# Never removed from the venv though the lock may not pin them: mvproxy (installed
# editable from this tree) and pip (the installer; today the lock pins it, for shiv).
UNLOCKED = {"mvproxy", "pip"}
LOCK = ROOT / "requirements.lock"

_INSTALLED = ("import importlib.metadata as m, re;"
              "print('\\n'.join(sorted({re.sub(r'[-_.]+', '-', d.metadata['Name']).lower()"
              " for d in m.distributions()})))")


def _remove_unlocked(pip: list[str]) -> None:
    """Uninstall what an older lock put in the venv and this one no longer pins, so
    the venv holds exactly the lock (plus mvproxy)."""
    lock = _script("lock")
    locked = set(lock.entries(LOCK.read_text()))
    installed = subprocess.run([str(_bin("python")), "-c", _INSTALLED], check=True,
                               capture_output=True, text=True, timeout=120).stdout.split()
    stale = sorted(set(installed) - locked - UNLOCKED)
    if stale:
        print(f"dev.py: removing what the lock no longer pins: {' '.join(stale)}", flush=True)
        subprocess.run(pip + ["uninstall", "-y", *stale], check=True, timeout=600)


def _script(name: str):
    """``scripts/<name>.py`` as a module (scripts/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"mvproxy_dev_{name}",
                                                  ROOT / "scripts" / f"{name}.py")
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
    subprocess.run(pip + ["install", "--no-deps", "--require-hashes", "-r", str(LOCK)],
                   check=True, timeout=1800)
    # The build backend comes from the lock too: nothing unpinned is downloaded.
    subprocess.run(pip + ["install", "--no-deps", "--no-build-isolation", "-e", str(ROOT)],
                   check=True, timeout=600)
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


def build_binary(output: Path = ROOT / "dist" / "mvproxy", python: Path | None = None,
                 work: Path = ROOT / "build" / "binary") -> Path:
    """Build the standalone executable: a shiv zipapp of the daemon and its locked
    dependencies, for this interpreter's CPython version and platform.

    Dependencies come from ``requirements.lock``'s runtime section (hash-checked, as
    in the container image), mvproxy from a wheel of this tree; the simulator is pruned (as in the
    image). The shebang names this minor version (``python3.11``): the binary wheels
    inside (uvloop, httptools, cryptography, ...) load on no other.
    """
    python = python or _bin("python")
    shutil.rmtree(work, ignore_errors=True)
    site, wheels = work / "site-packages", work / "wheels"
    pip = [python, "-m", "pip", "--disable-pip-version-check", "-q"]
    work.mkdir(parents=True)
    runtime = work / "runtime-requirements.txt"
    _run(sys.executable, ROOT / "scripts" / "lock.py", "select", "runtime", "-o", runtime)
    _run(*pip, "install", "--no-deps", "--require-hashes", "--target", site, "-r", runtime)
    # The venv holds the lock's build backend: nothing unpinned is downloaded to build.
    _run(*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", wheels, ROOT)
    (wheel,) = wheels.glob("mvproxy-*.whl")
    _run(*pip, "install", "--no-deps", "--upgrade", "--target", site, wheel)
    _run(python, ROOT / "scripts" / "prune_runtime.py", site)
    output.parent.mkdir(parents=True, exist_ok=True)
    interpreter = subprocess.run(
        [python, "-c", "import sys; print('python%d.%d' % sys.version_info[:2])"],
        check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    # --extend-pythonpath: `run --workers N` starts `python -m mvproxy worker`, which
    # must find the same packages.
    _run(python, "-m", "shiv", "--site-packages", site, "--console-script", "mvproxy",
         "--python", f"/usr/bin/env {interpreter}", "--extend-pythonpath",
         "--reproducible", "--compressed", "--output-file", output)
    print(f"dev.py: built {output} ({output.stat().st_size // 1024} KiB, "
          f"needs {interpreter} on {sys.platform}/{os.uname().machine})", flush=True)
    return output


# What .ci/run checks before the tests, in this order; each tool reads its own
# configuration from pyproject.toml.
LINTERS = (
    ("ruff", "check", "mvproxy", "tests", "scripts", "bench"),
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
    if not argv or argv[0] not in ("demo", "test", "lint", "binary", "kubectl",
                                   "kube-binaries"):
        print("usage: python3 scripts/dev.py demo|test|lint|binary|kubectl|kube-binaries"
              " [ARGS...]", file=sys.stderr)
        return 2
    if argv[0] == "kube-binaries":
        # Stdlib and Go only: no venv needed to build the real components.
        result: int = _script("kube_binaries").main(argv[1:])
        return result
    ensure_env()
    command, rest = argv[0], argv[1:]
    if command == "lint":
        return lint()
    if command == "binary":
        build_binary(*(Path(arg).resolve() for arg in rest[:1]))
        return 0
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
