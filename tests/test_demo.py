"""``mvproxy demo`` as a user runs it: a real subprocess, real kubectl, then Ctrl-C.

Everything is on loopback with free ports (``--base-port 0``). Whatever happens, the
demo and every process listed in its demo.json are killed at teardown.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from process_support import pid_alive

START_TIMEOUT = 30.0
STOP_TIMEOUT = 20.0
VERSIONS = ["1.35", "1.35", "1.36"]


def _mvproxy(*args: str) -> list[str]:
    return [sys.executable, "-m", "mvproxy", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _pids(state: dict) -> list[int]:
    return [s[part]["pid"] for s in state["servers"] for part in ("proxy", "backend")]


def _kill_all(state_file: Path) -> None:
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return
    for pid in _pids(state):
        try:
            os.killpg(pid, signal.SIGKILL)  # each runs in its own process group
        except (ProcessLookupError, PermissionError):
            pass


def _ready(admin_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{admin_url}/readyz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class Demo:
    def __init__(self, directory: Path, log: Path, proc: subprocess.Popen[bytes]) -> None:
        self.directory = directory
        self.log = log
        self.proc = proc
        self.state_file = directory / "demo.json"

    def output(self) -> str:
        return self.log.read_text("utf-8", errors="replace")

    def wait_started(self) -> dict:
        """demo.json written, every mvproxy ready, the guide printed; returns demo.json."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert self.proc.poll() is None, \
                f"demo exited {self.proc.returncode} during startup:\n{self.output()}"
            if self.state_file.exists() and "Press Ctrl-C" in self.output():
                state = json.loads(self.state_file.read_text())
                if all(_ready(s["proxy"]["admin_url"]) for s in state["servers"]):
                    return state
            assert time.monotonic() < deadline, \
                f"demo not ready after {START_TIMEOUT:g}s:\n{self.output()}"
            time.sleep(0.2)


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Demo]:
    directory = tmp_path / "demo"
    log = tmp_path / "demo.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen(_mvproxy("demo", "--dir", str(directory), "--base-port", "0"),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=_env(), start_new_session=True)
    d = Demo(directory, log, proc)
    try:
        yield d
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        _kill_all(d.state_file)


def test_demo_runs_serves_kubectl_and_stops_on_ctrl_c(demo: Demo, kubectl) -> None:
    state = demo.wait_started()

    # demo.json: where everything is.
    root = demo.directory.absolute()
    assert state["kubeconfig"] == str(root / "kubeconfig")
    assert state["ca"] == str(root / "pki" / "ca.crt")
    assert [s["id"] for s in state["servers"]] == ["apiserver-0", "apiserver-1", "apiserver-2"]
    assert [s["version"] for s in state["servers"]] == VERSIONS
    ports = set()
    for s in state["servers"]:
        assert s["proxy"]["url"].startswith("https://127.0.0.1:")
        assert s["proxy"]["admin_url"].startswith("http://127.0.0.1:")
        assert s["backend"]["url"].startswith("https://127.0.0.1:")
        assert Path(s["backend"]["audit_log"]) == root / s["id"] / "audit.log"
        ports |= {s["proxy"]["url"], s["proxy"]["admin_url"], s["backend"]["url"]}
        config = root / s["id"] / "mvproxy.yaml"
        assert "kind: MvproxyConfiguration" in config.read_text()
    assert len(ports) == 9
    assert set(state["users"]) == {"admin-token", "viewer-token"}
    assert all(len(u["token"]) >= 16 for u in state["users"].values())
    pids = _pids(state)
    assert len(set(pids)) == 6 and all(pid_alive(p) for p in pids)
    for secret in (root / "kubeconfig", root / "demo.json", root / "tokens.csv"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret

    # A second demo in the same directory is refused while this one runs.
    again = subprocess.run(_mvproxy("demo", "--dir", str(demo.directory), "--base-port", "0"),
                           capture_output=True, text=True, timeout=30, env=_env())
    assert again.returncode == 2, again
    assert "still running" in again.stderr

    # Real kubectl through the proxies.
    kc = state["kubeconfig"]
    names = kubectl("get", "ns", "-o", "name", kubeconfig=kc, context="apiserver-0").stdout
    assert "namespace/default" in names.split()
    viewer = kubectl("get", "ns", "--user", "viewer-token", kubeconfig=kc,
                     context="apiserver-1")
    assert "default" in viewer.stdout
    denied = kubectl("create", "namespace", "nope", "--user", "viewer-token", kubeconfig=kc,
                     context="apiserver-1", check=False)
    assert denied.returncode != 0 and "Forbidden" in denied.stderr, denied
    # The mixed-version proxy at work: the 1.35 server's mvproxy lists 1.36-only PodGroups.
    resources = kubectl("api-resources", "--api-group", "scheduling.k8s.io", "-o", "name",
                        kubeconfig=kc, context="apiserver-0").stdout.split()
    assert "podgroups.scheduling.k8s.io" in resources

    # Ctrl-C: everything stops, exit 0.
    demo.proc.send_signal(signal.SIGINT)
    try:
        code = demo.proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"demo still running {STOP_TIMEOUT:g}s after SIGINT:\n{demo.output()}")
    assert code == 0, demo.output()
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if pid_alive(p)] == []
    assert "stopped." in demo.output()


def test_unknown_version_is_refused_with_the_available_ones(tmp_path: Path) -> None:
    from mvproxy.devcluster.catalog import available_versions

    done = subprocess.run(
        _mvproxy("demo", "--dir", str(tmp_path / "d"), "--versions", "1.35,1.99",
                 "--base-port", "0"),
        capture_output=True, text=True, timeout=30, env=_env())
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mvproxy: error: --versions:"), done.stderr
    assert "'1.99'" in lines[0]
    assert ", ".join(available_versions()) in lines[0]
    assert not (tmp_path / "d").exists()  # nothing was written or started


def test_a_taken_port_is_refused(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            _mvproxy("demo", "--dir", str(tmp_path / "d"), "--versions", "1.36",
                     "--base-port", str(port)),
            capture_output=True, text=True, timeout=30, env=_env())
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{port}" in lines[0] and "in use" in lines[0], done.stderr
