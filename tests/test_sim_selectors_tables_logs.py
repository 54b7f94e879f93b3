"""Field selectors, Table columns and pods/log of the simulated kube-apiserver (issue 13).

Unit tests for the selector parser, the printers and the log lines; then end to end with
real kubectl 1.20 and 1.36, through an mvproxy (``apiserver-0``) and straight at its
backend (``apiserver-0-direct``): ``describe configmap`` (which lists the configmap's
events by ``involvedObject.*`` field selectors), ``get events --field-selector``,
``get pods`` / ``-o wide`` / ``get deployments`` columns, ``logs`` and ``logs -f``.
The module fixture starts one demo cluster (1.35 + 1.36, loopback, free ports) and
stops it at teardown.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from aiohttp import web
from conftest import kubectl_env
from e2e_support import LineReader, request, stop_popen

from mvproxy.devcluster import fieldselectors, printers, simlogs, tables
from mvproxy.devcluster.demo import DemoCluster, start_cluster

# --------------------------------------------------------------------------- selector parser

POD = {"metadata": {"name": "web", "namespace": "shop"},
       "spec": {"nodeName": "node-1", "restartPolicy": "Always", "schedulerName": "default",
                "serviceAccountName": "sa", "hostNetwork": True},
       "status": {"phase": "Running", "podIP": "10.0.0.5", "nominatedNodeName": "node-2"}}
EVENT = {"metadata": {"name": "cfg.1", "namespace": "shop"},
         "involvedObject": {"kind": "ConfigMap", "namespace": "shop", "name": "cfg",
                            "uid": "u-1", "apiVersion": "v1", "resourceVersion": "7",
                            "fieldPath": "data"},
         "reason": "Synced", "source": {"component": "sim"}, "type": "Normal",
         "reportingComponent": "rc"}


def sel(text: str, resource: str = "pods", group: str = ""):
    return fieldselectors.parse(text, group, resource)


@pytest.mark.parametrize(("text", "matches"), [
    *((text, True) for text in (
        "metadata.name=web", "metadata.name==web", "metadata.namespace=shop",
        "spec.nodeName=node-1", "spec.host=node-1", "status.phase=Running",
        "spec.restartPolicy=Always", "spec.schedulerName=default",
        "spec.serviceAccountName=sa", "status.podIP=10.0.0.5",
        "status.nominatedNodeName=node-2", "spec.hostNetwork=true",
        "status.phase!=Pending,spec.nodeName=node-1", "metadata.name=web,")),
    *((text, False) for text in (
        "metadata.name!=web", "spec.nodeName=node-2", "status.phase=Pending",
        "status.phase=Running,spec.nodeName=other", "status.podIPs=10.0.0.5")),
])
def test_pod_field_selectors(text: str, matches: bool) -> None:
    assert sel(text)(POD) is matches


@pytest.mark.parametrize("label", [
    "involvedObject.kind=ConfigMap", "involvedObject.namespace=shop",
    "involvedObject.name=cfg", "involvedObject.uid=u-1", "involvedObject.apiVersion=v1",
    "involvedObject.resourceVersion=7", "involvedObject.fieldPath=data", "reason=Synced",
    "source=sim", "type=Normal", "reportingComponent=rc", "metadata.name=cfg.1",
])
def test_event_fields(label: str) -> None:
    assert sel(label, "events")(EVENT)
    assert not sel(label.replace("=", "!="), "events")(EVENT)


def test_describe_style_event_selector() -> None:
    text = ("involvedObject.name=cfg,involvedObject.namespace=shop,"
            "involvedObject.kind=ConfigMap,involvedObject.uid=u-1")
    assert sel(text, "events")(EVENT)
    assert not sel(text.replace("u-1", "u-2"), "events")(EVENT)


@pytest.mark.parametrize(("resource", "label"), [
    ("pods", "spec.containers"), ("events", "involvedObject.foo"), ("nodes", "spec.nodeName"),
    ("nodes", "metadata.namespace"), ("namespaces", "metadata.namespace"),
    ("services", "spec.selector"), ("secrets", "data"),
])
def test_unsupported_label_on_kinds_with_own_fields(resource: str, label: str) -> None:
    with pytest.raises(ValueError) as err:
        sel(f"{label}=x", resource)
    assert str(err.value) == f"field label not supported: {label}"


@pytest.mark.parametrize(("group", "resource"), [("", "configmaps"), ("apps", "deployments")])
def test_unsupported_label_on_other_kinds(group: str, resource: str) -> None:
    with pytest.raises(ValueError) as err:
        sel("status.phase=x", resource, group)
    assert str(err.value) == ('"status.phase" is not a known field selector: only '
                              '"metadata.name", "metadata.namespace"')
    assert sel("metadata.name=web,metadata.namespace=shop", resource, group)(POD)


@pytest.mark.parametrize("text", ["metadata.name", "=x", "metadata.name=a=b", "a\\"])
def test_malformed_selectors_are_errors(text: str) -> None:
    with pytest.raises(ValueError, match="invalid selector"):
        sel(text, "configmaps")


def test_escaped_values() -> None:
    obj = {"metadata": {"name": "a,b=c"}}
    assert sel(r"metadata.name=a\,b\=c", "configmaps")(obj)
    assert fieldselectors.split_terms(r"a=b\,c,d=e") == [r"a=b\,c", "d=e"]


@pytest.mark.parametrize("bad", [
    {}, {"metadata": "x"}, {"spec": [], "status": 3, "metadata": {"name": 5}},
    {"status": {"podIPs": "x"}}, {"status": {"podIPs": [7]}},
])
def test_hostile_objects_never_match_and_never_raise(bad) -> None:
    for text in ("spec.nodeName=n", "status.podIP=1.2.3.4", "metadata.name=5",
                 "status.phase=Running"):
        assert not sel(text)(bad)
    assert not sel("source=x", "events")({"source": "x"})
    assert not sel("metadata.name=x")("not a dict")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- printers

NOW = datetime(2026, 1, 1, 0, 10, tzinfo=UTC)
CREATED = "2026-01-01T00:00:00Z"


def _cells(resource: str, obj: dict, group: str = "") -> list:
    doc = tables.table([obj], group=group, resource=resource, now=NOW)
    return doc["rows"][0]["cells"]


def _columns(resource: str, group: str = "") -> list[tuple[str, str, int]]:
    doc = tables.table([], group=group, resource=resource, now=NOW)
    return [(c["name"], c["type"], c["priority"]) for c in doc["columnDefinitions"]]


def test_pod_columns_and_cells() -> None:
    assert _columns("pods") == [
        ("Name", "string", 0), ("Ready", "string", 0), ("Status", "string", 0),
        ("Restarts", "string", 0), ("Age", "string", 0), ("IP", "string", 1),
        ("Node", "string", 1), ("Nominated Node", "string", 1),
        ("Readiness Gates", "string", 1)]
    pod = {"metadata": {"name": "web", "creationTimestamp": CREATED},
           "spec": {"containers": [{"name": "a"}, {"name": "b"}], "nodeName": "n1"},
           "status": {"phase": "Running", "podIP": "10.1.1.1", "containerStatuses": [
               {"name": "a", "ready": True, "restartCount": 2},
               {"name": "b", "ready": False, "restartCount": 1,
                "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}}
    assert _cells("pods", pod) == ["web", "1/2", "CrashLoopBackOff", "3", "10m", "10.1.1.1",
                                   "n1", "<none>", "<none>"]
    pod["metadata"]["deletionTimestamp"] = CREATED
    assert _cells("pods", pod)[2] == "Terminating"


def test_deployment_service_configmap_namespace_cells() -> None:
    dep = {"metadata": {"name": "web", "creationTimestamp": CREATED},
           "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "web"}},
                    "template": {"spec": {"containers": [{"name": "c", "image": "nginx"}]}}},
           "status": {"readyReplicas": 2, "updatedReplicas": 3, "availableReplicas": 2}}
    assert [c[0] for c in _columns("deployments", "apps")] == [
        "Name", "Ready", "Up-to-date", "Available", "Age", "Containers", "Images", "Selector"]
    assert _cells("deployments", dep, "apps") == ["web", "2/3", 3, 2, "10m", "c", "nginx",
                                                  "app=web"]
    svc = {"metadata": {"name": "web", "creationTimestamp": CREATED},
           "spec": {"type": "NodePort", "clusterIP": "10.96.0.9", "selector": {"app": "web"},
                    "ports": [{"port": 80, "nodePort": 30080}, {"port": 53,
                                                                "protocol": "UDP"}]}}
    assert [c[0] for c in _columns("services")] == [
        "Name", "Type", "Cluster-IP", "External-IP", "Port(s)", "Age", "Selector"]
    assert _cells("services", svc) == ["web", "NodePort", "10.96.0.9", "<none>",
                                       "80:30080/TCP,53/UDP", "10m", "app=web"]
    cm = {"metadata": {"name": "cfg", "creationTimestamp": CREATED},
          "data": {"a": "1", "b": "2"}, "binaryData": {"c": ""}}
    assert _columns("configmaps") == [("Name", "string", 0), ("Data", "string", 0),
                                      ("Age", "string", 0)]
    assert _cells("configmaps", cm) == ["cfg", 3, "10m"]
    ns = {"metadata": {"name": "shop", "creationTimestamp": CREATED},
          "status": {"phase": "Active"}}
    assert _cells("namespaces", ns) == ["shop", "Active", "10m"]


def test_node_and_event_cells() -> None:
    node = {"metadata": {"name": "n1", "creationTimestamp": CREATED,
                         "labels": {"node-role.kubernetes.io/control-plane": ""}},
            "spec": {"unschedulable": True},
            "status": {"conditions": [{"type": "Ready", "status": "True"}],
                       "nodeInfo": {"kubeletVersion": "v1.36.0"},
                       "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]}}
    assert _cells("nodes", node)[:6] == ["n1", "Ready,SchedulingDisabled", "control-plane",
                                         "10m", "v1.36.0", "10.0.0.1"]
    event = {**EVENT, "lastTimestamp": CREATED, "message": "done ", "count": 2}
    assert [c[0] for c in _columns("events")] == [
        "Last Seen", "Type", "Reason", "Object", "Subobject", "Source", "Message",
        "First Seen", "Count", "Name"]
    assert _cells("events", event) == ["10m", "Normal", "Synced", "configmap/cfg", "data",
                                       "sim", "done", "10m", "2", "cfg.1"]


@pytest.mark.parametrize("resource", [r for _, r in printers.PRINTERS])
def test_hostile_objects_print_without_raising(resource: str) -> None:
    group = "apps" if resource == "deployments" else ""
    for bad in ({}, {"metadata": [], "spec": "x", "status": 1, "data": 3},
                {"spec": {"containers": "x", "ports": [1], "selector": [2]},
                 "status": {"containerStatuses": [None, {"restartCount": "9"}],
                            "conditions": "x", "addresses": [3]}}):
        cells = _cells(resource, bad, group)
        assert len(cells) == len(_columns(resource, group))


# --------------------------------------------------------------------------- log lines

LOG_POD = {"metadata": {"name": "web", "namespace": "shop", "creationTimestamp": CREATED},
           "spec": {"containers": [{"name": "a"}, {"name": "b"}],
                    "initContainers": [{"name": "init"}]}}


def test_container_rules() -> None:
    with pytest.raises(ValueError) as err:
        simlogs.pick_container(LOG_POD, "")
    assert str(err.value) == ("a container name must be specified for pod web, choose one "
                              "of: [a b] or one of the init containers: [init]")
    with pytest.raises(ValueError, match="^container zz is not valid for pod web$"):
        simlogs.pick_container(LOG_POD, "zz")
    assert simlogs.pick_container(LOG_POD, "init") == "init"
    assert simlogs.pick_container({"spec": {"containers": [{"name": "x"}]}}, "") == "x"


def test_log_lines_tail_and_timestamps() -> None:
    lines = simlogs.log_lines(LOG_POD, "a")
    assert len(lines) == simlogs.LINES
    assert lines[0] == "[shop/web/a] simulated log line 1 at 2026-01-01T00:00:01Z\n"
    assert simlogs.log_lines(LOG_POD, "a", tail=2) == lines[-2:]
    assert simlogs.log_lines(LOG_POD, "a", tail=0) == []
    stamped = simlogs.log_lines(LOG_POD, "b", timestamps=True, tail=1)
    assert stamped == [("2026-01-01T00:00:05.000000000Z [shop/web/b] simulated log line 5 "
                        "at 2026-01-01T00:00:05Z\n")]


# --------------------------------------------------------------------------- end to end

VERSIONS = ("1.20", "1.36")
CONTEXTS = ("apiserver-0", "apiserver-0-direct")
NS = "issue13"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoCluster]:
    with start_cluster(tmp_path_factory.mktemp("sel-tables-logs"), ["1.35", "1.36"],
                       base_port=0) as running:
        _seed(running)
        yield running


def _post(cluster: DemoCluster, path: str, body: dict) -> dict:
    made = request(cluster, "apiserver-0", "POST", path, body=body, direct=True)
    assert made.status == 201, made
    return made.json()


def _seed(c: DemoCluster) -> None:
    """A namespace with a configmap, its events (and another's), a pod, a deployment."""
    _post(c, "/api/v1/namespaces", {"metadata": {"name": NS}})
    cfg = _post(c, f"/api/v1/namespaces/{NS}/configmaps",
                {"metadata": {"name": "cfg"}, "data": {"a": "1", "b": "2"}})
    uid = cfg["metadata"]["uid"]
    for name, target, reason, target_uid in (("cfg.1", "cfg", "ConfigSynced", uid),
                                             ("stale.1", "cfg", "OtherThing", "old-uid"),
                                             ("other.1", "other", "OtherThing", "u-2")):
        _post(c, f"/api/v1/namespaces/{NS}/events", {
            "metadata": {"name": name},
            "involvedObject": {"kind": "ConfigMap", "namespace": NS, "name": target,
                               "apiVersion": "v1", "uid": target_uid},
            "reason": reason, "message": f"{reason} happened", "type": "Normal",
            "source": {"component": "sim"}, "count": 1,
            "firstTimestamp": "2026-01-01T00:00:00Z",
            "lastTimestamp": "2026-01-01T00:00:00Z"})
    _post(c, f"/api/v1/namespaces/{NS}/pods", {
        "metadata": {"name": "web"},
        "spec": {"containers": [{"name": "main", "image": "nginx:1.27"}],
                 "nodeName": "node-7"},
        "status": {"phase": "Running", "podIP": "10.244.0.9",
                   "containerStatuses": [{"name": "main", "ready": True, "restartCount": 4,
                                          "image": "nginx:1.27", "imageID": "",
                                          "state": {"running": {}}}]}})
    _post(c, f"/api/v1/namespaces/{NS}/pods", {
        "metadata": {"name": "duo"},
        "spec": {"containers": [{"name": "left", "image": "x"},
                                {"name": "right", "image": "y"}]}})
    _post(c, f"/apis/apps/v1/namespaces/{NS}/deployments", {
        "metadata": {"name": "shop"},
        "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "shop"}},
                 "template": {"metadata": {"labels": {"app": "shop"}},
                              "spec": {"containers": [{"name": "app", "image": "shop:1"}]}}},
        "status": {"replicas": 3, "readyReplicas": 2, "updatedReplicas": 3,
                   "availableReplicas": 2}})


@pytest.fixture(scope="module", params=VERSIONS)
def kc(request: pytest.FixtureRequest, cluster: DemoCluster,
       tmp_path_factory: pytest.TempPathFactory):
    """A real kubectl of one pinned release on the cluster's kubeconfig."""
    from kubectl import kubectl_binary

    binary = kubectl_binary(request.param)
    env = kubectl_env(tmp_path_factory.mktemp(f"home-{request.param}"))
    cache = tmp_path_factory.mktemp(f"cache-{request.param}")

    def argv(*args: str, context: str) -> list[str]:
        return [str(binary), "--kubeconfig", str(cluster.kubeconfig), "--cache-dir",
                str(cache), "--context", context, *args]

    def run(*args: str, context: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(argv(*args, context=context), capture_output=True, text=True,
                              timeout=60, env=env, stdin=subprocess.DEVNULL, check=False)
        if check:
            assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
        return done

    run.argv = argv  # type: ignore[attr-defined]
    run.env = env  # type: ignore[attr-defined]
    return run


def _words(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


@pytest.mark.parametrize("context", CONTEXTS)
def test_describe_configmap_shows_its_events(kc, context: str) -> None:
    out = kc("describe", "configmap", "cfg", "-n", NS, context=context).stdout
    assert re.search(r"^Name:\s+cfg$", out, re.MULTILINE), out
    assert "ConfigSynced" in out and "ConfigSynced happened" in out, out
    assert "OtherThing" not in out, out


@pytest.mark.parametrize("context", CONTEXTS)
def test_get_events_by_involved_object(kc, context: str) -> None:
    out = kc("get", "events", "-n", NS, "--field-selector",
             "involvedObject.name=cfg,reason!=OtherThing", context=context).stdout.splitlines()
    assert _words(out[0]) == ["LAST SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"], out
    assert len(out) == 2 and "configmap/cfg" in out[1] and "ConfigSynced" in out[1], out


@pytest.mark.parametrize("context", CONTEXTS)
def test_unsupported_field_label_is_a_400_with_kubes_message(kc, context: str) -> None:
    done = kc("get", "pods", "-n", NS, "--field-selector", "spec.bogus=1", context=context,
              check=False)
    assert done.returncode != 0
    assert "field label not supported: spec.bogus" in done.stderr, done.stderr
    assert "(BadRequest)" in done.stderr, done.stderr


@pytest.mark.parametrize("context", CONTEXTS)
def test_get_pods_columns(kc, context: str) -> None:
    out = kc("get", "pods", "-n", NS, "--field-selector", "status.phase=Running,"
             "spec.nodeName=node-7", context=context).stdout.splitlines()
    assert _words(out[0]) == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"], out
    assert len(out) == 2 and out[1].split()[:4] == ["web", "1/1", "Running", "4"], out
    wide = kc("get", "pods", "web", "-n", NS, "-o", "wide", context=context).stdout
    head, row = wide.splitlines()
    assert _words(head) == ["NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP", "NODE",
                            "NOMINATED NODE", "READINESS GATES"], wide
    assert row.split()[5:] == ["10.244.0.9", "node-7", "<none>", "<none>"], wide


@pytest.mark.parametrize("context", CONTEXTS)
def test_get_deployments_columns(kc, context: str) -> None:
    out = kc("get", "deployments", "-n", NS, context=context).stdout.splitlines()
    assert _words(out[0]) == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"], out
    assert out[1].split()[:4] == ["shop", "2/3", "3", "2"], out
    wide = kc("get", "deployments", "-n", NS, "-o", "wide", context=context).stdout
    assert wide.splitlines()[1].split()[5:] == ["app", "shop:1", "app=shop"], wide


@pytest.mark.parametrize("context", CONTEXTS)
def test_get_configmaps_and_namespaces_columns(kc, context: str) -> None:
    out = kc("get", "configmaps", "cfg", "-n", NS, context=context).stdout.splitlines()
    assert _words(out[0]) == ["NAME", "DATA", "AGE"] and out[1].split()[:2] == ["cfg", "2"]
    out = kc("get", "namespace", NS, context=context).stdout.splitlines()
    assert _words(out[0]) == ["NAME", "STATUS", "AGE"] and out[1].split()[:2] == [
        NS, "Active"]


@pytest.mark.parametrize("context", CONTEXTS)
def test_logs_print_the_pods_lines(kc, context: str) -> None:
    out = kc("logs", "pod/web", "-n", NS, context=context).stdout.splitlines()
    assert len(out) == simlogs.LINES
    assert all(line.startswith(f"[{NS}/web/main] simulated log line ") for line in out), out
    tail = kc("logs", "web", "-n", NS, "--tail", "2", "--timestamps", context=context)
    lines = tail.stdout.splitlines()
    assert len(lines) == 2 and re.match(r"^\d{4}-\d\d-\d\dT[\d:.]+Z \[", lines[0]), lines
    assert kc("logs", "duo", "-n", NS, "-c", "right", context=context).stdout.startswith(
        f"[{NS}/duo/right] ")


@pytest.mark.parametrize("context", CONTEXTS)
def test_logs_follow_streams_new_lines(kc, context: str) -> None:
    proc = subprocess.Popen(kc.argv("logs", "-f", "web", "-n", NS, "--tail", "1",
                                    context=context),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env=kc.env)
    reader = LineReader(proc)
    try:
        first = reader.wait_for(lambda line: "simulated log line 5 " in line)
        assert first.startswith(f"[{NS}/web/main]")
        reader.wait_for(lambda line: "simulated log line 6 " in line)
        reader.wait_for(lambda line: "simulated log line 7 " in line)
    finally:
        stop_popen(proc, reader)


@pytest.mark.parametrize("context", CONTEXTS)
def test_raw_log_needs_a_container_on_a_multi_container_pod(kc, context: str) -> None:
    done = kc("get", "--raw", f"/api/v1/namespaces/{NS}/pods/duo/log", context=context,
              check=False)
    assert done.returncode != 0
    assert ("a container name must be specified for pod duo, choose one of: [left right]"
            in done.stderr), done.stderr


# --------------------------------------------------------------------------- follow lifecycle

LOG = "/api/v1/namespaces/shop/pods/web/log"
ONE = {"metadata": {"name": "web", "namespace": "shop", "creationTimestamp": CREATED},
       "spec": {"containers": [{"name": "a"}]}}


async def _log_handler(request: web.Request) -> web.StreamResponse:
    return await simlogs.handle_log(request, ONE)


@pytest.fixture
async def log_app(aiohttp_client, monkeypatch):
    monkeypatch.setattr(simlogs, "FOLLOW_INTERVAL", 0.05)
    app = web.Application()
    app[simlogs.FOLLOWS] = set()
    app.on_shutdown.append(simlogs.on_shutdown)
    app.router.add_get(LOG, _log_handler)
    return app, await aiohttp_client(app)


async def _until(predicate, what: str) -> None:
    for _ in range(400):  # bounded: 400 x 25 ms
        if predicate():
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"never: {what}")


async def test_follow_ends_when_the_client_goes(log_app) -> None:
    app, client = log_app
    for _ in range(3):
        response = await client.get(LOG, params={"follow": "true", "tailLines": "1"})
        assert response.status == 200
        assert b"simulated log line 5 " in await response.content.readline()
        assert b"simulated log line 6 " in await response.content.readline()
        assert len(app[simlogs.FOLLOWS]) == 1
        response.close()  # the client goes away mid-stream
        await _until(lambda: not app[simlogs.FOLLOWS], "the follow loop ended")


async def test_shutdown_ends_followed_logs(log_app) -> None:
    app, client = log_app
    response = await client.get(LOG, params={"follow": "1", "tailLines": "0"})
    assert b"simulated log line 6 " in await response.content.readline()
    await simlogs.on_shutdown(app)
    rest = await asyncio.wait_for(response.content.read(), 10)  # the stream ends
    assert rest.count(b"\n") <= 2
    await _until(lambda: not app[simlogs.FOLLOWS], "the follow loop ended")


async def test_limit_bytes_ends_a_followed_log(log_app) -> None:
    _, client = log_app
    response = await client.get(LOG, params={"follow": "true", "limitBytes": "10"})
    assert await asyncio.wait_for(response.content.read(), 10) == b"[shop/web/"


@pytest.mark.parametrize(("query", "message"), [
    ({"tailLines": "-1"}, "tailLines: Invalid value: -1: must be greater than or equal to 0"),
    ({"tailLines": "x"}, "tailLines: Invalid value: 'x': must be an integer"),
    ({"limitBytes": "0"}, "limitBytes: Invalid value: 0: must be greater than 0"),
    ({"container": "nope"}, "container nope is not valid for pod web"),
    ({"previous": "true"}, 'previous terminated container "a" in pod "web" not found'),
])
async def test_bad_log_options_are_400(log_app, query: dict, message: str) -> None:
    _, client = log_app
    response = await client.get(LOG, params=query)
    assert response.status == 400
    doc = await response.json()
    assert (doc["kind"], doc["reason"], doc["message"]) == ("Status", "BadRequest", message)


# --------------------------------------------------------------------------- watch, in-process


@pytest.fixture
async def sim(aiohttp_client, tmp_path):
    from mvproxy.devcluster.catalog import load_catalog
    from mvproxy.devcluster.simserver import build_app
    from mvproxy.devcluster.store import Store

    store = Store(tmp_path / "store.db")
    app = build_app(catalog=load_catalog("1.36"), store=store, server_id="t",
                    server_address="127.0.0.1:1")
    try:
        yield await aiohttp_client(app)
    finally:
        store.close()


async def test_watch_honours_kind_specific_field_selectors(sim) -> None:
    pods = "/api/v1/namespaces/default/pods"
    for name, node in (("a", "n1"), ("b", "n2")):
        made = await sim.post(pods, json={"metadata": {"name": name},
                                          "spec": {"nodeName": node, "containers": [
                                              {"name": "c", "image": "x"}]}})
        assert made.status == 201, await made.text()
    bad = await sim.get(pods, params={"watch": "true", "fieldSelector": "spec.bogus=1"})
    assert bad.status == 400
    assert (await bad.json())["message"] == "field label not supported: spec.bogus"
    async with sim.get(pods, params={"watch": "true", "fieldSelector": "spec.nodeName=n2",
                                     "timeoutSeconds": "30"}) as response:
        line = await asyncio.wait_for(response.content.readline(), 10)
        event = json.loads(line)
        assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "b")
