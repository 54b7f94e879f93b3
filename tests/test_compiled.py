"""Which core modules run compiled (mypyc), under each mode, as a user would see it.

The development venv (``scripts/dev.py``) builds ``compiled.MODULES`` in place, so this
suite runs them compiled; ``MVPROXY_PURE=1`` (``.ci/run``'s pure-Python subset) makes
every process import their ``.py`` instead. ``mvproxy --version`` says which.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scripts_support import script

import mvproxy
from mvproxy import compiled

ROOT = Path(__file__).resolve().parent.parent
PROBE = ("import json, mvproxy.compiled as c, importlib;"
         "print(json.dumps({n: importlib.import_module('mvproxy.' + n).__file__"
         " for n in c.MODULES}))")


def _dev_venv() -> bool:
    """Installed by scripts/dev.py, which compiles the core (CI's venv always is)."""
    return Path(sys.prefix, ".mvproxy-installed").exists() or bool(os.environ.get("CI"))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != compiled.PURE_ENV}
    return {**env, **extra}


def _files(**extra: str) -> dict[str, str]:
    """Where a fresh interpreter imports each compiled-candidate module from."""
    done = subprocess.run([sys.executable, "-c", PROBE], env=_env(**extra), cwd=ROOT,
                          capture_output=True, text=True, check=True, timeout=60)
    files: dict[str, str] = json.loads(done.stdout)
    return files


def _version(**extra: str) -> str:
    done = subprocess.run([sys.executable, "-m", "mvproxy", "--version"], env=_env(**extra),
                          capture_output=True, text=True, check=True, timeout=60)
    return done.stdout.strip()


EXTENSIONS = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def test_this_test_process_runs_what_its_mode_asks():
    """The pure subset really is pure, and the main suite really is compiled."""
    if compiled.pure_requested():
        assert compiled.in_use() == ()
    elif _dev_venv():
        assert compiled.in_use() == compiled.MODULES
    else:
        pytest.skip(f"{sys.prefix} was not installed by scripts/dev.py")


def test_the_dev_venv_imports_the_compiled_modules_and_says_so():
    if not _dev_venv():
        pytest.skip(f"{sys.prefix} was not installed by scripts/dev.py")
    files = _files()
    assert all(path.endswith(EXTENSIONS) for path in files.values()), files
    assert _version() == (f"mvproxy {mvproxy.__version__} "
                          f"(compiled: {', '.join(compiled.MODULES)})")


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_mvproxy_pure_imports_every_module_from_its_source(value):
    files = _files(MVPROXY_PURE=value)
    assert all(path.endswith(".py") for path in files.values()), files
    assert set(files) == set(compiled.MODULES)
    assert _version(MVPROXY_PURE=value) == f"mvproxy {mvproxy.__version__} (pure Python)"


@pytest.mark.parametrize("value", ["", "0", "no"])
def test_other_values_do_not_ask_for_pure_python(value):
    assert not compiled.pure_requested({compiled.PURE_ENV: value})
    assert not compiled.pure_requested({})


def test_an_extension_built_from_other_sources_is_not_left_in_use():
    """dev.py rebuilds the extensions whenever a compiled module's source changed (its
    install stamp covers them); an extension older than its .py means it did not."""
    stale = [name for name in compiled.MODULES
             for ext in (ROOT / "mvproxy").glob(f"{name}.*")
             if ext.name.endswith(EXTENSIONS)
             and ext.stat().st_mtime < (ROOT / "mvproxy" / f"{name}.py").stat().st_mtime]
    assert not stale, f"stale extensions (run python3 scripts/dev.py lint): {stale}"


def test_setup_py_compiles_exactly_the_modules_compiled_py_names():
    setup = script("dev")._load(ROOT / "setup.py", "mvproxy_test_setup")
    assert setup.compiled_modules() == list(compiled.MODULES)


def test_ci_runs_a_named_pure_subset_of_files_that_exist():
    """.ci/run's pure-Python run: under MVPROXY_PURE=1, the files it lists all exist, and
    the pure modules' own table tests and this file are among them."""
    text = (ROOT / ".ci" / "run").read_text()
    subset = text.split("PURE_SUBSET=(", 1)[1].split(")", 1)[0].split()
    assert subset and all((ROOT / path).is_file() for path in subset), subset
    assert {"tests/test_routing.py", "tests/test_requestinfo.py", "tests/test_compiled.py",
            "tests/test_proxy_e2e.py"} <= set(subset)
    assert 'MVPROXY_PURE=1 python3 scripts/dev.py test' in text
    assert "docs/compiled.md" in (ROOT / "README.md").read_text()
