"""Warnings about upstream's built-in peer proxy running beside mvproxy.

kube-apiserver enables its peer proxy when ``--peer-ca-file`` is set and the
``UnknownVersionInteroperabilityProxy`` gate is on (staging/src/k8s.io/apiserver/pkg/
util/peerproxy; cmd/kube-apiserver/app/options/validation.go requires --peer-ca-file;
pkg/features/kube_features.go: alpha/off 1.28-1.35, beta/on from 1.36).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mvproxy.builtinmvp import warnings_for
from mvproxy.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
SIDECAR = ROOT / "config" / "kube-apiserver-sidecar.yaml"


def manifest(*flags: str, image: str = "registry.k8s.io/kube-apiserver:v1.36.0",
             args: tuple[str, ...] = ()) -> str:
    container = {"name": "kube-apiserver", "image": image,
                 "command": ["kube-apiserver", "--secure-port=6443", *flags]}
    if args:
        container["args"] = list(args)
    return yaml.safe_dump({"apiVersion": "v1", "kind": "Pod",
                           "spec": {"containers": [{"name": "mvproxy", "image": "m"},
                                                   container]}})


@pytest.mark.parametrize(("text", "warns"), [
    (manifest(), False),
    (manifest("--peer-ca-file=/etc/kubernetes/pki/ca.crt"), True),
    (manifest("--peer-ca-file", "/etc/kubernetes/pki/ca.crt"), True),
    (manifest(args=("--peer-ca-file=/pki/ca.crt",)), True),
    (manifest("--peer-ca-file=/pki/ca.crt", image="registry.k8s.io/kube-apiserver:v1.35.2"),
     False),
    (manifest("--peer-ca-file=/pki/ca.crt", "--feature-gates=A=true,"
              "UnknownVersionInteroperabilityProxy=true",
              image="registry.k8s.io/kube-apiserver:v1.35.2"), True),
    (manifest("--peer-ca-file=/pki/ca.crt",
              "--feature-gates=UnknownVersionInteroperabilityProxy=false"), False),
    (manifest("--peer-ca-file=/pki/ca.crt", image="example.com/apiserver@sha256:ab"), True),
    (manifest("--peer-ca-file="), False),
    (manifest("--peer-ca-file=/pki/ca.crt", image="k8s:v" + "1" * 5000 + ".36"), True),
], ids=["no peer CA", "peer CA on 1.36", "separate value", "in args", "1.35 default off",
        "1.35 gate on", "gate off", "unknown version", "empty value",
        "absurd version: unknown"])
def test_builtin_peer_proxy_is_detected(text, warns):
    found = warnings_for(text, "kube-apiserver.yaml")
    assert bool(found) is warns, found
    if warns:
        assert "--peer-ca-file" in found[0] and "UnknownVersionInteroperabilityProxy=false" \
            in found[0]


def test_the_sidecar_example_leaves_only_mvproxy_proxying():
    assert warnings_for(SIDECAR.read_text(), str(SIDECAR)) == []


@pytest.mark.parametrize("text", [
    "{", "kind: Pod\nspec: {containers: [{name: etcd}]}\n", "7", "spec: [1]\n",
    "spec: hello\n", "spec: {containers: 5}\n",
    "spec: {containers: [{name: kube-apiserver, command: 5}]}\n",
    "spec: {containers: [{name: kube-apiserver, args: [true]}]}\n",
    "spec: " + "[" * 5000 + "]" * 5000 + "\n",
], ids=["not YAML", "no kube-apiserver", "a number", "spec a list", "spec a string",
        "containers a number", "command a number", "args not strings", "nested deeply"])
def test_a_manifest_without_a_kube_apiserver_is_a_usage_error(text):
    """A clear error (exit 2 from the CLI), never a traceback."""
    with pytest.raises(UsageError, match="kube-apiserver.yaml"):
        warnings_for(text, "kube-apiserver.yaml")
