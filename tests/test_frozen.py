"""``mvproxy.frozen``'s check of the directory a standalone binary unpacked itself into,
and how mvproxy starts itself again (workers), in process: no binary needed
(``tests/test_binary.py`` runs the real one)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mvproxy import frozen, workers


def unpacked(parent: Path, mode: int = 0o700) -> Path:
    """What the launcher makes: a new 0700 directory of this user inside ``parent``."""
    directory = parent / "_MEI0000abcdXYZ123"
    directory.mkdir(mode=mode)
    directory.chmod(mode)
    return directory


def private(path: Path, mode: int = 0o700) -> Path:
    path.mkdir()
    path.chmod(mode)
    return path


def test_a_private_chain_has_no_problem(tmp_path):
    tmp_path.chmod(0o700)
    assert frozen.problems(str(unpacked(private(tmp_path / "run")))) == []


def test_a_sticky_world_writable_parent_is_accepted(tmp_path):
    """Like /tmp: others may add entries but not rename or remove ours."""
    tmp_path.chmod(0o700)
    assert frozen.problems(str(unpacked(private(tmp_path / "tmp", 0o1777)))) == []


def test_a_writable_parent_without_the_sticky_bit_is_named(tmp_path):
    tmp_path.chmod(0o700)
    found = frozen.problems(str(unpacked(private(tmp_path / "shared", 0o777))))
    assert found == [f"{tmp_path / 'shared'} has mode 0777: writable by group or others, "
                     "and not sticky"]


def test_a_writable_grandparent_is_named_too(tmp_path):
    """Whoever can rename ``shared/mine`` can put their own tree in its place."""
    tmp_path.chmod(0o700)
    mine = private(private(tmp_path / "shared", 0o775) / "mine")
    found = frozen.problems(str(unpacked(mine)))
    assert len(found) == 1 and found[0].startswith(f"{tmp_path / 'shared'} has mode 0775")


def test_an_unpacked_directory_open_to_others_or_someone_elses_is_named(tmp_path):
    tmp_path.chmod(0o700)
    directory = unpacked(tmp_path, 0o755)
    assert frozen.problems(str(directory)) == [f"{directory} has mode 0755, not 0700"]
    directory.chmod(0o700)
    found = frozen.problems(str(directory), euid=os.geteuid() + 1)
    assert found[0] == (f"{directory} is owned by uid {os.geteuid()}, not by this user "
                        f"(uid {os.geteuid() + 1})")


def test_a_parent_owned_by_another_user_is_named(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    tmp_path.chmod(0o700)
    theirs = private(tmp_path / "theirs", 0o755)
    directory = unpacked(theirs)
    os.chown(theirs, 65534, 65534)
    assert frozen.problems(str(directory)) == [
        f"{theirs} is owned by uid 65534 (neither root nor this user, uid 0)"]


def test_a_symlink_is_checked_on_both_sides(tmp_path):
    tmp_path.chmod(0o700)
    shared = private(tmp_path / "shared", 0o777)
    directory = unpacked(shared)
    (tmp_path / "link").symlink_to(shared)
    found = frozen.problems(str(tmp_path / "link" / directory.name))
    assert any("shared has mode 0777" in line for line in found)


def test_a_missing_directory_is_a_problem(tmp_path):
    assert frozen.problems(str(tmp_path / "gone"))[0].endswith("cannot be examined "
                                                               "(No such file or directory)")


def test_main_outside_a_binary_is_the_cli(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["mvproxy", "--version"])
    assert frozen.unpacked_directory() is None
    with pytest.raises(SystemExit) as exit_:
        frozen.main()
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("mvproxy ")


def test_main_in_a_binary_that_unpacked_into_a_shared_place_exits_2(monkeypatch, tmp_path,
                                                                    capsys):
    tmp_path.chmod(0o700)
    directory = unpacked(private(tmp_path / "shared", 0o777))
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "_MEIPASS", str(directory), raising=False)
    assert frozen.main() == 2
    err = capsys.readouterr().err
    assert "another user could change the code it runs" in err and "Set TMPDIR" in err


def test_workers_start_the_binary_itself_when_frozen(monkeypatch):
    assert workers.self_command() == [sys.executable, "-m", "mvproxy"]
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    assert workers.self_command() == [sys.executable]
