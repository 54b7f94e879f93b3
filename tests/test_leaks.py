"""The task-leak fixture (tests/leaks.py) fails what leaks and passes what cleans up.

A separate pytest run (``-p leaks``, the same plugin conftest.py imports) over a file of
small cases; each case's outcome and the failure text are read from its report.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CASES = '''
import asyncio
import pytest


async def test_leaks_a_task():
    asyncio.get_running_loop().create_task(asyncio.Event().wait(), name="forgotten")


@pytest.fixture
async def leaky():
    asyncio.get_running_loop().create_task(asyncio.sleep(3600), name="from-a-fixture")
    yield


async def test_an_async_fixture_leaks(leaky):
    pass


def test_a_sync_test_with_a_leaky_async_fixture(leaky):
    pass


@pytest.fixture
async def tidy():
    task = asyncio.get_running_loop().create_task(asyncio.sleep(3600), name="tidied")
    yield
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_fixture_that_stops_its_task(tidy):
    pass


async def test_awaits_its_task():
    await asyncio.get_running_loop().create_task(asyncio.sleep(0))


async def test_cancels_without_awaiting():
    asyncio.get_running_loop().create_task(asyncio.sleep(3600)).cancel()


def test_sync_with_its_own_loop():
    async def main():
        asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    asyncio.run(main())  # its loop, its cleanup
'''

LEAKING = {"test_leaks_a_task": "forgotten",
           "test_an_async_fixture_leaks": "from-a-fixture",
           "test_a_sync_test_with_a_leaky_async_fixture": "from-a-fixture"}
CLEAN = ["test_a_fixture_that_stops_its_task", "test_awaits_its_task",
         "test_cancels_without_awaiting", "test_sync_with_its_own_loop"]


def test_leaking_tests_error_with_their_tasks_listed_and_clean_ones_pass(tmp_path):
    (tmp_path / "test_cases.py").write_text(textwrap.dedent(CASES))
    (tmp_path / "pytest.ini").write_text(textwrap.dedent("""\
        [pytest]
        asyncio_mode = auto
        asyncio_default_fixture_loop_scope = function
        """))
    env = {**os.environ, "COLUMNS": "300", "PYTHONPATH": os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "leaks", "-p", "no:cacheprovider", "-rA",
         "-q", "test_cases.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert f"{len(CLEAN) + len(LEAKING)} passed, {len(LEAKING)} errors" in out, out
    for name, task in LEAKING.items():
        assert f"ERROR test_cases.py::{name} - Failed: 1 asyncio task(s) still pending" \
            in out, out
        section = out.split(f"at teardown of {name} ")[1].split("\n____")[0]
        assert f"name='{task}'" in section and "coro=<" in section, section
    for name in CLEAN:
        assert f"PASSED test_cases.py::{name}" in out, out
        assert f"at teardown of {name} " not in out, out
