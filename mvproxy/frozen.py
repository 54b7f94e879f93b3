"""The standalone binary's entry point: ``dev.py binary`` freezes ``main`` with PyInstaller.

The binary is one file holding an interpreter, mvproxy and its compiled modules. Before
any Python runs, PyInstaller's launcher unpacks the interpreter and those modules into
a new directory ``$TMPDIR/_MEI<pid><6 random characters>`` (``/tmp`` when ``TMPDIR`` is
unset), made with ``mkdtemp``: created afresh, never one that already exists, mode 0700,
owned by the user running the binary. It removes that directory when the process
exits; worker processes (``run --workers N``) reuse their parent's.

Whoever can replace a file in that directory, or rename the directory within its parent
and put their own in its place, chooses the code the daemon runs, often as root. So
``main`` first checks the directory it runs from and every directory above it:

- the unpacked directory itself: owned by the effective user, mode 0700;
- every directory above it: owned by root or by the effective user, and not writable
  by group or others unless it is sticky (``/tmp``: in a sticky directory no one but
  an entry's owner may rename or remove it).

Both the path as given and the path with symbolic links resolved are checked. If any
fails, the binary exits with status 2 before mvproxy starts, naming the directory and
what is wrong: a ``TMPDIR`` that points at a directory another user made or can write
to is a configuration error, refused like a bad flag. The check runs on what the
launcher already wrote, so it cannot stop an attacker who raced the launcher; what it
does is refuse to keep running, for months, in a place where such a race is possible.

Not frozen (``python -m mvproxy``, the console script), ``main`` is ``cli.main``.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

EXIT_USAGE = 2


def unpacked_directory() -> str | None:
    """Where the running binary unpacked itself; None when not a frozen binary."""
    if not getattr(sys, "frozen", False):
        return None
    home = getattr(sys, "_MEIPASS", None)
    return str(home) if home else None


def problems(directory: str, euid: int | None = None) -> list[str]:
    """Why ``directory`` (the unpacked directory) could be changed by another user;
    empty when it cannot."""
    euid = os.geteuid() if euid is None else euid
    found: list[str] = []
    given = Path(os.path.abspath(directory))
    real = Path(os.path.realpath(directory))
    try:
        own = os.lstat(real)
    except OSError as exc:
        return [f"{real}: cannot be examined ({exc.strerror})"]
    if own.st_uid != euid:
        found.append(f"{real} is owned by uid {own.st_uid}, not by this user (uid {euid})")
    if stat.S_IMODE(own.st_mode) & 0o077:
        found.append(f"{real} has mode {stat.S_IMODE(own.st_mode):04o}, not 0700")
    seen: set[Path] = set()
    for parent in [*given.parents, *real.parents]:
        if parent in seen:
            continue
        seen.add(parent)
        try:
            info = os.stat(parent)
        except OSError as exc:
            found.append(f"{parent}: cannot be examined ({exc.strerror})")
            continue
        if info.st_uid not in (0, euid):
            found.append(f"{parent} is owned by uid {info.st_uid} (neither root nor this "
                         f"user, uid {euid})")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o022 and not mode & stat.S_ISVTX:
            found.append(f"{parent} has mode {mode:04o}: writable by group or others, "
                         "and not sticky")
    return found


def main() -> int:
    directory = unpacked_directory()
    if directory is not None:
        found = problems(directory)
        if found:
            print(f"mvproxy: error: this binary unpacked itself into {directory}, where "
                  "another user could change the code it runs:\n"
                  + "".join(f"  {line}\n" for line in found)
                  + "Set TMPDIR to a directory that only this user (or root) can write "
                    "to, such as /run/mvproxy with mode 0700 (docs/image-and-binary.md).",
                  file=sys.stderr)
            return EXIT_USAGE
    from mvproxy.cli import main as cli_main

    return cli_main()
