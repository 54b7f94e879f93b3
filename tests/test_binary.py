"""The standalone binary (``dev.py binary``) on a host with only a Python interpreter.

Built once per test session (a shiv zipapp of the locked dependencies), then run with
``env -i``: no virtual environment, no pip, no user site, only the system's
``python3.X`` on PATH; against a fake backend over real mTLS on loopback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from process_support import (
    admin_get,
    daemon_config,
    get,
    stop_process,
    wait_ready,
)
from scripts_support import script

import mvproxy
from mvproxy import tls
from mvproxy.devcluster.launcher import free_port

ROOT = Path(__file__).resolve().parent.parent
INTERPRETER = "python{}.{}".format(*sys.version_info[:2])
SYSTEM_PATH = "/usr/bin:/bin"

pytestmark = pytest.mark.slow


def _dev():
    return script("dev")


@pytest.fixture(scope="session")
def binary(tmp_path_factory) -> Path:
    """``dev.py binary``'s build, once per session, with this interpreter (whose CPython
    version and platform the bundled wheels match)."""
    out = tmp_path_factory.mktemp("binary")
    return _dev().build_binary(out / "mvproxy", python=Path(sys.executable), work=out / "work")


@pytest.fixture(scope="session")
def clean_env(tmp_path_factory) -> dict[str, str]:
    """What a bare host has: the system's interpreter on PATH and nothing else.

    The shebang asks for ``python3.X`` (the build's version); the system's is used when
    /usr/bin has that version, else a directory holding only a link to this venv's
    base interpreter (a plain CPython, not the venv)."""
    path = SYSTEM_PATH
    if not any(Path(d, INTERPRETER).exists() for d in SYSTEM_PATH.split(":")):
        only = tmp_path_factory.mktemp("interpreter")
        (only / INTERPRETER).symlink_to(Path(sys._base_executable).resolve())
        path = f"{only}:{SYSTEM_PATH}"
    return {"PATH": path, "PYTHONNOUSERSITE": "1",
            # shiv unpacks its binary wheels here on first run (default ~/.shiv).
            "SHIV_ROOT": str(tmp_path_factory.mktemp("shiv-root"))}


def _run(binary: Path, env: dict[str, str], cwd: Path, *args: str, extra_env=None):
    return subprocess.run([str(binary), *args], env={**env, **(extra_env or {})}, cwd=cwd,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_binary_is_one_executable_without_the_simulator(binary):
    assert os.access(binary, os.X_OK)
    with open(binary, "rb") as f:
        assert f.readline() == f"#!/usr/bin/env {INTERPRETER}\n".encode()
    names = zipfile.ZipFile(binary).namelist()
    assert any(n.endswith("site-packages/mvproxy/cli.py") for n in names)
    assert any("site-packages/uvloop/" in n for n in names)
    assert not [n for n in names if "devcluster" in n]


def test_binary_version_in_a_clean_environment(binary, clean_env, tmp_path):
    done = _run(binary, clean_env, tmp_path, "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"mvproxy {mvproxy.__version__}"


def test_binary_imports_only_what_it_bundles(binary, clean_env, tmp_path):
    """Debian's python3 has its own yaml and cryptography: the bundled ones must win."""
    probe = tmp_path / "probe.py"
    probe.write_text("import sys, mvproxy, yaml, cryptography, aiohttp, uvloop, httptools\n"
                     "for m in (mvproxy, yaml, cryptography, aiohttp, uvloop, httptools):\n"
                     "    print(m.__file__)\n")
    done = _run(binary, clean_env, tmp_path, str(probe), extra_env={"SHIV_INTERPRETER": "1"})
    assert done.returncode == 0, done.stderr
    files = done.stdout.split()
    assert len(files) == 6
    assert all(f.startswith(clean_env["SHIV_ROOT"]) for f in files), files


def test_binary_says_the_simulator_is_not_in_it(binary, clean_env, tmp_path):
    done = _run(binary, clean_env, tmp_path, "sim", "--help")
    assert done.returncode == 0  # argparse's help needs no simulator
    done = _run(binary, clean_env, tmp_path, "demo")
    assert done.returncode == 1
    assert "contains only the daemon" in done.stderr
    assert "Traceback" not in done.stderr


async def _serve_through(binary, env, root, tmp_path, backend, *args):
    port, admin = free_port(), free_port()
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(daemon_config(root, backend, port, admin)))
    log_path = tmp_path / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(binary), "run", "--config", str(config), *args],
                                env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        try:
            await wait_ready(admin)
            ctx = tls.client_context(root / "ca.crt", root / "admin.crt", root / "admin.key")
            assert await get(port, ctx) == 200
            metrics = await admin_get(admin, "/metrics")
        except BaseException as exc:
            stop_process(proc)
            raise AssertionError(log_path.read_text(errors="replace")) from exc
        stop_process(proc)
    assert proc.returncode == 0, log_path.read_text(errors="replace")
    return metrics


async def test_binary_runs_the_daemon_in_a_clean_environment(binary, clean_env, root,
                                                             backend, tmp_path):
    status, _ = await _serve_through(binary, clean_env, root, tmp_path, backend)
    assert status == 200


async def test_binary_runs_worker_processes(binary, clean_env, root, backend,
                                            tmp_path):
    """Workers are ``python -m mvproxy worker``: they must find the bundled packages."""
    status, text = await _serve_through(binary, clean_env, root, tmp_path, backend,
                                        "--workers", "2")
    assert status == 200
    assert "mvproxy_workers 2.0" in text
