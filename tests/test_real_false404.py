"""The failure mvproxy exists for, with the real kube-controller-manager (issue 20 §5).

kube-apiservers 1.36.3 and 1.37.2 (1.37 adds the namespaced PodCertificateRequests;
1.36 serves none of them), the kube-controller-manager at 1.36.3, the oldest, as the
skew policy says, talking to the old server. Two runs on one control plane, each with
its own kube-controller-manager:

* **no proxy**: it talks straight to the old kube-apiserver, users straight to the
  server each request needs. A namespace holding a PodCertificateRequest is deleted:
  the namespace controller, listing what to delete from its server's discovery, never
  sees the PodCertificateRequest, finalizes the namespace and leaves the object behind
  (a namespace made again with that name holds it). The owner, of a kind only 1.37
  serves, of a ConfigMap is deleted: the garbage collector cannot map the kind and
  never collects the dependent (its control, owned by a ConfigMap, is collected).
* **mvproxy**: it talks through the old server's mvproxy, users too: both are
  cleaned up.

The same code (``scripts/upstream_comparison.py``) writes these outcomes, with the
built-in proxy's, into ``docs/upstream-comparison.md``. Without the binaries these
tests skip, and fail under CI.
"""

from __future__ import annotations

import pytest
from real_support import require_binaries, upstream_comparison

cmp = upstream_comparison()

VERSIONS = ("1.36.3", "1.37.2")
GRACE = 5.0  # a dependent that should go: seconds after its control went
TIMEOUT = 45.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    binaries = require_binaries(VERSIONS)
    with cmp.start_pair(tmp_path_factory.mktemp("false404") / "pair", VERSIONS, cmp.MVPROXY,
                        binaries=binaries) as running:
        yield running


def test_without_a_proxy_the_old_controller_manager_leaves_objects_behind(cluster) -> None:
    outcome = cmp.false404_run(cluster, cmp.MVPROXY, cmp.VIA_DIRECT, "direct", grace=GRACE,
                               timeout=TIMEOUT)
    assert outcome.label == "no proxy" and outcome.kcm.startswith(VERSIONS[0])

    ns = outcome.namespace
    assert ns.skipped == "" and ns.resource == "certificates.k8s.io/v1 podcertificaterequests"
    assert ns.created is not None and ns.created.status == 201, ns.created
    assert ns.gone_after is not None, "the namespace was never finalized"
    # Gone with the namespace as far as the old server knows, but the new server still
    # has it, and hands it to whoever makes a namespace of that name next.
    assert ns.object_after is not None and ns.object_after.status == 200, ns.object_after
    assert ns.object_after.kind == "PodCertificateRequest"
    assert ns.recreated == 1

    gc = outcome.gc
    assert gc.control_after is not None, "the garbage collector collected nothing"
    assert gc.dependent_after is None, gc
    assert gc.dependent_at_end is not None and gc.dependent_at_end.status == 200


def test_through_mvproxy_nothing_is_left_behind(cluster) -> None:
    outcome = cmp.false404_run(cluster, cmp.MVPROXY, cmp.VIA_MVPROXY, "mvproxy", grace=GRACE,
                               timeout=TIMEOUT)
    assert outcome.label == "mvproxy" and outcome.kcm.startswith(VERSIONS[0])

    ns = outcome.namespace
    assert ns.created is not None and ns.created.status == 201, ns.created
    assert ns.gone_after is not None, "the namespace was never finalized"
    assert ns.object_after is not None and ns.object_after.status == 404, ns.object_after
    assert ns.object_after.reason == "NotFound"

    gc = outcome.gc
    assert gc.control_after is not None and gc.dependent_after is not None, gc
    assert gc.dependent_at_end is not None and gc.dependent_at_end.status == 404
