#!/usr/bin/env python3
"""The one lock file, ``requirements.lock``: refresh it, or select a part of it.

``requirements.lock`` pins, with the sha256 of every published file, everything a
development environment installs: the daemon's runtime dependencies, the ``test`` and
``lint`` extras and the build backend (so ``pip install --no-build-isolation -e .``
downloads nothing unpinned); and the tools that freeze the standalone binary. It is
one valid requirements file in three sections, each opened by a marker comment:

* ``# [runtime]``: ``pyproject.toml``'s ``dependencies`` and everything they need. The
  container image and the standalone binary install only this section
  (``lock.py select runtime``), so no test or lint tool reaches them.
* ``# [dev]``: the rest of the development environment, for ``scripts/dev.py`` and
  ``.ci/run`` (which install ``runtime`` and ``dev``, never ``binary``).
* ``# [binary]``: ``[tool.mvproxy] binary-requires`` in ``pyproject.toml`` (PyInstaller,
  and mypy for mypyc, which compiles the core the binary carries) and what they need
  beyond the runtime section. ``dev.py binary`` installs ``runtime``
  and ``binary`` into a build environment of its own, outside the development venv.
  A distribution both here and in ``dev`` (setuptools, packaging) has the same pin in
  both: this resolution is constrained to the other two.

``lock.py select build`` gives the pins of ``build-system.requires`` and what they
need (setuptools; mypy, whose mypyc compiles the core, and its dependencies, read from
the lock's ``# via`` notes): the image builds mvproxy's wheel with them and
``--no-build-isolation``.

``python3 scripts/lock.py refresh [--upgrade]`` regenerates it with pip-tools, in three
resolutions: the runtime dependencies alone; then the extras and the build backend
constrained to those runtime pins, so a runtime package has the same version in both
sections; then the binary's tools constrained to all of those. Existing
pins are kept where they still satisfy ``pyproject.toml`` (pip-compile's behaviour);
``--upgrade`` takes the newest releases instead. It needs CPython 3.11 (the version
the lock is for) and PyPI; pip's local configuration (mirrors, find-links) is ignored
so every published file's hash is recorded. Stdlib only: the image's build stage runs
``select`` with a bare interpreter.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
PIP_TOOLS = "pip-tools==7.6.2"
INDEX = "https://pypi.org/simple"
SECTIONS = ("runtime", "dev", "binary")
REFRESH = "python3 scripts/lock.py refresh"
HEADER = f"""\
# requirements.lock: the one lock file (see scripts/lock.py). Every distribution a
# development environment installs, pinned for CPython 3.11 with the sha256 of every
# published file. Generated, do not edit; after changing dependencies, extras or
# build-system.requires in pyproject.toml, refresh it (CPython 3.11, PyPI) with:
#
#    {REFRESH}            # keep pins that still satisfy pyproject.toml
#    {REFRESH} --upgrade  # newest releases
#
# Consumers: scripts/dev.py and .ci/run install [runtime] and [dev] (--require-hashes);
# the Dockerfile only [runtime], `dev.py binary` [runtime] and [binary] (PyInstaller),
# and both build the wheel with the build backend's pins (scripts/lock.py select
# runtime|dev|binary|build).
"""
SECTION_NOTES = {
    "runtime": "pyproject.toml's dependencies and all they need (image, binary)",
    "dev": "the test and lint extras, the build backend (dev.py, .ci/run)",
    "binary": "the standalone binary's tools beyond [runtime] (dev.py binary's build venv)",
}
_PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def canonical(name: str) -> str:
    """PEP 503 normalized name (what pip compares)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def entries(text: str) -> dict[str, str]:
    """A pip-compile output (or a section of the lock) as canonical name -> its
    entry: the pin line and its indented hash and annotation lines, verbatim."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line[:1].isspace() and current is not None:
            current.append(line)
            continue
        current = None
        if not line.strip() or line.startswith("#"):
            continue
        match = _PIN.match(line)
        if not match:
            raise ValueError(f"not an exact pin: {line!r}")
        current = found[canonical(match[1])] = [line]
    return {name: "\n".join(lines) for name, lines in found.items()}


def pin(entry: str) -> str:
    """An entry's requirement alone (``name==version`` and its marker, no hashes)."""
    return entry.splitlines()[0].rstrip(" \\")


def version(entry: str) -> str:
    match = _PIN.match(entry)
    assert match, entry
    return match[2]


def sections(text: str) -> dict[str, dict[str, str]]:
    """The lock's sections, each as ``entries``; fails when a marker is missing."""
    parts = re.split(r"^# \[(\w+)\].*$", text, flags=re.MULTILINE)
    found = {name: entries(body) for name, body in zip(parts[1::2], parts[2::2], strict=True)}
    if tuple(found) != SECTIONS or entries(parts[0]):
        raise ValueError(f"requirements.lock must hold exactly the sections {SECTIONS} "
                         f"in that order, found {tuple(found)}; run `{REFRESH}`")
    return found


def assemble(runtime: str, everything: str, binary: str = "") -> str:
    """The lock's text from the three pip-compile outputs: the runtime resolution, the
    full one (which must agree on every runtime pin) and the binary's tools (which
    must agree with both)."""
    run, full, tools = entries(runtime), entries(everything), entries(binary)
    for name, entry in run.items():
        if name not in full or version(full[name]) != version(entry):
            raise ValueError(f"{name}: runtime pin {version(entry)} differs from the full "
                             f"resolution's {version(full[name]) if name in full else None}")
    for name, entry in tools.items():
        known = run.get(name) or full.get(name)
        if known is not None and version(known) != version(entry):
            raise ValueError(f"{name}: the binary's pin {version(entry)} differs from "
                             f"{version(known)} elsewhere in the lock")
    dev = {name: entry for name, entry in full.items() if name not in run}
    built = {name: entry for name, entry in tools.items() if name not in run}
    out = [HEADER]
    for section, chosen in (("runtime", run), ("dev", dev), ("binary", built)):
        out.append(f"# [{section}] {SECTION_NOTES[section]}\n")
        out.extend(chosen[name] + "\n" for name in sorted(chosen))
    return "".join(out)


BUILD = "build"
"""Not a section: the lock's pins of ``build-system.requires`` (the build backend), for
building mvproxy's wheel with ``--no-build-isolation`` (image, binary)."""


def build_requires(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The canonical names ``build-system.requires`` lists."""
    requires = tomllib.loads(pyproject.read_text())["build-system"]["requires"]
    return [canonical(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) for r in requires]


def binary_requires(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """``[tool.mvproxy] binary-requires``: what ``dev.py binary`` freezes with."""
    return list(tomllib.loads(pyproject.read_text())["tool"]["mvproxy"]["binary-requires"])


def required_by(entry: str) -> set[str]:
    """The canonical names an entry's ``# via`` annotation lists: what needs it."""
    names: set[str] = set()
    via = False
    for line in entry.splitlines()[1:]:
        text = line.strip()
        if text.startswith("# via"):
            via = True
            text = text.removeprefix("# via").strip()
        elif not (via and text.startswith("#")):
            continue
        word = text.lstrip("#").strip().split(" ")[0]
        if word and not word.startswith("-"):
            names.add(canonical(word))
    return names


def _closure(wanted: list[str], pinned: dict[str, str]) -> list[str]:
    """``wanted`` and, transitively, every pinned distribution one of them requires
    (read from the ``# via`` annotations pip-compile writes), in sorted order."""
    chosen = set(wanted)
    while True:
        more = {name for name, entry in pinned.items()
                if name not in chosen and required_by(entry) & chosen}
        if not more:
            return sorted(chosen)
        chosen |= more


def select(text: str, section: str, pyproject: Path = ROOT / "pyproject.toml") -> str:
    """One section of the lock (or the build backend's pins) as a requirements file."""
    if section == BUILD:
        pinned = {name: entry for part in sections(text).values()
                  for name, entry in part.items()}
        missing = [name for name in build_requires(pyproject) if name not in pinned]
        if missing:
            raise ValueError(f"build-system.requires not in requirements.lock: {missing}; "
                             f"run `{REFRESH}`")
        chosen = {name: pinned[name] for name in _closure(build_requires(pyproject), pinned)}
    else:
        chosen = sections(text)[section]
    return (f"# The [{section}] pins of requirements.lock (scripts/lock.py select)\n"
            + "".join(chosen[name] + "\n" for name in sorted(chosen)))


def _pip_compile(scratch: Path) -> list[str]:
    """A command running pip-compile: this interpreter's, else that of a venv made
    in ``scratch`` (removed with it)."""
    if importlib.util.find_spec("piptools"):
        return [sys.executable, "-m", "piptools", "compile"]
    where = scratch / "piptools-venv"
    venv.EnvBuilder(with_pip=True).create(where)
    subprocess.run([str(where / "bin" / "python"), "-m", "pip", "install", "-q",
                    "--index-url", INDEX, PIP_TOOLS], check=True, env=_isolated_env(),
                   timeout=600)
    return [str(where / "bin" / "python"), "-m", "piptools", "compile"]


def _isolated_env() -> dict[str, str]:
    """pip without this machine's configuration: PyPI only, all hashes recorded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull}


def refresh(upgrade: bool = False) -> None:
    if sys.version_info[:2] != (3, 11):
        sys.exit(f"lock.py refresh: run it with CPython 3.11 (the lock's version), "
                 f"this is {sys.version.split()[0]}")
    backend = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    with tempfile.TemporaryDirectory(prefix="mvproxy-lock-") as tmp_name:
        tmp = Path(tmp_name)
        compile_ = _pip_compile(tmp) + [
            "--quiet", "--no-header", "--generate-hashes", "--allow-unsafe",
            "--strip-extras", "--no-emit-index-url", "--no-emit-find-links",
            "--index-url", INDEX, *(["--upgrade"] if upgrade else [])]
        runtime, everything = tmp / "runtime.txt", tmp / "everything.txt"
        tools = tmp / "binary.txt"
        for seed in (runtime, everything, tools):  # pip-compile keeps the pins it finds there
            if LOCK.exists():
                shutil.copyfile(LOCK, seed)
        subprocess.run(compile_ + ["--output-file", str(runtime), "pyproject.toml"],
                       cwd=ROOT, check=True, env=_isolated_env(), timeout=1800)
        pins = tmp / "runtime-pins.txt"
        pins.write_text("".join(pin(e) + "\n" for e in entries(runtime.read_text()).values()))
        build = tmp / "build-system.in"
        build.write_text(f"-c {pins}\n" + "".join(f"{r}\n" for r in backend))
        subprocess.run(compile_ + ["--extra", "test", "--extra", "lint", "--output-file",
                                   str(everything), "pyproject.toml", str(build)],
                       cwd=ROOT, check=True, env=_isolated_env(), timeout=1800)
        full_pins = tmp / "full-pins.txt"
        full_pins.write_text("".join(pin(e) + "\n"
                                     for e in entries(everything.read_text()).values()))
        tools_in = tmp / "binary.in"
        tools_in.write_text(f"-c {full_pins}\n"
                            + "".join(f"{r}\n" for r in binary_requires()))
        subprocess.run(compile_ + ["--output-file", str(tools), "pyproject.toml",
                                   str(tools_in)],
                       cwd=ROOT, check=True, env=_isolated_env(), timeout=1800)
        text = assemble(runtime.read_text(), everything.read_text(), tools.read_text())
    LOCK.write_text(text.replace(f"{tmp_name}/", ""))
    print(f"lock.py: wrote {LOCK}", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lock.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fresh = sub.add_parser("refresh", help="regenerate requirements.lock (needs PyPI)")
    fresh.add_argument("--upgrade", action="store_true", help="newest releases")
    pick = sub.add_parser("select", help="print one section as a requirements file")
    pick.add_argument("section", choices=(*SECTIONS, BUILD))
    pick.add_argument("--lock", type=Path, default=LOCK)
    pick.add_argument("--output", "-o", type=Path, help="write here instead of stdout")
    args = parser.parse_args(argv)
    if args.command == "refresh":
        refresh(args.upgrade)
        return 0
    text = select(args.lock.read_text(), args.section)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
