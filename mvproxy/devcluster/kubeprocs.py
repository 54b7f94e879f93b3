"""Real etcd, kube-apiserver and kube-controller-manager as ``ManagedProcess``es.

Each class turns a few facts (binary, addresses, files of an ``init_pki`` directory with
``service_account_key=True``) into the command line a kubeadm control plane would run
on loopback, and knows how to tell that the component is ready. The demo
(``realdemo``) and the end-to-end tests start them; nothing here decides ports or
layouts.

kube-apiserver is started the way kubeadm lays it out: the cluster CA verifies client
certificates, the front-proxy CA (with ``--requestheader-allowed-names
front-proxy-client`` and the ``X-Remote-*`` headers) is what mvproxy authenticates
with, RBAC (with Node), a static token file, one shared service-account key pair and
service range, a JSON audit log. ``--endpoint-reconciler-type none``: 1.37 refuses a
loopback ``--advertise-address`` with the default reconciler, and no Service traffic
leaves this machine anyway.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Sequence
from pathlib import Path

from mvproxy.devcluster.launcher import ManagedProcess

StrPath = str | os.PathLike[str]

SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/12"  # kubeadm's default
FIRST_SERVICE_IP = "10.96.0.1"  # the kubernetes Service: a SAN of every server's certificate
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
REQUESTHEADER_ALLOWED_NAMES = "front-proxy-client"

#: Who did what, with user, groups and source addresses: what the tests read.
AUDIT_POLICY = """\
# Written by mvproxy demo --real: every request at Metadata level (user, groups,
# impersonation, sourceIPs, verb, URI, object reference, response code).
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
"""


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class EtcdProcess(ManagedProcess):
    """One etcd member on loopback, plain HTTP, no fsync (a throwaway data directory)."""

    def __init__(self, binary: StrPath, *, data_dir: StrPath, client_port: int,
                 peer_port: int, log_dir: StrPath, host: str = "127.0.0.1",
                 name: str = "etcd") -> None:
        self.client_url = f"http://{_url_host(host)}:{client_port}"
        peer_url = f"http://{_url_host(host)}:{peer_port}"
        self.data_dir = Path(data_dir).absolute()
        argv = [
            str(binary),
            "--name", name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{name}={peer_url}",
            "--unsafe-no-fsync=true",
            "--log-level", "warn",
        ]
        super().__init__(argv, name, log_dir, ready_url=f"{self.client_url}/health")


class KubeAPIServerProcess(ManagedProcess):
    """A real kube-apiserver; ready when ``/readyz`` answers 200 to the admin certificate.

    ``hostname`` goes to the wrapper's ``--mvproxy-hostname`` (tests/realk8s): the server
    ID and identity Lease name are hashed from it, so every server needs its own.
    """

    def __init__(self, binary: StrPath, *, version: str, name: str, hostname: str,
                 host: str, port: int, etcd_url: str, pki_dir: StrPath,
                 server_pki: StrPath, token_auth_file: StrPath, audit_policy: StrPath,
                 audit_log: StrPath, log_dir: StrPath,
                 extra_args: Sequence[str] = ()) -> None:
        from mvproxy.tls import client_context

        pki = Path(pki_dir).absolute()
        own = Path(server_pki).absolute()
        self.version = version
        self.binary = Path(binary)
        self.hostname = hostname
        self.host = host
        self.port = port
        self.url = f"https://{_url_host(host)}:{port}"
        self.audit_log = Path(audit_log).absolute()
        argv = [
            str(binary),
            "--mvproxy-hostname", hostname,
            "--etcd-servers", etcd_url,
            "--bind-address", host,
            "--advertise-address", host,
            "--secure-port", str(port),
            "--endpoint-reconciler-type", "none",
            "--tls-cert-file", str(own / "apiserver.crt"),
            "--tls-private-key-file", str(own / "apiserver.key"),
            "--client-ca-file", str(pki / "ca.crt"),
            "--requestheader-client-ca-file", str(pki / "front-proxy-ca.crt"),
            "--requestheader-allowed-names", REQUESTHEADER_ALLOWED_NAMES,
            "--requestheader-username-headers", "X-Remote-User",
            "--requestheader-group-headers", "X-Remote-Group",
            "--requestheader-extra-headers-prefix", "X-Remote-Extra-",
            "--proxy-client-cert-file", str(own / "front-proxy-client.crt"),
            "--proxy-client-key-file", str(own / "front-proxy-client.key"),
            "--service-account-issuer", SERVICE_ACCOUNT_ISSUER,
            "--service-account-key-file", str(pki / "sa.pub"),
            "--service-account-signing-key-file", str(pki / "sa.key"),
            "--service-cluster-ip-range", SERVICE_CLUSTER_IP_RANGE,
            "--authorization-mode", "Node,RBAC",
            "--enable-admission-plugins", "NodeRestriction",
            "--allow-privileged=true",
            "--token-auth-file", str(Path(token_auth_file).absolute()),
            "--audit-policy-file", str(Path(audit_policy).absolute()),
            "--audit-log-path", str(self.audit_log),
            "--profiling=false",
            # With watches open (a kube-controller-manager's), SIGTERM alone did not end
            # kube-apiserver within 30 s: it waits for them to drain. This bounds that
            # wait (measured: 1.1 s to exit). Given again in extra_args, the last wins.
            "--shutdown-watch-termination-grace-period=2s",
            *extra_args,
        ]
        super().__init__(argv, name, log_dir, ready_url=f"{self.url}/readyz",
                         ssl_context=client_context(pki / "ca.crt", pki / "admin.crt",
                                                    pki / "admin.key"))


class KubeControllerManagerProcess(ManagedProcess):
    """A real kube-controller-manager (kubeadm's flags, no leader election), talking to
    whatever server its kubeconfig names; ready when its own ``/healthz`` answers."""

    def __init__(self, binary: StrPath, *, version: str, name: str, kubeconfig: StrPath,
                 pki_dir: StrPath, host: str, port: int, cert_dir: StrPath,
                 log_dir: StrPath, extra_args: Sequence[str] = ()) -> None:
        pki = Path(pki_dir).absolute()
        config = str(Path(kubeconfig).absolute())
        self.version = version
        self.kubeconfig = Path(config)
        argv = [
            str(binary),
            "--kubeconfig", config,
            "--authentication-kubeconfig", config,
            "--authorization-kubeconfig", config,
            "--bind-address", host,
            "--secure-port", str(port),
            "--cert-dir", str(Path(cert_dir).absolute()),
            "--client-ca-file", str(pki / "ca.crt"),
            "--requestheader-client-ca-file", str(pki / "front-proxy-ca.crt"),
            "--root-ca-file", str(pki / "ca.crt"),
            "--service-account-private-key-file", str(pki / "sa.key"),
            "--cluster-signing-cert-file", str(pki / "ca.crt"),
            "--cluster-signing-key-file", str(pki / "ca.key"),
            "--use-service-account-credentials=true",
            "--controllers", "*,bootstrapsigner,tokencleaner",
            "--service-cluster-ip-range", SERVICE_CLUSTER_IP_RANGE,
            "--leader-elect=false",
            "--profiling=false",
            *extra_args,
        ]
        # Its serving certificate is self-signed (written into cert_dir): the probe,
        # on loopback, checks only that /healthz answers 200.
        probe = ssl.create_default_context()
        probe.check_hostname = False
        probe.verify_mode = ssl.CERT_NONE
        super().__init__(argv, name, log_dir, ssl_context=probe,
                         ready_url=f"https://{_url_host(host)}:{port}/healthz")


__all__ = [
    "AUDIT_POLICY",
    "FIRST_SERVICE_IP",
    "EtcdProcess",
    "KubeAPIServerProcess",
    "KubeControllerManagerProcess",
]
