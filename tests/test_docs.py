"""The documentation pages name what the code has: docs/configuration.md lists every
key of the configuration schema and every flag of ``run`` and ``check-config``, and
no page under docs/ names a metric, key, flag or admin path that does not exist.

Names come from the code (``config_support``, the CLI's parser, the metrics registry,
the admin routes), through the same checker as the upgrade runbook's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from config_support import dotted_keys_of
from test_runbook import code_spans, mvproxy_flags, problems

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
# Written by their own tools (tests/reliability.py, tests/realk8s_replay.py,
# scripts/upstream_comparison.py); they quote what they measured.
GENERATED = {"reliability.md", "simulator-vs-real.md", "upstream-comparison.md"}
PAGES = sorted(p for p in DOCS.glob("*.md") if p.name not in GENERATED)


def documented(text: str) -> set[str]:
    """Every name a code span of ``text`` starts with (``--peer ID=URL`` -> ``--peer``)."""
    names = set()
    for span in code_spans(text):
        names.update(part for part in re.split(r"[\s=/]+", span) if part)
    return names


def test_every_configuration_key_is_documented():
    names = documented(CONFIGURATION.read_text())
    missing = sorted(dotted_keys_of() - names)
    assert not missing, f"docs/configuration.md does not document {missing}"


def test_every_flag_of_run_and_check_config_is_documented():
    names = documented(CONFIGURATION.read_text())
    missing = sorted(mvproxy_flags() - {"--help"} - names)
    assert not missing, f"docs/configuration.md does not document {missing}"


def test_a_missing_key_or_flag_would_be_found():
    names = documented("`peers.dns.name` and `--peer ID=URL`, `-v`/`--v`")
    assert {"peers.dns.name", "--peer", "-v", "--v"} <= names
    assert "peers.dns.port" not in names


def test_configuration_page_names_only_what_exists():
    """Metrics, keys, flags, admin paths and whole ``mvproxy run``/``check-config``
    command lines, as the runbook is checked; a synopsis (``[flags]``) is not a command."""
    found = [p for p in problems(CONFIGURATION.read_text())
             if not (p.startswith("mvproxy command does not parse") and "[" in p)]
    assert found == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_name_only_configuration_keys_that_exist(page: Path):
    """Other pages also quote kube-apiserver's, kubeadm's and build tools' flags and
    upstream's metrics, so only configuration keys are checked there."""
    assert [p for p in problems(page.read_text()) if p.startswith("config key")] == []


def test_readme_links_to_pages_that_exist():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)", text)
    assert links
    assert [link for link in links if not (ROOT / link).is_file()] == []


def test_pages_link_to_pages_that_exist():
    broken = []
    for page in DOCS.glob("*.md"):
        for link in re.findall(r"\]\(([^)#\s:]+)(?:#[^)\s]*)?\)", page.read_text()):
            if not (page.parent / link).exists():
                broken.append(f"{page.name}: {link}")
    assert broken == []
