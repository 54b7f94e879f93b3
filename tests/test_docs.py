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


def test_readme_links_into_docs():
    assert len(re.findall(r"\]\(docs/[^)#\s]+", (ROOT / "README.md").read_text())) > 10


def anchors(text: str) -> set[str]:
    """The fragment each heading gets, as GitHub makes it: lowercase, punctuation but
    ``-`` and ``_`` dropped, spaces to ``-``."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE):
        found.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return found


def test_links_between_pages_reach_a_page_and_heading_that_exist():
    broken = []
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target, fragment in re.findall(r"\]\(([^)#\s:]*)(?:#([^)\s]*))?\)",
                                           page.read_text()):
            path = (page.parent / target) if target else page
            if not path.exists():
                broken.append(f"{page.name}: {target}")
            elif fragment and path.suffix == ".md" and fragment not in anchors(
                    path.read_text()):
                broken.append(f"{page.name}: {target}#{fragment}")
    assert broken == []


def test_anchors_are_made_as_github_makes_them():
    assert anchors("## `mvproxy demo --real`\n## Beside upstream's built-in peer proxy\n") \
        == {"mvproxy-demo---real", "beside-upstreams-built-in-peer-proxy"}
