"""The monitoring files in config/: alert rules, scrape configs, dashboard.

Rules are checked and unit-tested by promtool (Debian's ``prometheus``, installed
like Chromium by ``scripts/dev.py``; skipped only when it cannot be installed, and a
failure instead when ``MVPROXY_REQUIRE_PROMTOOL`` is set, as in CI). Every metric the
rules and the dashboard name must be one a running mvproxy exports (or one of the
few named in EXTERNAL), so renaming a metric breaks this test, not a user's alerts.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from daemon_support import PODGROUPS, cluster, ready
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from scripts_support import debian_tool, script
from sidecar_support import NODE_NAME, SIDECAR, config_argv, dev_config, resolve

from mvproxy.cli import build_parser, config_overrides
from mvproxy.configfile import load_config
from mvproxy.devpki import init_pki
from mvproxy.workers import Supervisor

ROOT = Path(__file__).resolve().parent.parent
PROM = ROOT / "config" / "prometheus"
RULES = PROM / "mvproxy-rules.yaml"
CRD = PROM / "mvproxy-prometheusrule.yaml"
DASHBOARD = ROOT / "config" / "grafana" / "mvproxy-dashboard.json"
PROMTOOL_TIMEOUT = 120

EXTERNAL = {
    "up": "Prometheus' own per-target series",
    "kube_pod_container_status_ready": "kube-state-metrics (MvproxyNotReady)",
}
"""Metrics the rules may use that mvproxy does not export, and where they come from."""


@pytest.fixture(scope="module")
def promtool() -> str:
    return debian_tool("promtool", "ensure_promtool", "MVPROXY_REQUIRE_PROMTOOL")


def run_promtool(promtool: str, *args: str, cwd: Path = PROM) -> str:
    done = subprocess.run([promtool, *args], check=False, cwd=cwd, capture_output=True, text=True,
                          timeout=PROMTOOL_TIMEOUT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


# ------------------------------------------------------------------ rules


def test_rules_pass_promtool_check(promtool: str) -> None:
    out = run_promtool(promtool, "check", "rules", RULES.name)
    assert "SUCCESS" in out


def test_rule_unit_tests_pass(promtool: str) -> None:
    out = run_promtool(promtool, "test", "rules", "mvproxy-rules.test.yaml")
    assert "SUCCESS" in out


def test_rule_unit_tests_can_fail(promtool: str, tmp_path: Path) -> None:
    """The unit tests notice a changed threshold: they assert, not just run."""
    (tmp_path / RULES.name).write_text(
        RULES.read_text().replace("> 0.05", "> 0.5").replace("> 300", "> 3000"))
    (tmp_path / "t.yaml").write_text((PROM / "mvproxy-rules.test.yaml").read_text())
    done = subprocess.run([promtool, "test", "rules", "t.yaml"], check=False, cwd=tmp_path,
                          capture_output=True, text=True, timeout=PROMTOOL_TIMEOUT)
    assert done.returncode != 0
    assert "MvproxyRerouteErrors" in done.stdout + done.stderr
    assert "MvproxyPeerDiscoveryStale" in done.stdout + done.stderr


def test_prometheusrule_is_generated_from_the_rules_file(promtool: str, tmp_path: Path) -> None:
    module = script("gen_prometheusrule")
    assert CRD.read_text() == module.render(), (
        "config/prometheus/mvproxy-prometheusrule.yaml is stale: run "
        "python3 scripts/gen_prometheusrule.py")
    crd = yaml.safe_load(CRD.read_text())
    assert crd["apiVersion"] == "monitoring.coreos.com/v1" and crd["kind"] == "PrometheusRule"
    assert crd["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    # What the operator hands Prometheus checks as well.
    (tmp_path / "from-crd.yaml").write_text(yaml.safe_dump({"groups": crd["spec"]["groups"]}))
    run_promtool(promtool, "check", "rules", "from-crd.yaml", cwd=tmp_path)


def test_rules_cover_what_an_operator_needs() -> None:
    rules = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"]
             for r in g["rules"]}
    wanted = {
        "MvproxyDown": "up", "MvproxyPeerDown": "mvproxy_peer_up",
        "MvproxyRerouteErrors": "apiserver_rerouted_request_total",
        "MvproxyPeerDiscoverySyncErrors": "apiserver_peer_discovery_sync_errors_total",
        "MvproxyPeerDiscoveryStale": "mvproxy_peer_discovery_age_seconds",
        "MvproxyCertificateExpiring": "mvproxy_certificate_expiry_timestamp_seconds",
        "MvproxyCertificateReloadErrors": "mvproxy_certificate_reload_errors_total",
        "MvproxyNotReady": "kube_pod_container_status_ready",
    }
    for alert, metric in wanted.items():
        assert metric in metric_names(rules[alert]["expr"]), alert
    for alert, rule in rules.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), alert
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], alert
    page = (ROOT / "docs" / "operations.md").read_text()
    section = page.split("\n## Monitoring\n", 1)[1].split("\n## ", 1)[0]
    missing = [alert for alert in rules if f"`{alert}`" not in section]
    assert not missing, f"docs/operations.md's Monitoring section does not explain {missing}"


# --------------------------------------------------------------- scraping


def test_scrape_configs_pass_promtool_check(promtool: str, tmp_path: Path) -> None:
    """Debian's promtool is built without Kubernetes service discovery, so the
    kubernetes_sd job is checked with a static target in its place (the relabelling,
    which is what could be wrong, is still checked)."""
    config = yaml.safe_load((PROM / "scrape-config.yaml").read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "mvproxy"
    (sd,) = job.pop("kubernetes_sd_configs")
    assert sd["role"] == "pod" and sd["namespaces"]["names"] == ["kube-system"]
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert keep and keep[0]["regex"] == "mvproxy;metrics"
    job["static_configs"] = [{"targets": ["192.0.2.1:9444"]}]
    (tmp_path / "pod-role.yaml").write_text(yaml.safe_dump(config))
    run_promtool(promtool, "check", "config", "pod-role.yaml", cwd=tmp_path)

    local = (PROM / "scrape-config-node-local.yaml").read_text()
    assert "${NODE_NAME}" in local
    (tmp_path / "local.yaml").write_text(local.replace("${NODE_NAME}", "cp-a"))
    run_promtool(promtool, "check", "config", "local.yaml", cwd=tmp_path)
    (job,) = yaml.safe_load(local)["scrape_configs"]
    assert job["job_name"] == "mvproxy"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:9443"]


def test_servicemonitor_finds_the_service_and_its_port() -> None:
    service, monitor = yaml.safe_load_all((PROM / "mvproxy-servicemonitor.yaml").read_text())
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "ServiceMonitor"
    # job="mvproxy" in the alerts is the Service's name.
    assert service["metadata"]["name"] == "mvproxy"
    labels = service["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    assert service["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert ports[endpoint["port"]]["port"] == 9444 and endpoint["path"] == "/metrics"
    assert ports[endpoint["port"]]["targetPort"] == 9444  # the metrics listener, not admin
    # kubeadm's labels on the kube-apiserver static pod, which mvproxy shares.
    assert service["spec"]["selector"] == {"component": "kube-apiserver", "tier": "control-plane"}


RECIPE = re.compile(r"^#\s+(args|ports):\s+- (.+)$", re.MULTILINE)
"""The lines the ServiceMonitor's comment says to add to the mvproxy container."""


def test_the_servicemonitor_recipe_keeps_the_admin_listener_on_loopback(tmp_path) -> None:
    """Issue 19: the recipe bound the admin listener, debug endpoints and status page
    included, to the node IP. Its two lines, added to config/kube-apiserver-sidecar.yaml,
    now give a pod that validates, /metrics alone on <node IP>:9444 (the Service's
    targetPort and the scrape job's port), and the admin listener on 127.0.0.1:9443."""
    recipe = dict(RECIPE.findall((PROM / "mvproxy-servicemonitor.yaml").read_text()))
    assert set(recipe) == {"args", "ports"}, recipe
    assert recipe["args"] in (PROM / "scrape-config.yaml").read_text()
    pod = yaml.safe_load(SIDECAR.read_text())
    mv = next(c for c in pod["spec"]["containers"] if c["name"] == "mvproxy")
    mv["args"].append(recipe["args"])
    mv["ports"].append(yaml.safe_load(recipe["ports"]))
    for version in ("1.35", "1.36"):
        kubernetes_validate.validate(pod, version, strict=True)
    node_ip = "127.0.0.5"
    pki = tmp_path / "pki"
    init_pki(pki, [NODE_NAME], hosts=[node_ip], days=2)
    argv = resolve(mv["args"], mv["env"], {"status.hostIP": node_ip, "spec.nodeName": NODE_NAME})
    args = build_parser().parse_args(["run", *config_argv(argv[1:], dev_config(tmp_path, pki))])
    cfg = load_config(args.config, config_overrides(args))
    assert (cfg.admin.bind_address, cfg.admin.port) == ("127.0.0.1", 9443)
    assert (cfg.admin.metrics_bind_address, cfg.admin.metrics_port) == (node_ip, 9444)
    service, _ = yaml.safe_load_all((PROM / "mvproxy-servicemonitor.yaml").read_text())
    declared = {p["name"]: p["containerPort"] for p in mv["ports"]}
    (scraped,) = service["spec"]["ports"]
    assert declared[scraped["name"]] == scraped["targetPort"] == cfg.admin.metrics_port
    (job,) = yaml.safe_load((PROM / "scrape-config.yaml").read_text())["scrape_configs"]
    keep = next(r for r in job["relabel_configs"] if r.get("action") == "keep")
    assert re.fullmatch(keep["regex"], f"{mv['name']};{scraped['name']}")


# --------------------------------------------------------------- dashboard


def test_dashboard_is_grafana_json_in_the_essentials() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    used = set().union(*(metric_names(e) for e in dashboard_exprs(dashboard)))
    for metric in ("apiserver_rerouted_request_total", "mvproxy_peer_up",
                   "mvproxy_peer_discovery_age_seconds",
                   "mvproxy_request_duration_seconds_bucket", "mvproxy_peer_failovers_total",
                   "mvproxy_open_watches", "mvproxy_inflight_requests",
                   "mvproxy_certificate_expiry_timestamp_seconds",
                   "mvproxy_discovery_poll_errors_total"):
        assert metric in used, f"the dashboard shows no {metric}"


def dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if variable["type"] == "query":
            text = query["query"] if isinstance(query, dict) else query
            found = re.fullmatch(r"label_values\((.*),\s*\w+\)", text.strip())
            assert found, f"unexpected variable query {text!r}"
            exprs.append(found.group(1))
    return exprs


# ------------------------------------------- metric names against a daemon

_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, labels, keywords).

    Enough of PromQL for the expressions here: strings, label matchers, ranges and
    grouping clauses are removed first, then every identifier not followed by ``(``
    is a metric name.
    """
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    names = set()
    for found in re.finditer(r"(?<![\w.$:])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])(?!\s*\()", text):
        if found.group(1).lower() not in _KEYWORDS:
            names.add(found.group(1))
    return names


def test_metric_names_finds_metrics_and_nothing_else() -> None:
    expr = ('sum by (job, instance) (rate(apiserver_rerouted_request_total{code=~"5..",'
            ' instance=~"$instance"}[$__rate_interval])) / on (instance) group_left '
            'max(mvproxy_peer_up offset 5m) unless label_replace(up, "a", "$1", "b", "(.*)")'
            ' > bool 1e3 and histogram_quantile(0.99, sum by (le) '
            '(rate(mvproxy_request_duration_seconds_bucket[5m]))) - time()')
    assert metric_names(expr) == {"apiserver_rerouted_request_total", "mvproxy_peer_up",
                                  "up", "mvproxy_request_duration_seconds_bucket"}


def exported_names(exposition: str) -> set[str]:
    """The series names an exposition can produce, from its families' types (so a
    labelled family with no series yet still counts)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("_sum", "_count", ""), "gauge": ("",), "unknown": ("",)}
    names = set()
    for family in text_string_to_metric_families(exposition):
        names.update(family.name + s for s in suffixes[family.type])
    return names


def unknown_metrics(exprs: list[str], exported: set[str]) -> dict[str, str]:
    """Referenced name -> expression, for every name neither exported nor EXTERNAL."""
    return {name: expr for expr in exprs for name in metric_names(expr)
            if name not in exported and name not in EXTERNAL}


async def test_rules_and_dashboard_use_only_metrics_mvproxy_exports(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        # Traffic, so the labelled families have series too: a reroute to the peer,
        # a request for the backend, merged discovery.
        assert (await c.get(PODGROUPS))[0] == 200
        assert (await c.get("/api/v1/namespaces"))[0] == 200
        assert (await c.get("/apis"))[0] == 200
        status, exposition = await c.admin_get("/metrics")
        assert status == 200
        supervisor = Supervisor(config=c.daemon.config, config_path=None, overrides={})
    exported = exported_names(exposition)
    assert "apiserver_rerouted_request_total" in exported
    # With --workers N the supervisor adds its own families to the workers'.
    exported |= exported_names(generate_latest(supervisor.registry).decode())
    assert "mvproxy_worker_restarts_total" in exported

    rules = [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    dashboard = dashboard_exprs(json.loads(DASHBOARD.read_text()))
    assert not unknown_metrics(rules, exported), "rules use metrics mvproxy does not export"
    assert not unknown_metrics(dashboard, exported), \
        "the dashboard uses metrics mvproxy does not export"
    # And the check bites: a renamed metric is reported.
    renamed = rules[0].replace("up{", "mvproxy_up{") if "up{" in rules[0] else rules[0]
    assert unknown_metrics([renamed, "rate(mvproxy_peer_failover_total[5m])"], exported) \
        .keys() >= {"mvproxy_peer_failover_total"}
    # The bare histogram name selects nothing: only its _bucket/_sum/_count series exist.
    assert unknown_metrics(["mvproxy_request_duration_seconds"], exported)
