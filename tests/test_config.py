"""config.py: YAML + flags → frozen dataclasses; every problem at once, by YAML path."""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import yaml
from config_support import dotted_keys_of

from mvproxy.config import (
    API_VERSION,
    KIND,
    AdminConfig,
    BackendConfig,
    Config,
    DiscoveryConfig,
    DNSConfig,
    LeasesConfig,
    LoggingConfig,
    PeerConfig,
    StaticPeer,
    TimeoutsConfig,
    format_duration,
    parse_duration,
)
from mvproxy.configfile import load_config
from mvproxy.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parent.parent / "config" / "mvproxy.example.yaml"

PKI_FILES = [
    "certs/ca.crt",
    "certs/apiserver-a/mvproxy.crt",
    "certs/apiserver-a/mvproxy.key",
    "certs/apiserver-a/front-proxy-client.crt",
    "certs/apiserver-a/front-proxy-client.key",
    "certs/front-proxy-ca.crt",
]

MINIMAL = {
    "apiVersion": API_VERSION,
    "kind": KIND,
    "serverID": "apiserver-a",
    "tlsCertFile": "certs/apiserver-a/mvproxy.crt",
    "tlsPrivateKeyFile": "certs/apiserver-a/mvproxy.key",
    "backend": {"url": "https://127.0.0.1:6444"},
}

PEER_FILES = {
    "peer.caFile": "certs/ca.crt",
    "peer.clientCAFile": "certs/front-proxy-ca.crt",
    "peer.certFile": "certs/apiserver-a/front-proxy-client.crt",
    "peer.keyFile": "certs/apiserver-a/front-proxy-client.key",
}
PEER_B = {"serverID": "apiserver-b", "url": "https://10.0.0.2:6443"}
PEER_C = {"serverID": "apiserver-c", "url": "https://10.0.0.3:6443"}
DELETE = object()


def changed(document: dict, changes: dict) -> dict:
    """A deep copy of ``document`` with dotted keys set (or removed with DELETE)."""
    result = copy.deepcopy(document)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = result
        for part in parents:
            node = node.setdefault(part, {})
        if value is DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    return result


def write(directory: Path, document: dict | str, name: str = "mvproxy.yaml") -> Path:
    path = directory / name
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document))
    return path


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    """tmp_path with every PKI file the documents name (contents do not matter here)."""
    for name in PKI_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("PEM\n")
    return tmp_path


def problems_of(error: pytest.ExceptionInfo[ConfigError]) -> dict[str, str]:
    return {problem.path: problem.message for problem in error.value.problems}


# --- good documents ---------------------------------------------------------------------


def test_minimal_document_gets_every_default(pki):
    config = load_config(write(pki, MINIMAL))
    assert config == Config(
        server_id="apiserver-a",
        tls_cert_file=str(pki / "certs/apiserver-a/mvproxy.crt"),
        tls_private_key_file=str(pki / "certs/apiserver-a/mvproxy.key"),
        backend=BackendConfig(url="https://127.0.0.1:6444"),
    )
    assert (config.bind_address, config.secure_port, config.client_ca_file) == ("0.0.0.0", 6443,
                                                                                None)
    assert config.peer == PeerConfig(allowed_names=("front-proxy-client",))
    assert config.peers == ()
    assert config.discovery == DiscoveryConfig(
        poll_interval=5.0, stale_after=15.0, forget_after=600.0, timeout=5.0,
        max_document_bytes=33554432,
    )
    assert config.admin == AdminConfig(bind_address="127.0.0.1", port=9443)
    assert config.logging == LoggingConfig(format="text", verbosity=2)
    assert config.timeouts == TimeoutsConfig(connect=5.0, request=60.0, shutdown_grace_period=30.0)


def test_config_is_frozen(pki):
    config = load_config(write(pki, MINIMAL))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "changes, attribute, expected",
    [
        pytest.param({"discovery.pollInterval": "2s"}, "discovery.stale_after", 6.0,
                     id="staleAfter defaults to three poll intervals"),
        pytest.param({"discovery.pollInterval": "2s"}, "discovery.timeout", 2.0,
                     id="timeout defaults to the poll interval when that is shorter than 5s"),
        pytest.param({"discovery.pollInterval": "1m"}, "discovery.timeout", 5.0,
                     id="timeout defaults to 5s when the poll interval is longer"),
        pytest.param({"discovery.pollInterval": "5m"}, "discovery.forget_after", 900.0,
                     id="forgetAfter grows with a long staleAfter instead of contradicting it"),
        pytest.param({"discovery.pollInterval": "1m30s"}, "discovery.poll_interval", 90.0,
                     id="compound durations add up"),
        pytest.param({"discovery.staleAfter": "5s"}, "discovery.stale_after", 5.0,
                     id="staleAfter may equal pollInterval"),
        pytest.param({"timeouts.shutdownGracePeriod": "0s"}, "timeouts.shutdown_grace_period", 0.0,
                     id="shutdownGracePeriod may be zero"),
        pytest.param({"admin.port": 0}, "admin.port", 0, id="admin port 0 picks a free port"),
        pytest.param({"admin.allowedHosts": ["Node-A.Example.", "mvproxy"]},
                     "admin.allowed_hosts", ("node-a.example", "mvproxy"),
                     id="allowedHosts are kept lowercase without a final dot"),
        pytest.param({"admin.metricsBindAddress": "10.0.0.1"}, "admin",
                     AdminConfig(metrics_bind_address="10.0.0.1"),
                     id="the metrics listener takes port 9444 unless told"),
        pytest.param({"admin.metricsBindAddress": "10.0.0.1", "admin.metricsPort": 9443},
                     "admin.metrics_port", 9443,
                     id="the metrics listener may share the admin port on another address"),
        pytest.param({"admin.metricsBindAddress": "127.0.0.1", "admin.port": 0,
                      "admin.metricsPort": 0}, "admin.metrics_port", 0,
                     id="both listeners may pick free ports"),
        pytest.param({"bindAddress": "::"}, "bind_address", "::", id="bindAddress may be IPv6"),
        pytest.param({"clientCAFile": None}, "client_ca_file", None,
                     id="null is the same as leaving a key out"),
        pytest.param({"logging.format": "json", "logging.verbosity": 10}, "logging",
                     LoggingConfig(format="json", verbosity=10),
                     id="json logs at the highest verbosity"),
        pytest.param({"peer.allowedNames": ["mvproxy-peer", "legacy-peer"]}, "peer.allowed_names",
                     ("mvproxy-peer", "legacy-peer"), id="allowedNames becomes a tuple"),
        pytest.param({"peers": {"static": []}}, "peers", (),
                     id="an empty static list needs no peer files"),
        pytest.param({**PEER_FILES, "peers.static": [PEER_B, PEER_C]}, "peers",
                     (StaticPeer(server_id="apiserver-b", url="https://10.0.0.2:6443"),
                      StaticPeer(server_id="apiserver-c", url="https://10.0.0.3:6443")),
                     id="peers.static flattens into Config.peers in order"),
        pytest.param({}, "membership.leases", LeasesConfig(), id="leases are off by default"),
        pytest.param({**PEER_FILES, "peer.advertiseURL": "https://10.0.0.1:6443",
                      "backend.certFile": "certs/apiserver-a/front-proxy-client.crt",
                      "backend.keyFile": "certs/apiserver-a/front-proxy-client.key",
                      "peers.leases": {"enabled": True, "leaseDuration": "3s", "renewPeriod": "1s",
                                       "namespace": "mvproxy", "apiServerIdentity": False}},
                     "membership.leases",
                     LeasesConfig(enabled=True, namespace="mvproxy", lease_duration=3.0,
                                  renew_period=1.0, api_server_identity=False),
                     id="lease membership with short intervals"),
        pytest.param({**PEER_FILES, "peers.dns.name": "mvproxy.kube-system.svc"}, "membership.dns",
                     DNSConfig(name="mvproxy.kube-system.svc", port=6443, interval=10.0),
                     id="dns membership defaults its port and interval"),
    ],
)
def test_good_documents(pki, changes, attribute, expected):
    config = load_config(write(pki, changed(MINIMAL, changes)))
    value = config
    for name in attribute.split("."):
        value = getattr(value, name)
    assert value == expected


def test_file_paths_are_absolute_and_relative_to_the_config_file(pki, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    document = changed(MINIMAL, {
        "clientCAFile": "certs/ca.crt",
        "backend.certFile": "certs/apiserver-a/front-proxy-client.crt",
        # absolute stays as is
        "backend.keyFile": str(pki / "certs/apiserver-a/front-proxy-client.key"),
    })
    config = load_config(os.path.relpath(write(pki, document)))
    assert config.client_ca_file == str(pki / "certs/ca.crt")
    assert config.backend.cert_file == str(pki / "certs/apiserver-a/front-proxy-client.crt")
    assert config.backend.key_file == str(pki / "certs/apiserver-a/front-proxy-client.key")


def test_example_file_documents_every_key_and_parses(tmp_path):
    shutil.copy(EXAMPLE, tmp_path / "mvproxy.yaml")
    for name in PKI_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("PEM\n")
    config = load_config(tmp_path / "mvproxy.yaml")
    assert config.server_id == "apiserver-a"
    assert config.peers == (StaticPeer(server_id="apiserver-b", url="https://10.0.0.2:6443"),)
    assert config.peer.cert_file == str(tmp_path / "certs/apiserver-a/front-proxy-client.crt")
    assert config.backend.cert_file == str(tmp_path / "certs/apiserver-a/front-proxy-client.crt")
    assert dotted_keys(yaml.safe_load(EXAMPLE.read_text())) == \
        dotted_keys_of(Config) | {"apiVersion", "kind"}


def dotted_keys(document: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in document.items():
        keys.add(prefix + key)
        if isinstance(value, dict):
            keys |= dotted_keys(value, f"{prefix}{key}.")
    return keys


# --- bad documents: one row per rule ----------------------------------------------------

BAD = [
    # (id, changes, {problem path: phrase the user reads})
    ("serverID is required", {"serverID": DELETE}, {"serverID": "required"}),
    ("serverID must be a lowercase DNS name", {"serverID": "Apiserver_A"},
     {"serverID": "must be a lowercase DNS name"}),
    ("serverID must not end with a dash", {"serverID": "apiserver-"},
     {"serverID": "got 'apiserver-'"}),
    ("serverID must be at most 253 characters", {"serverID": "a" * 254},
     {"serverID": "at most 253 characters"}),
    ("serverID must be a string", {"serverID": 7},
     {"serverID": "must be a non-empty string, got 7"}),
    ("bindAddress must be an IP address", {"bindAddress": "localhost"},
     {"bindAddress": "must be an IP address, got 'localhost'"}),
    ("securePort must be an integer, not a string", {"securePort": "6443"},
     {"securePort": "must be an integer, got '6443'"}),
    ("securePort must not be a bool", {"securePort": True},
     {"securePort": "must be an integer, got True"}),
    ("securePort must be at most 65535", {"securePort": 70000},
     {"securePort": "must be between 1 and 65535, got 70000"}),
    ("securePort must not be 0", {"securePort": 0},
     {"securePort": "must be between 1 and 65535, got 0"}),
    ("tlsCertFile is required", {"tlsCertFile": DELETE}, {"tlsCertFile": "required"}),
    ("tlsCertFile must exist", {"tlsCertFile": "certs/missing.crt"},
     {"tlsCertFile": "no such file: '"}),
    ("tlsPrivateKeyFile must be a file, not a directory", {"tlsPrivateKeyFile": "certs"},
     {"tlsPrivateKeyFile": "not a regular file: '"}),
    ("clientCAFile must exist when given", {"clientCAFile": "nope.crt"},
     {"clientCAFile": "no such file"}),
    ("backend is required", {"backend": DELETE}, {"backend.url": "required"}),
    ("backend must be a mapping", {"backend": "https://127.0.0.1:6444"},
     {"backend": "must be a mapping, got 'https://127.0.0.1:6444'"}),
    ("backend.url must be https", {"backend.url": "http://127.0.0.1:6444"},
     {"backend.url": "must be an https:// URL, got 'http://127.0.0.1:6444'"}),
    ("backend.url needs a host", {"backend.url": "https:///healthz"},
     {"backend.url": "must be an https:// URL"}),
    ("backend.url needs a numeric port", {"backend.url": "https://host:port"},
     {"backend.url": "must be an https:// URL"}),
    ("backend.url takes no path", {"backend.url": "https://127.0.0.1:6444/api"},
     {"backend.url": "must be https://host[:port] with no credentials, path or query"}),
    ("backend.url takes no credentials", {"backend.url": "https://u:secret@127.0.0.1:6444"},
     {"backend.url": "must be https://host[:port] with no credentials, path or query"}),
    ("backend certFile needs keyFile",
     {"backend.certFile": "certs/apiserver-a/front-proxy-client.crt"},
     {"backend.keyFile": "required when certFile is set"}),
    ("backend keyFile needs certFile",
     {"backend.keyFile": "certs/apiserver-a/front-proxy-client.key"},
     {"backend.certFile": "required when keyFile is set"}),
    ("unknown key gets a did-you-mean hint", {"backend.cafile": "certs/ca.crt"},
     {"backend.cafile": "unknown key (did you mean 'caFile'?)"}),
    ("unknown top-level key is rejected", {"colour": "red"}, {"colour": "unknown key"}),
    ("peer files are required when peers are configured", {"peers.static": [PEER_B]},
     {"peer.caFile": "required when peers are configured",
      "peer.certFile": "required when peers are configured",
      "peer.clientCAFile": "required when peers are configured",
      "peer.keyFile": "required when peers are configured"}),
    ("peer.insecureSharedCA must be a boolean", {"peer.insecureSharedCA": "true"},
     {"peer.insecureSharedCA": "must be true or false, got 'true'"}),
    ("peer.allowedNames must not be empty", {"peer.allowedNames": []},
     {"peer.allowedNames": "must not be empty"}),
    ("peer.allowedNames entries must be non-empty strings",
     {"peer.allowedNames": ["mvproxy-peer", ""]},
     {"peer.allowedNames[1]": "must be a non-empty string, got ''"}),
    ("peer.allowedNames must be a list", {"peer.allowedNames": "mvproxy-peer"},
     {"peer.allowedNames": "must be a list, got 'mvproxy-peer'"}),
    ("peer.advertiseURL must be https", {"peer.advertiseURL": "10.0.0.1:6443"},
     {"peer.advertiseURL": "must be an https:// URL, got '10.0.0.1:6443'"}),
    ("peers must be a mapping holding static", {"peers": [PEER_B]},
     {"peers": "must be a mapping, got a list"}),
    ("lease membership needs the peer files, an advertised URL and a backend certificate",
     {"peers.leases.enabled": True},
     {"peer.caFile": "required when peers are configured", "peer.certFile": "required",
      "peer.clientCAFile": "required", "peer.keyFile": "required",
      "peer.advertiseURL": "required when peers.leases.enabled is true",
      "backend.certFile": "required when peers.leases.enabled is true"}),
    ("peers.leases.renewPeriod must be below leaseDuration",
     {"peers.leases.leaseDuration": "10s", "peers.leases.renewPeriod": "10s"},
     {"peers.leases.renewPeriod": "must be < leaseDuration (10s), got '10s'"}),
    ("peers.leases.enabled must be a boolean", {"peers.leases.enabled": "yes"},
     {"peers.leases.enabled": "must be true or false, got 'yes'"}),
    ("peers.leases.namespace must be a DNS name", {"peers.leases.namespace": "Kube_System"},
     {"peers.leases.namespace": "must be a lowercase DNS name"}),
    ("peers.leases.leaseDuration needs a unit", {"peers.leases.leaseDuration": 30},
     {"peers.leases.leaseDuration": "must be a duration with a unit"}),
    ("a serverID too long to name a Lease",
     {**PEER_FILES, "serverID": ".".join(["a" * 61] * 4), "peers.leases.enabled": True,
      "peer.advertiseURL": "https://10.0.0.1:6443",
      "backend.certFile": "certs/apiserver-a/front-proxy-client.crt",
      "backend.keyFile": "certs/apiserver-a/front-proxy-client.key"},
     {"serverID": "at most 245 characters when peers.leases.enabled is true"}),
    ("dns membership needs the peer files", {"peers.dns.name": "mvproxy.kube-system.svc"},
     {"peer.caFile": "required when peers are configured", "peer.certFile": "required",
      "peer.clientCAFile": "required", "peer.keyFile": "required"}),
    ("peers.dns.name must be a DNS name", {"peers.dns.name": "http://x"},
     {"peers.dns.name": "must be a lowercase DNS name"}),
    ("peers.dns.port must be a port", {"peers.dns.port": 0},
     {"peers.dns.port": "must be between 1 and 65535, got 0"}),
    ("peers.dns.interval must be > 0", {"peers.dns.interval": "0s"},
     {"peers.dns.interval": "must be > 0, got '0s'"}),
    ("peers has no unknown source", {"peers.consul": {}}, {"peers.consul": "unknown key"}),
    ("a static peer needs a url", {**PEER_FILES, "peers.static": [{"serverID": "apiserver-b"}]},
     {"peers.static[0].url": "required"}),
    ("a static peer must not reuse our serverID",
     {**PEER_FILES, "peers.static": [{"serverID": "apiserver-a", "url": "https://10.0.0.2:6443"}]},
     {"peers.static[0].serverID": "must differ from the top-level serverID 'apiserver-a'"}),
    ("static peer server IDs must be unique",
     {**PEER_FILES, "peers.static": [PEER_B, {**PEER_C, "serverID": "apiserver-b"}]},
     {"peers.static[1].serverID": "duplicate 'apiserver-b' (already used by peers.static[0])"}),
    ("static peer URLs must be unique",
     {**PEER_FILES, "peers.static": [PEER_B, {**PEER_B, "serverID": "apiserver-c"}]},
     {"peers.static[1].url": "duplicate 'https://10.0.0.2:6443'"}),
    ("static peer keys are checked too",
     {**PEER_FILES, "peers.static": [{**PEER_B, "serverId": "x"}]},
     {"peers.static[0].serverId": "unknown key (did you mean 'serverID'?)"}),
    ("pollInterval needs a unit", {"discovery.pollInterval": "5"},
     {"discovery.pollInterval": "invalid duration '5': a unit is required"}),
    ("pollInterval must not be a bare number", {"discovery.pollInterval": 5},
     {"discovery.pollInterval": "must be a duration with a unit"}),
    ("pollInterval must be positive", {"discovery.pollInterval": "0s"},
     {"discovery.pollInterval": "must be > 0, got '0s'"}),
    ("staleAfter must be at least pollInterval",
     {"discovery.pollInterval": "10s", "discovery.staleAfter": "5s"},
     {"discovery.staleAfter": "must be >= pollInterval (10s), got '5s'"}),
    ("forgetAfter must be at least the derived staleAfter",
     {"discovery.pollInterval": "5m", "discovery.forgetAfter": "10m"},
     {"discovery.forgetAfter": "must be >= staleAfter (15m), got '10m'"}),
    ("discovery.timeout must be positive", {"discovery.timeout": "0ms"},
     {"discovery.timeout": "must be > 0"}),
    ("maxDocumentBytes must be positive", {"discovery.maxDocumentBytes": 0},
     {"discovery.maxDocumentBytes": "must be >= 1, got 0"}),
    ("admin.bindAddress must be an IP address", {"admin.bindAddress": "127.0.0.256"},
     {"admin.bindAddress": "must be an IP address"}),
    ("admin.port must not be negative", {"admin.port": -1},
     {"admin.port": "must be between 0 and 65535, got -1"}),
    ("admin.allowedHosts must be a list", {"admin.allowedHosts": "mvproxy.example"},
     {"admin.allowedHosts": "must be a list, got 'mvproxy.example'"}),
    ("admin.allowedHosts entries are DNS names without a port",
     {"admin.allowedHosts": ["ok.example", "node-a.example:9443"]},
     {"admin.allowedHosts[1]": "must be a DNS name (letters, digits, '-' and '.', no port"}),
    ("admin.allowedHosts entries have no scheme or wildcard",
     {"admin.allowedHosts": ["http://node-a", "*.example"]},
     {"admin.allowedHosts[0]": "got 'http://node-a'",
      "admin.allowedHosts[1]": "got '*.example'"}),
    ("admin.metricsBindAddress must be an IP address",
     {"admin.metricsBindAddress": "node-a.example"},
     {"admin.metricsBindAddress": "must be an IP address, got 'node-a.example'"}),
    ("admin.metricsPort must be a port", {"admin.metricsPort": 70000},
     {"admin.metricsPort": "must be between 0 and 65535, got 70000"}),
    ("admin.metricsPort must differ from admin.port on the same address",
     {"admin.metricsBindAddress": "127.0.0.1", "admin.metricsPort": 9443},
     {"admin.metricsPort": "must differ from port (9443) on an overlapping address"}),
    ("admin.metricsPort must differ from admin.port on an unspecified address",
     {"admin.metricsBindAddress": "0.0.0.0", "admin.port": 9000, "admin.metricsPort": 9000},
     {"admin.metricsPort": "must differ from port (9000)"}),
    ("logging.format must be text or json", {"logging.format": "yaml"},
     {"logging.format": "must be one of 'text', 'json', got 'yaml'"}),
    ("logging.verbosity must be at most 10", {"logging.verbosity": 11},
     {"logging.verbosity": "must be between 0 and 10, got 11"}),
    ("shutdownGracePeriod must not be negative", {"timeouts.shutdownGracePeriod": "-1s"},
     {"timeouts.shutdownGracePeriod": "invalid duration '-1s'"}),
    ("timeouts.connect must be positive", {"timeouts.connect": "0s"},
     {"timeouts.connect": "must be > 0"}),
    ("timeouts.request must be a duration", {"timeouts.request": "a minute"},
     {"timeouts.request": "invalid duration 'a minute'"}),
    ("apiVersion must match exactly", {"apiVersion": "mvproxy.io/v1"},
     {"apiVersion": "must be 'mvproxy.io/v1alpha1', got 'mvproxy.io/v1'"}),
    ("apiVersion is required in a file", {"apiVersion": DELETE}, {"apiVersion": "required"}),
    ("kind must match exactly", {"kind": "KubeletConfiguration"},
     {"kind": "must be 'MvproxyConfiguration', got 'KubeletConfiguration'"}),
]


@pytest.mark.parametrize("changes, expected", [pytest.param(c, e, id=i) for i, c, e in BAD])
def test_bad_documents_are_rejected_by_yaml_path(pki, changes, expected):
    path = write(pki, changed(MINIMAL, changes))
    with pytest.raises(ConfigError) as error:
        load_config(path)
    problems = problems_of(error)
    assert sorted(problems) == sorted(expected)
    for problem_path, phrase in expected.items():
        assert phrase in problems[problem_path]
    assert error.value.source == str(path)
    assert error.value.exit_code == 2


def test_every_problem_is_reported_at_once(pki):
    document = changed(MINIMAL, {
        "serverID": DELETE,
        "securePort": "https",
        "backend.url": "http://127.0.0.1:6444",
        "backend.cafile": "certs/ca.crt",
        "discovery.pollInterval": "5",
        "logging.format": "xml",
    })
    path = write(pki, document)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert sorted(problems_of(error)) == [
        "backend.cafile", "backend.url", "discovery.pollInterval", "logging.format", "securePort",
        "serverID",
    ]
    message = str(error.value)
    assert message.startswith(f"{path}: 6 problems\n")
    assert ("  backend.url: must be an https:// URL, got 'http://127.0.0.1:6444'"
            in message.splitlines())


def test_an_unreadable_file_is_a_problem(pki):
    if os.geteuid() == 0:
        pytest.skip("root can read a mode-000 file; the directory case covers the rest")
    key = pki / "certs/apiserver-a/mvproxy.key"
    key.chmod(0)
    with pytest.raises(ConfigError) as error:
        load_config(write(pki, MINIMAL))
    assert problems_of(error) == {"tlsPrivateKeyFile": f"file is not readable: {str(key)!r}"}


# --- overrides (flags) ------------------------------------------------------------------


def test_overrides_win_over_the_file(pki):
    overrides = {
        "serverID": "apiserver-z",
        "backend.url": "https://127.0.0.1:7443",
        "peers.static": [PEER_B],
        "peer.allowedNames": ["peer-x"],
        "discovery.pollInterval": "2s",
        "logging.verbosity": 4,
        "securePort": None,  # None means "flag not given": the file's value stays
    }
    config = load_config(write(pki, changed(MINIMAL, {**PEER_FILES, "securePort": 8443})),
                         overrides)
    assert config.server_id == "apiserver-z"
    assert config.backend.url == "https://127.0.0.1:7443"
    assert config.peers == (StaticPeer(server_id="apiserver-b", url="https://10.0.0.2:6443"),)
    assert config.peer.allowed_names == ("peer-x",)
    assert (config.discovery.poll_interval, config.discovery.stale_after) == (2.0, 6.0)
    assert config.logging.verbosity == 4
    assert config.secure_port == 8443


def test_override_paths_are_relative_to_the_working_directory(pki, tmp_path, monkeypatch):
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    monkeypatch.chdir(pki)
    document = changed(MINIMAL,
                       {"tlsCertFile": "/nonexistent",
                        "tlsPrivateKeyFile": "../certs/apiserver-a/mvproxy.key"})
    config = load_config(write(config_dir, document),
                         {"tlsCertFile": "certs/apiserver-a/mvproxy.crt"})
    assert config.tls_cert_file == str(pki / "certs/apiserver-a/mvproxy.crt")
    # from the file: relative to its directory
    assert config.tls_private_key_file == str(pki / "certs/apiserver-a/mvproxy.key")


def test_flags_alone_need_no_file(pki, monkeypatch):
    monkeypatch.chdir(pki)
    flags = {key: value for key,
             value in MINIMAL.items() if key not in ("apiVersion", "kind", "backend")}
    config = load_config(None, {**flags, "backend.url": "https://127.0.0.1:6444"})
    assert config.tls_private_key_file == str(pki / "certs/apiserver-a/mvproxy.key")
    assert config.backend.url == "https://127.0.0.1:6444"


def test_problems_from_flags_alone_name_flags_as_the_source():
    with pytest.raises(ConfigError) as error:
        load_config(None, {"serverID": "apiserver-a", "backend.url": "http://x"})
    assert error.value.source == "<flags>"
    assert problems_of(error) == {
        "tlsCertFile": "required",
        "tlsPrivateKeyFile": "required",
        "backend.url": "must be an https:// URL, got 'http://x'",
    }


def test_an_override_through_a_scalar_is_a_problem(pki):
    with pytest.raises(ConfigError) as error:
        load_config(write(pki, MINIMAL), {"serverID.name": "x"})
    assert problems_of(error) == {"serverID.name": "cannot override: 'serverID' is not a mapping"}


def test_an_override_does_not_leak_through_a_yaml_anchor(pki):
    text = yaml.safe_dump(changed(MINIMAL, {"backend": DELETE})) + (
        "backend: &tls {url: 'https://127.0.0.1:6444', caFile: certs/ca.crt}\n"
        "peer: {caFile: certs/ca.crt}\n"
    )
    config = load_config(write(pki, text), {"backend.url": "https://127.0.0.1:7443"})
    assert config.backend.url == "https://127.0.0.1:7443"


# --- the file itself --------------------------------------------------------------------


def test_yaml_syntax_error_names_the_file_line_and_column(tmp_path):
    path = write(tmp_path,
                 "apiVersion: mvproxy.io/v1alpha1\nkind: MvproxyConfiguration\n"
                 "backend:\n  url: [\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    [problem] = error.value.problems
    assert problem.path == str(path)
    assert problem.message.startswith("invalid YAML at line 5, column 1:")


def test_duplicate_keys_are_rejected_with_their_line(tmp_path):
    path = write(tmp_path,
                 "apiVersion: mvproxy.io/v1alpha1\nkind: MvproxyConfiguration\n"
                 "serverID: a\nserverID: b\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    [problem] = error.value.problems
    assert problem.message == "invalid YAML at line 4, column 1: duplicate key 'serverID'"


@pytest.mark.parametrize(
    "text, phrase",
    [
        pytest.param("", "must be a YAML mapping, got an empty document", id="empty file"),
        pytest.param("- a\n- b\n", "must be a YAML mapping, got a list", id="a list"),
        pytest.param("just text\n", "must be a YAML mapping, got 'just text'", id="a scalar"),
    ],
)
def test_the_document_must_be_a_mapping(tmp_path, text, phrase):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert problems_of(error) == {str(path): phrase}


@pytest.mark.parametrize(
    "name, phrase",
    [
        pytest.param("missing.yaml",
                     "cannot read the configuration file: No such file or directory", id="missing"),
        pytest.param(".", "cannot read the configuration file: Is a directory", id="a directory"),
    ],
)
def test_an_unreadable_config_file_is_one_problem(tmp_path, name, phrase):
    path = tmp_path / name
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert problems_of(error) == {str(path): phrase}
    assert str(error.value) == f"{path}: 1 problem\n  {path}: {phrase}"


# --- durations --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, seconds",
    [("5s", 5.0), ("1m", 60.0), ("500ms", 0.5), ("1h", 3600.0), ("1m30s", 90.0), ("2.5s", 2.5),
     ("0s", 0.0), ("1h2m3s4ms", 3723.004), (".5s", 0.5)],
)
def test_parse_duration_accepts_go_style_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text, phrase",
    [
        pytest.param("5", "a unit is required", id="bare number: ambiguous unit"),
        pytest.param("2.5", "a unit is required", id="bare decimal: ambiguous unit"),
        pytest.param("", "expected numbers with units", id="empty"),
        pytest.param("5 s", "expected numbers with units", id="space inside"),
        pytest.param("-5s", "expected numbers with units", id="negative"),
        pytest.param("5d", "expected numbers with units", id="days are not a unit"),
        pytest.param("s", "expected numbers with units", id="unit without number"),
        pytest.param("1m30", "expected numbers with units", id="trailing number without unit"),
    ],
)
def test_parse_duration_rejects_with_a_clear_message(text, phrase):
    with pytest.raises(ValueError, match=phrase) as error:
        parse_duration(text)
    assert repr(text) in str(error.value)


@pytest.mark.parametrize("seconds, text",
                         [(90.0, "1m30s"), (0.5, "500ms"), (0.0, "0s"), (3600.0, "1h"),
                          (2.5, "2.5s")])
def test_format_duration_is_the_inverse_of_parse_duration(seconds, text):
    assert format_duration(seconds) == text
    assert parse_duration(text) == seconds
