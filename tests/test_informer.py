"""The client-go informer (tests/realk8s/informer, built by ``scripts/dev.py
kube-binaries``) against mvproxy's simulated kube-apiserver on loopback: every
ADDED, MODIFIED and DELETED of a ConfigMap is printed, the cache syncs through
client-go's watch-list and, with it switched off, through a plain list; a resource the
server does not serve shows as 404s and no sync.

One informer per cached Kubernetes version (each is built against that version's
client-go). A missing binary skips here and fails in CI (``CI`` set), where
``kube-binaries`` has built it. The sim and every informer are stopped at teardown.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from informer_support import Informer, informer_binary, kube_binaries

from mvproxy.devcluster.kubeconfig import write_kubeconfig
from mvproxy.devcluster.launcher import SimProcess, free_port
from mvproxy.devpki import init_pki

READY_TIMEOUT = 30.0
CONTEXT = "sim"


@dataclass
class Sim:
    process: SimProcess
    kubeconfig: Path
    root: Path

    def api(self, method: str, path: str, body: dict | None = None,
            content_type: str = "application/json") -> dict:
        conn = http.client.HTTPSConnection("127.0.0.1", self.process.port, timeout=10,
                                           context=self.process.admin_context())
        try:
            headers = {"Accept": "application/json"}
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                headers["Content-Type"] = content_type
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            raw = response.read()
            assert response.status < 300, f"{method} {path}: {response.status} {raw[:300]!r}"
            return json.loads(raw) if raw else {}
        finally:
            conn.close()

    def namespace(self, name: str) -> str:
        self.api("POST", "/api/v1/namespaces",
                 {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        return name


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    root = tmp_path_factory.mktemp("informer")
    pki = root / "pki"
    init_pki(pki, ["sim-136"])
    with contextlib.ExitStack() as stack:
        process = SimProcess(kubernetes_version="1.36", server_id="sim-136", pki_dir=pki,
                             port=free_port(), store=root / "store.db", log_dir=root / "logs")
        stack.callback(process.stop)  # registered before start: stopped even if start fails
        process.start().wait_ready(READY_TIMEOUT)
        kubeconfig = write_kubeconfig(
            root / "kubeconfig", ca_file=pki / "ca.crt",
            clusters=[("sim-136", process.url)],
            users={"admin": {"client-certificate": pki / "admin.crt",
                             "client-key": pki / "admin.key"}},
            contexts=[(CONTEXT, "sim-136", "admin")], current_context=CONTEXT)
        yield Sim(process, kubeconfig, root)


def _env(watch_list: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k != "KUBECONFIG" and not k.startswith("KUBE_FEATURE_")}
    if not watch_list:
        env["KUBE_FEATURE_WatchListClient"] = "false"
    return env


@contextlib.contextmanager
def _informer(sim: Sim, version: str, name: str, *, watch_list: bool = True,
              **kwargs: object) -> Iterator[Informer]:
    informer = Informer(informer_binary(version), kubeconfig=sim.kubeconfig, context=CONTEXT,
                        env=_env(watch_list), stderr_path=sim.root / f"{name}.stderr",
                        **kwargs)  # type: ignore[arg-type]
    try:
        yield informer
    finally:
        informer.stop()


def _configmap(ns: str, name: str, data: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": ns}, "data": data}


@pytest.mark.parametrize("watch_list", [True, False], ids=["watch-list", "list-then-watch"])
@pytest.mark.parametrize("version", kube_binaries.DEFAULT_VERSIONS)
def test_informer_sees_every_event(sim: Sim, version: str, watch_list: bool) -> None:
    ns = sim.namespace(f"inf-{version.replace('.', '-')}-{'wl' if watch_list else 'lw'}")
    base = f"/api/v1/namespaces/{ns}/configmaps"
    before = sim.api("POST", base, _configmap(ns, "before", {"a": "1"}))

    with _informer(sim, version, ns, watch_list=watch_list, resource="configmaps",
                   namespace=ns) as informer:
        synced = informer.wait_for("SYNCED")
        assert synced["items"] == 1
        initial = informer.of_type("ADDED")
        assert [(e["name"], e["initialList"]) for e in initial] == [("before", True)]
        assert initial[0]["resourceVersion"] == before["metadata"]["resourceVersion"]
        requests = [(e["type"], e.get("sendInitialEvents")) for e in informer.lines
                    if e["type"] in ("LIST", "WATCH")]
        # client-go 0.35+ syncs through one watch with sendInitialEvents (which the sim
        # serves); without the gate, a list, then a watch from its resourceVersion.
        assert requests == ([("WATCH", True)] if watch_list
                            else [("LIST", None), ("WATCH", False)])
        assert not informer.of_type("ERROR", "WATCH_ERROR")

        created = sim.api("POST", base, _configmap(ns, "settings", {"color": "blue"}))
        added = informer.wait_for("ADDED", name="settings")
        assert added == {**added, "namespace": ns, "initialList": False,
                         "uid": created["metadata"]["uid"],
                         "resourceVersion": created["metadata"]["resourceVersion"]}

        patched = sim.api("PATCH", f"{base}/settings", {"data": {"size": "xl"}},
                          content_type="application/merge-patch+json")
        modified = informer.wait_for("MODIFIED", name="settings")
        assert modified["oldResourceVersion"] == created["metadata"]["resourceVersion"]
        assert modified["resourceVersion"] == patched["metadata"]["resourceVersion"]

        sim.api("DELETE", f"{base}/settings")
        deleted = informer.wait_for("DELETED", name="settings")
        assert deleted["finalStateUnknown"] is False
        assert deleted["uid"] == created["metadata"]["uid"]
    assert informer.proc.returncode == 0
    assert informer.wait_for("STOPPED")["reason"] == "stdin"
    events = [(e["type"], e["name"]) for e in informer.of_type("ADDED", "MODIFIED", "DELETED")]
    assert events == [("ADDED", "before"), ("ADDED", "settings"), ("MODIFIED", "settings"),
                      ("DELETED", "settings")]
    assert not informer.of_type("ERROR", "WATCH_ERROR")


@pytest.mark.parametrize("watch_list", [True, False], ids=["watch-list", "list-then-watch"])
def test_stopping_while_watching_reports_no_error(sim: Sim, watch_list: bool) -> None:
    """Regression: stopping cancels the watch request's context; client-go's stream
    watcher turns the failed body read into an Error event ("unable to decode an event
    from the watch stream: context canceled", 500) whenever it wins the race against the
    reflector's Stop(), about one stop in five. The informer used to print it as a
    WATCH_ERROR, as if the server had sent it. (main_test.go covers the race itself,
    deterministically; this is the end-to-end view, a few stops in a row.)"""
    version = kube_binaries.DEFAULT_VERSIONS[-1]
    ns = sim.namespace(f"stop-{'wl' if watch_list else 'lw'}")
    sim.api("POST", f"/api/v1/namespaces/{ns}/configmaps", _configmap(ns, "one", {"a": "1"}))
    for attempt in range(6):
        with _informer(sim, version, f"{ns}-{attempt}", watch_list=watch_list,
                       resource="configmaps", namespace=ns) as informer:
            informer.wait_for("SYNCED")
            if not informer.of_type("WATCH"):  # the watch is open (may print after SYNCED)
                informer.wait_for("WATCH")
        assert informer.proc.returncode == 0
        informer.wait_for("STOPPED")
        assert not informer.of_type("ERROR", "WATCH_ERROR"), informer.lines
        # (WATCH_END may come after STOPPED, or not at all: the process exits first.)
        assert all(e["stoppedByClient"] for e in informer.of_type("WATCH_END")), informer.lines


def test_resource_not_served_is_a_404_and_no_sync(sim: Sim) -> None:
    """What the end-to-end tests look for when mvproxy does not route a resource."""
    version = kube_binaries.DEFAULT_VERSIONS[-1]
    with _informer(sim, version, "not-served", group="example.com", resource="widgets",
                   extra_args=["--sync-timeout", "3s"]) as informer:
        error = informer.wait_for("ERROR")
        assert (error["code"], error["reason"]) == (404, "NotFound")
        assert informer.wait_for("STOPPED", timeout=15)["reason"] == "sync-timeout"
        assert informer.proc.wait(10) == 1
    assert not informer.of_type("SYNCED", "ADDED")
    # The watch-list is tried first, then the list; both got 404.
    assert {(e["type"], e.get("code")) for e in informer.of_type("LIST", "WATCH")} \
        >= {("WATCH", 404), ("LIST", 404)}
