"""A test that leaves asyncio tasks running fails (``tests/conftest.py`` imports this).

Why: pytest-asyncio closes each test's event loop by cancelling whatever is still
pending, silently, so a daemon that forgets a task (a poller never stopped, a relay
never awaited) passes every test. ``no_leaked_tasks`` is autouse: for a test that runs
on pytest-asyncio's function-scoped loop (an async test, or a test using an async
fixture) it requests that loop's runner first, so its teardown runs after every other
function-scoped fixture's teardown and before the runner closes the loop. Tasks still
pending then are listed and the test errors at teardown.

A few passes of the loop are allowed first (``SETTLE_PASSES``, no waiting): a task that
was cancelled but not awaited finishes in them; one blocked on I/O or a timer does not.
Tests that make their own loop (``asyncio.run``) are not covered: that loop is theirs.

Loaded as a plugin on its own too (``pytest -p leaks``), which is how
``tests/test_leaks.py`` proves the fixture fails a leaking test.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest
import pytest_asyncio

RUNNER = "_function_scoped_runner"  # pytest-asyncio's fixture owning the loop
SETTLE_PASSES = 10


def _uses_the_function_loop(item: pytest.Item) -> bool:
    """An async test, or any test with an async fixture, runs on the runner's loop."""
    if pytest_asyncio.is_async_test(item):
        return True
    defs = getattr(item, "_fixtureinfo", None)
    if defs is None:
        return False
    return any(inspect.iscoroutinefunction(d[-1].func) or inspect.isasyncgenfunction(d[-1].func)
               for d in defs.name2fixturedefs.values() if d)


def _pending(loop: asyncio.AbstractEventLoop) -> list[asyncio.Task]:
    return sorted((t for t in asyncio.all_tasks(loop) if not t.done()), key=repr)


async def _settle(loop: asyncio.AbstractEventLoop) -> None:
    current = asyncio.current_task()
    for _ in range(SETTLE_PASSES):
        if not [t for t in _pending(loop) if t is not current]:
            return
        await asyncio.sleep(0)


def describe(tasks: list[asyncio.Task]) -> str:
    """One line per task: its name, its coroutine and where it is suspended."""
    return "\n".join(f"  {task!r}" for task in tasks)


@pytest.fixture(autouse=True)
def no_leaked_tasks(request: pytest.FixtureRequest):
    if not _uses_the_function_loop(request.node):
        yield
        return
    runner = request.getfixturevalue(RUNNER)
    yield
    loop = runner.get_loop()
    if loop.is_closed():
        return
    runner.run(_settle(loop))
    leaked = _pending(loop)
    if leaked:
        pytest.fail(f"{len(leaked)} asyncio task(s) still pending after the test and its "
                    f"fixtures finished:\n{describe(leaked)}", pytrace=False)
