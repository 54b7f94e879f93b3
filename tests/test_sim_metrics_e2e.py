"""The simulator's own ``/metrics`` and its simulator-limit answers, end to end (issue 13).

A real ``mvproxy demo``-style cluster (1.35 + 1.36 sharing one store, loopback, free
ports) and the real kubectl 1.36: ``kubectl get --raw /metrics`` returns kube's
``apiserver_*`` series through an mvproxy context and the ``-direct`` context, only for
users kube would let read it; paths a real apiserver serves but the simulator does not
answer a Status saying so, while unknown resources keep kube's exact 404.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from e2e_support import request

from mvproxy.devcluster.demo import DemoCluster, start_cluster

OLD, NEW = "apiserver-0", "apiserver-1"  # 1.35, 1.36


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoCluster]:
    with start_cluster(tmp_path_factory.mktemp("sim-metrics"), ["1.35", "1.36"],
                       base_port=0) as running:
        yield running


@pytest.mark.parametrize("context", [OLD, f"{OLD}-direct", NEW, f"{NEW}-direct"])
def test_kubectl_get_raw_metrics(cluster: DemoCluster, kubectl, context: str) -> None:
    kubectl("get", "configmaps", "-n", "default", kubeconfig=cluster.kubeconfig,
            context=context)
    out = kubectl("get", "--raw", "/metrics", kubeconfig=cluster.kubeconfig,
                  context=context).stdout
    assert "# TYPE apiserver_request_total counter" in out
    assert 'apiserver_current_inflight_requests{request_kind="readOnly"}' in out
    assert "process_start_time_seconds " in out
    lists = [line for line in out.splitlines()
             if line.startswith("apiserver_request_total{")
             and 'resource="configmaps"' in line and 'verb="LIST"' in line
             and 'code="200"' in line]
    assert lists, out[:2000]


def test_metrics_need_a_privileged_user(cluster: DemoCluster) -> None:
    # Anonymous: 401/403 like kube; never the series.
    for direct in (False, True):
        anon = request(cluster, OLD, "GET", "/metrics", cert=None, direct=direct)
        assert anon.status in (401, 403), anon
        assert b"apiserver_request_total" not in anon.body
        admin = request(cluster, OLD, "GET", "/metrics", direct=direct)
        assert admin.status == 200 and b"apiserver_request_total" in admin.body


@pytest.mark.parametrize("direct", [False, True])
def test_simulator_limits_say_so_and_unknown_resources_keep_kubes_404(
        cluster: DemoCluster, direct: bool) -> None:
    limit = request(cluster, OLD, "GET", "/logs/", direct=direct)
    assert limit.status == 404
    assert "not supported by mvproxy's simulated kube-apiserver" in \
        json.loads(limit.body)["message"]
    # An unknown group has no handler in kube-apiserver: Go's plain-text 404.
    unknown = request(cluster, OLD, "GET", "/apis/example.com/v1/widgets", direct=direct)
    assert (unknown.status, unknown.body) == (404, b"404 page not found\n")
    unknown = request(cluster, OLD, "GET", "/apis/apps/v1/widgets", direct=direct)
    assert unknown.status == 404
    assert json.loads(unknown.body)["message"] == \
        "the server could not find the requested resource"


@pytest.mark.parametrize("context", [OLD, f"{OLD}-direct"])
def test_kubectl_explain_pods_shows_real_field_docs(cluster: DemoCluster, kubectl,
                                                    context: str) -> None:
    out = kubectl("explain", "pods.spec.containers", kubeconfig=cluster.kubeconfig,
                  context=context).stdout
    assert "KIND:" in out and "Pod" in out
    assert "List of containers belonging to the pod." in out
    assert "imagePullPolicy" in out


def test_kubectl_explain_podgroups_through_an_old_servers_mvproxy(cluster: DemoCluster,
                                                                   kubectl) -> None:
    out = kubectl("explain", "podgroups.spec", kubeconfig=cluster.kubeconfig,
                  context=OLD).stdout
    assert "scheduling.k8s.io" in out and "PodGroup" in out
    assert "schedulingPolicy" in out
    # The 1.35 server alone does not serve them.
    alone = kubectl("explain", "podgroups", kubeconfig=cluster.kubeconfig,
                    context=f"{OLD}-direct", check=False)
    assert alone.returncode != 0


@pytest.mark.parametrize("context", [OLD, f"{OLD}-direct"])
def test_kubectl_apply_validates_through_openapi_v3(cluster: DemoCluster, kubectl,
                                                          tmp_path, context: str) -> None:
    manifest = tmp_path / "cm.yaml"
    manifest.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: explain-"
                        f"{context}\n  namespace: default\ndata:\n  a: b\n")
    kubectl("apply", "-f", str(manifest), kubeconfig=cluster.kubeconfig, context=context)
    got = kubectl("get", "configmap", f"explain-{context}", "-n", "default", "-o",
                  "jsonpath={.data.a}", kubeconfig=cluster.kubeconfig, context=context)
    assert got.stdout == "b"
