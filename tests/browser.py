"""Headless Chromium for tests: ``--dump-dom`` and ``--screenshot``, nothing else.

Found on PATH, else installed the way ``scripts/dev.py test`` installs it (Debian's
``chromium`` with apt-get, as root). A test is skipped only when that is impossible,
and fails instead when ``MVPROXY_REQUIRE_CHROMIUM`` is set (CI, ``.ci/run``). Every run
is a subprocess with its own profile directory, bounded by a timeout and killed
(its whole process group) when the timeout passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest
from scripts_support import debian_tool

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT = 60.0
"""Seconds one Chromium run may take (a cold start on a loaded machine takes a few)."""


def chromium() -> str:
    return debian_tool("chromium", "ensure_chromium", "MVPROXY_REQUIRE_CHROMIUM")


async def run(binary: str, profile: Path, *args: str) -> str:
    """Chromium's stdout for ``args``; fails the test on a timeout or a non-zero exit."""
    process = await asyncio.create_subprocess_exec(
        binary, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
        "--disable-extensions", "--disable-background-networking",
        f"--user-data-dir={profile}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(process.communicate(), RUN_TIMEOUT)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        pytest.fail(f"chromium {' '.join(args)} took longer than {RUN_TIMEOUT} s")
    finally:
        # Chromium's helpers (zygote, GPU, renderer) share its process group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    if process.returncode != 0:
        pytest.fail(f"chromium exited {process.returncode}: {err.decode(errors='replace')[-2000:]}")
    return out.decode("utf-8", "replace")
