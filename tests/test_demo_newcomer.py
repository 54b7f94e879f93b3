"""A newcomer with no kubectl and no activated venv can follow ``mvproxy demo`` (issue 13)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mvproxy.devcluster import demo

REPO = Path(__file__).resolve().parents[1]


def _exe(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_pinned_kubectl_is_used_when_none_is_on_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    _exe(tmp_path / "kubectl-v1.35.2")
    newest = _exe(tmp_path / "kubectl-v1.36.3")
    (tmp_path / "kubectl-v1.37.1").write_text("not executable")  # skipped
    command, note = demo._kubectl_hint(tmp_path)
    assert command == str(newest)
    assert note and str(newest) in note


def test_without_any_kubectl_the_guide_says_how_to_fetch_one(tmp_path: Path,
                                                            monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    command, note = demo._kubectl_hint(tmp_path / "no-tools")
    assert command == "kubectl"
    assert note and "python3 scripts/dev.py kubectl" in note


def test_kubectl_on_path_wins(tmp_path: Path, monkeypatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _exe(bin_dir / "kubectl")
    _exe(tmp_path / "kubectl-v1.36.3")
    monkeypatch.setenv("PATH", str(bin_dir))
    assert demo._kubectl_hint(tmp_path) == ("kubectl", None)


def test_mvproxy_command_points_at_the_venv_script(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    beside = Path(sys.executable).parent / "mvproxy"
    expected = str(beside) if beside.is_file() else "mvproxy"
    assert demo._mvproxy_command() == expected


def test_demo_help_describes_every_option_with_its_default() -> None:
    out = subprocess.run([sys.executable, "-m", "mvproxy", "demo", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    body = out.split("options:", 1)[1]
    options = re.findall(r"^  (--[a-z-]+)", body, flags=re.MULTILINE)
    assert set(options) == {"--dir", "--versions", "--base-port", "--membership", "--real",
                            "--kube-binaries"}
    # Every option's help (up to the next option) states its default.
    chunks = re.split(r"^  --", body, flags=re.MULTILINE)[1:]
    assert len(chunks) == 6
    for chunk in chunks:
        assert "(default:" in " ".join(chunk.split()), chunk


@pytest.mark.parametrize("argv", [["nope"], []])
def test_dev_py_rejects_unknown_commands_and_lists_kubectl(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "dev.py"), *argv],
                          capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "MVPROXY_VENV": "/nonexistent-venv"})
    assert done.returncode == 2
    assert "kubectl" in done.stderr
