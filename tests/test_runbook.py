"""docs/upgrade-runbook.md names only metrics, labels, config keys, flags and admin
paths that exist, so the runbook cannot drift from the code without a failing test.

Names are taken from the code, not from another document: metrics from a ``Metrics``
registry rendered as Prometheus text, config keys from the ``Config`` dataclasses,
flags from the CLI's own parser, admin paths from the admin listener's routes.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from config_support import dotted_keys_of
from prometheus_client import Counter, Gauge, Histogram, generate_latest

from mvproxy.admin import admin_app
from mvproxy.cli import build_parser
from mvproxy.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
RUNBOOK = ROOT / "docs" / "upgrade-runbook.md"

# kube-apiserver's (and kubeadm's) own flags the runbook names; they are not mvproxy's,
# so they cannot be checked against its parser. Each is in `kube-apiserver --help`.
KUBE_APISERVER_FLAGS = {"--bind-address", "--peer-ca-file", "--shutdown-delay-duration",
                        "--feature-gates", "--patches"}

METRIC = re.compile(r"\b((?:apiserver|aggregator|mvproxy)_[a-z0-9_]*)(?:\(([a-z0-9_|]+)\))?"
                    r"(\{[^}]*\})?")
ADMIN_URL = re.compile(r"http://127\.0\.0\.1:9443(/[^\s'\"?]*)?")
ADMIN_PREFIXES = ("/debug/", "/metrics", "/readyz", "/livez", "/healthz")


# --- what the code has ------------------------------------------------------------------

def exported_metrics() -> dict[str, set[str]]:
    """Every exported series and histogram name (``_total``, ``_bucket``...) -> label names."""
    metrics = Metrics()
    metrics.watch_peers(lambda: [("peer-a", True, 1.0)])
    metrics.watch_certificates(lambda: [("serving", 0, 1.0)])
    metrics.watch_connections(lambda: 0)
    for value in vars(metrics).values():
        if isinstance(value, (Counter, Gauge, Histogram)) and value._labelnames:
            value.labels(**{name: "x" for name in value._labelnames})
    found: dict[str, set[str]] = {}
    histograms = set()
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("# TYPE ") and line.endswith(" histogram"):
            histograms.add(line.split()[2])
        if line.startswith("#"):
            continue
        match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s", line)
        assert match, line
        labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', match.group(2) or ""))
        found.setdefault(match.group(1), set()).update(labels - {"le"})
    for family in histograms:  # a histogram is named by its family too
        found[family] = found[family + "_count"]
    return found


def mvproxy_flags() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    flags = set()
    for name in ("run", "check-config"):
        for action in sub.choices[name]._actions:
            flags.update(o for o in action.option_strings if o.startswith("--"))
    return flags


def admin_routes() -> set[str]:
    """The paths the admin listener serves (one table for both process models)."""
    async def handler(request):  # pragma: no cover - never called
        raise AssertionError

    app = admin_app(page=handler, peers=handler, route=handler, metrics=handler,
                    livez=handler, readyz=handler, debug=handler, allowed_hosts=())
    routes = {r.resource.canonical for r in app.router.routes()}
    assert {"/", "/metrics", "/readyz"} <= routes
    return routes


# --- what the runbook says --------------------------------------------------------------

def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def code_lines(text: str) -> list[str]:
    """Lines of indented code blocks, with backslash continuations joined."""
    lines, joined = [], ""
    for line in text.splitlines():
        if line.startswith("    ") and line.strip():
            joined += line.strip()
            if joined.endswith("\\"):
                joined = joined[:-1] + " "
                continue
            lines.append(joined)
        joined = ""
    return lines


def problems(text: str) -> list[str]:
    """Every name in ``text`` that the code does not have, as a readable message."""
    found: list[str] = []
    metrics = exported_metrics()
    for match in METRIC.finditer(text):
        stem, alternatives, selector = match.groups()
        names = [stem + alt for alt in alternatives.split("|")] if alternatives else [stem]
        for name in names:
            if name not in metrics:
                found.append(f"metric {name!r} is not exported")
                continue
            if selector:
                labels = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=|,|\}|$)", selector[1:]))
                if labels - metrics[name]:
                    missing = sorted(labels - metrics[name])
                    found.append(f"metric {name!r} has no label(s) {missing}")

    keys = dotted_keys_of()
    tops = {k.split(".")[0] for k in keys}
    flags = mvproxy_flags()
    routes = admin_routes()
    for span in code_spans(text):
        if re.fullmatch(r"[a-z][A-Za-z]*(\.[a-z][A-Za-z]*)+", span) and span.split(".")[0] in tops:
            if span not in keys:
                found.append(f"config key {span!r} does not exist")
        if span.startswith("--"):
            flag = span.split("=")[0].split()[0]
            if flag not in flags and flag not in KUBE_APISERVER_FLAGS:
                found.append(f"flag {flag!r} is neither mvproxy's nor a listed kube-apiserver flag")
        if span == "/" or span.startswith(ADMIN_PREFIXES):
            path = span.split("?")[0]
            if path not in routes:
                found.append(f"admin path {path!r} is not served")

    for line in code_lines(text) + code_spans(text):
        for match in ADMIN_URL.finditer(line):
            path = match.group(1) or "/"
            if path not in routes:
                found.append(f"admin path {path!r} (in {line!r}) is not served")
        words = shlex.split(line, posix=True) if line.count("'") % 2 == 0 else line.split()
        for i, word in enumerate(words):
            if word.endswith("mvproxy") and words[i + 1:i + 2] in (["run"], ["check-config"]):
                args = words[i + 1:]
                if "..." in args:
                    continue
                # argparse accepts any unambiguous prefix: names must be exact.
                found += [f"flag {a.split('=')[0]!r} of an mvproxy command does not exist"
                          for a in args if a.startswith("--") and a.split("=")[0] not in flags]
                try:
                    build_parser().parse_args(args)
                except SystemExit:
                    found.append(f"mvproxy command does not parse: {' '.join(args)!r}")
    return found


# --- tests ------------------------------------------------------------------------------

def test_runbook_names_only_what_exists():
    text = RUNBOOK.read_text()
    assert problems(text) == []


def test_runbook_covers_the_signals_an_upgrade_is_watched_by():
    text = RUNBOOK.read_text()
    for name in ("apiserver_rerouted_request_total", "apiserver_peer_proxy_errors_total",
                 "apiserver_peer_discovery_sync_errors_total", "mvproxy_peer_up",
                 "mvproxy_peer_discovery_age_seconds", "/debug/mvproxy/route",
                 "x-kubernetes-peer-proxied", "peerProxied", "profile=nopeer",
                 "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"):
        assert name in text, name
    for heading in ("Pre-checks", "What to watch", "Verify", "Rollback", "Remove mvproxy"):
        assert re.search(rf"^## \d+\. {heading}", text, re.M), heading


def test_jq_fields_of_the_peers_view_exist():
    """The runbook's jq projection of /debug/mvproxy/peers uses fields the JSON has."""
    source = "".join(p.read_text() for p in (ROOT / "mvproxy").glob("*.py"))
    text = RUNBOOK.read_text()
    projections = re.findall(r"/debug/mvproxy/peers \| jq '\.servers\[\] \| \{([^}]*)\}'", text)
    assert projections
    for field in (f.strip() for p in projections for f in p.split(",")):
        assert f'"{field}"' in source, field


@pytest.mark.parametrize("bad, phrase", [
    ("watch `mvproxy_peer_upp`", "metric 'mvproxy_peer_upp' is not exported"),
    ("`apiserver_rerouted_request_total{code,path}`", "no label(s) ['path']"),
    ("grep -E '^mvproxy_peer_(up|down)'", "metric 'mvproxy_peer_down'"),
    ("set `discovery.pollIntervall`", "config key 'discovery.pollIntervall'"),
    ("pass `--peer-ca-fil`", "flag '--peer-ca-fil'"),
    ("see `/debug/mvproxy/routes`", "admin path '/debug/mvproxy/routes'"),
    ("\n    curl -s http://127.0.0.1:9443/statusz\n", "admin path '/statusz'"),
    ("\n    mvproxy check-config c.yaml --peer-ca-fil x\n", "flag '--peer-ca-fil' of an mvproxy"),
    ("\n    mvproxy check-config c.yaml --workers\n", "does not parse"),
])
def test_the_checker_catches_drift(bad, phrase):
    """Each kind of drift is reported (so a passing runbook check means something)."""
    assert any(phrase in p for p in problems(bad)), problems(bad)


def test_every_alert_the_runbook_names_exists():
    """Alert names in the runbook are the rules file's (config/prometheus)."""
    import re
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parent.parent
    rules = yaml.safe_load((root / "config/prometheus/mvproxy-rules.yaml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    named = set(re.findall(r"`(Mvproxy[A-Za-z]+)`",
                           (root / "docs/upgrade-runbook.md").read_text()))
    assert named and named <= alerts, named - alerts
