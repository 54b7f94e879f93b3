"""The one lock file: its runtime section is exactly what the daemon needs, and the
development venv holds exactly what it pins.

The closure is computed from the installed distributions' own metadata (their
``Requires-Dist``, markers evaluated here), not from the lock generator's notes, so a
runtime section that lost or gained a package fails here whatever wrote it.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from scripts_support import script

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
lock = script("lock")


def _applies(requirement: Requirement, extras: tuple[str, ...] = ()) -> bool:
    """Whether a requirement holds on this interpreter and platform, for these extras."""
    marker = requirement.marker
    return marker is None or any(marker.evaluate({"extra": e}) for e in ("", *extras))


def _runtime_closure() -> set[str]:
    """pyproject.toml's dependencies and, transitively, what each installed one
    requires (with the extras asked for), as canonical names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(text) for text in project["dependencies"]]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        key = (name, frozenset(requirement.extras))
        if not _applies(requirement) or key in seen:
            continue
        seen.add(key)
        extras = tuple(sorted(requirement.extras))
        todo.extend(r for r in map(Requirement, importlib.metadata.requires(name) or [])
                    if _applies(r, extras))
    return {name for name, _ in seen}


def _section(name: str) -> dict[str, str]:
    """A section of the lock as canonical name -> pinned version, for the entries
    whose marker holds here."""
    return {key: lock.version(entry) for key, entry in lock.sections(LOCK.read_text())[name]
            .items() if _applies(Requirement(lock.pin(entry)))}


def test_runtime_section_is_the_closure_of_the_runtime_dependencies():
    runtime = set(_section("runtime"))
    closure = _runtime_closure()
    assert runtime == closure, (f"only in the lock's runtime section: {runtime - closure}; "
                                f"needed but not in it: {closure - runtime}")
    # What the image and the binary would otherwise carry.
    assert not runtime & {"pytest", "mypy", "ruff", "coverage", "hypothesis", "pyinstaller"}


def test_the_sections_do_not_overlap():
    """runtime is in neither other section; what dev and binary share (setuptools,
    packaging) has one pin."""
    sections = lock.sections(LOCK.read_text())
    assert not set(sections["runtime"]) & set(sections["dev"])
    assert not set(sections["runtime"]) & set(sections["binary"])
    for name in set(sections["dev"]) & set(sections["binary"]):
        assert lock.version(sections["dev"][name]) == lock.version(sections["binary"][name])


def test_the_binary_section_pins_the_binarys_tools_and_no_test_tool():
    """PyInstaller, and mypy for mypyc (the binary carries the compiled core)."""
    binary = lock.sections(LOCK.read_text())["binary"]
    wanted = {canonicalize_name(Requirement(r).name) for r in lock.binary_requires()}
    assert wanted == {"pyinstaller", "mypy"} and wanted <= set(binary)
    assert not set(binary) & {"pytest", "ruff", "coverage", "hypothesis"}
    assert all("--hash=sha256:" in entry for entry in binary.values())


def test_the_dev_venv_holds_exactly_the_lock():
    """Every locked distribution is installed at the lock's version: scripts/dev.py
    installed this venv from the lock. In CI (a fresh venv) nothing else may be there;
    on a developer's machine tools installed on demand (bench/run.py's matplotlib,
    py-spy) are tolerated until the next install removes them."""
    if not Path(sys.prefix, ".mvproxy-installed").exists():
        why = f"{sys.prefix} was not installed by scripts/dev.py"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run the tests through it")
        pytest.skip(why)
    locked = {**_section("runtime"), **_section("dev")}
    installed = {canonicalize_name(d.metadata["Name"]): d.version
                 for d in importlib.metadata.distributions()}
    assert installed.pop("mvproxy") == __import__("mvproxy").__version__
    if "pip" not in locked:  # the installer, from ensurepip, when nothing needs pip
        installed.pop("pip", None)
    wrong = {name: (installed.get(name), want) for name, want in locked.items()
             if installed.get(name) != want}
    assert not wrong, f"(installed, locked) versions differ (None: not installed): {wrong}"
    unlocked = sorted(set(installed) - set(locked))
    assert not (unlocked and os.environ.get("CI")), f"installed but not locked: {unlocked}"


def test_select_prints_one_section_as_a_hash_checked_requirements_file(tmp_path):
    out = tmp_path / "runtime.txt"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "lock.py"), "select", "runtime",
                    "--output", str(out)], check=True, timeout=60)
    text = out.read_text()
    assert lock.entries(text) == lock.sections(LOCK.read_text())["runtime"]
    assert all("--hash=sha256:" in entry for entry in lock.entries(text).values())


FULL = """\
aiohttp==3.14.5 \\
    --hash=sha256:aa
    # via mvproxy (pyproject.toml)
pytest==9.2.0 \\
    --hash=sha256:bb
    # via mvproxy (pyproject.toml)
setuptools==84.2.1 \\
    --hash=sha256:cc
"""


TOOLS = """\
aiohttp==3.14.5 \\
    --hash=sha256:aa
pyinstaller==6.22.3 \\
    --hash=sha256:dd
setuptools==84.2.1 \\
    --hash=sha256:cc
"""


def test_assemble_splits_the_resolutions_into_sections():
    text = lock.assemble("aiohttp==3.14.5 \\\n    --hash=sha256:aa\n", FULL, TOOLS)
    sections = lock.sections(text)
    assert list(sections["runtime"]) == ["aiohttp"]
    assert list(sections["dev"]) == ["pytest", "setuptools"]
    assert list(sections["binary"]) == ["pyinstaller", "setuptools"]
    assert sections["dev"]["pytest"].splitlines()[1].strip() == "--hash=sha256:bb"
    assert lock.REFRESH in text.split("# [runtime]")[0]  # the header says how to refresh
    assert lock.select(text, "dev").count("--hash=") == 2


def test_assemble_refuses_a_runtime_pin_the_full_resolution_changed():
    with pytest.raises(ValueError, match="aiohttp: runtime pin 3.14.4 differs"):
        lock.assemble("aiohttp==3.14.4 \\\n    --hash=sha256:aa\n", FULL)


def test_assemble_refuses_a_binary_pin_that_differs_from_the_others():
    with pytest.raises(ValueError, match="setuptools: the binary's pin 80.0 differs"):
        lock.assemble("aiohttp==3.14.5 \\\n    --hash=sha256:aa\n", FULL,
                      TOOLS.replace("setuptools==84.2.1", "setuptools==80.0"))


def test_select_build_gives_the_build_backends_pins_or_names_the_missing(tmp_path):
    """``select build``: the lock's pins of ``build-system.requires``, whichever section
    holds them; a backend the lock lacks is named, not silently left out."""
    text = lock.assemble("aiohttp==3.14.5 \\\n    --hash=sha256:aa\n", FULL)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[build-system]\nrequires = ["setuptools>=77"]\n')
    assert list(lock.entries(lock.select(text, "build", pyproject))) == ["setuptools"]
    pyproject.write_text('[build-system]\nrequires = ["setuptools>=77", "Flit_Core[x]<4"]\n')
    with pytest.raises(ValueError, match="flit-core"):
        lock.select(text, "build", pyproject)
    real = lock.entries(lock.select(LOCK.read_text(), "build"))
    assert set(lock.build_requires()) == {"setuptools", "mypy"}
    # mypy's own dependencies come along (its typing-extensions is a runtime pin, which
    # every build venv installs too); nothing of the test or lint tools beyond it.
    assert {"setuptools", "mypy", "mypy-extensions", "pathspec"} <= set(real)
    assert not set(real) & {"pytest", "ruff", "coverage", "pyinstaller"}


def test_select_build_follows_what_the_backend_requires():
    text = lock.assemble("aiohttp==3.14.5 \\\n    --hash=sha256:aa\n", FULL + """\
mypy==2.4.1 \\
    --hash=sha256:ee
    # via -r build-system.in
pathspec==1.1.1 \\
    --hash=sha256:ff
    # via
    #   black
    #   mypy
""")
    assert lock.required_by(lock.entries(text)["pathspec"]) == {"black", "mypy"}
    assert lock._closure(["mypy"], lock.entries(text)) == ["mypy", "pathspec"]


@pytest.mark.parametrize("text", [FULL, "# [dev] x\n" + FULL + "# [runtime] y\n",
                                  "# [runtime] x\n" + FULL,
                                  "# [runtime] x\n# [dev] y\n" + FULL])
def test_a_lock_without_its_three_sections_is_refused(text):
    with pytest.raises(ValueError, match="sections"):
        lock.sections(text)


def test_the_dev_stamp_changes_with_the_lock(tmp_path, monkeypatch):
    """A refreshed lock makes dev.py reinstall."""
    dev = script("dev")
    (tmp_path / "mvproxy").mkdir()
    for path in (dev.LOCK, ROOT / "pyproject.toml", *dev.compiled_sources()):
        (tmp_path / path.relative_to(ROOT)).write_bytes(path.read_bytes())
    monkeypatch.setattr(dev, "ROOT", tmp_path)
    monkeypatch.setattr(dev, "LOCK", tmp_path / "requirements.lock")
    before = dev._wanted_stamp()
    with open(tmp_path / "requirements.lock", "a") as f:
        f.write("wheel==0.48.0 \\\n    --hash=sha256:00\n")
    assert dev._wanted_stamp() != before


def test_the_dev_stamp_changes_with_a_compiled_modules_source(tmp_path, monkeypatch):
    """The editable install compiled it in place: a changed .py rebuilds its extension,
    so the tests never import a stale one."""
    dev = script("dev")
    (tmp_path / "mvproxy").mkdir()
    for path in (dev.LOCK, ROOT / "pyproject.toml", *dev.compiled_sources()):
        (tmp_path / path.relative_to(ROOT)).write_bytes(path.read_bytes())
    monkeypatch.setattr(dev, "ROOT", tmp_path)
    monkeypatch.setattr(dev, "LOCK", tmp_path / "requirements.lock")
    before = dev._wanted_stamp()
    with open(tmp_path / "mvproxy" / "routing.py", "a") as f:
        f.write("# edited\n")
    assert dev._wanted_stamp() != before
