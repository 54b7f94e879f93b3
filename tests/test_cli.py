"""The command line as an operator meets it: exit codes and the messages printed."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import mvproxy
from mvproxy import devpki


def mvproxy_cmd(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "mvproxy", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def cluster_pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki") / "pki"
    devpki.init_pki(directory, ["apiserver-a", "apiserver-b"])
    return directory


def write_config(path: Path, pki_dir: Path, extra: str = "") -> Path:
    a = pki_dir / "apiserver-a"
    path.write_text(f"""\
apiVersion: mvproxy.io/v1alpha1
kind: MvproxyConfiguration
serverID: apiserver-a
tlsCertFile: {a}/mvproxy.crt
tlsPrivateKeyFile: {a}/mvproxy.key
clientCAFile: {pki_dir}/ca.crt
backend:
  url: https://127.0.0.1:6444
  caFile: {pki_dir}/ca.crt
  certFile: {a}/front-proxy-client.crt
  keyFile: {a}/front-proxy-client.key
peer: {{caFile: {pki_dir}/ca.crt, clientCAFile: {pki_dir}/front-proxy-ca.crt,
  certFile: {a}/front-proxy-client.crt, keyFile: {a}/front-proxy-client.key}}
peers: {{static: [{{serverID: apiserver-b, url: "https://127.0.0.2:6443"}}]}}
{extra}""")
    return path


def assert_clean_failure(result, code=2):
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr


def test_version_is_printed_by_console_script_and_module():
    result = mvproxy_cmd("--version")
    assert result.returncode == 0
    # What runs compiled is tests/test_compiled.py's; here only the line's shape.
    assert re.fullmatch(rf"mvproxy {re.escape(mvproxy.__version__)} "
                        r"\((pure Python|compiled: [a-z, ]+)\)", result.stdout.strip())


def test_no_command_is_a_usage_error():
    result = mvproxy_cmd()
    assert_clean_failure(result)
    assert "usage: mvproxy" in result.stderr


def test_check_config_accepts_a_good_file(tmp_path, cluster_pki):
    result = mvproxy_cmd("check-config", str(write_config(tmp_path / "c.yaml", cluster_pki)))
    assert result.returncode == 0, result.stderr
    assert "configuration is valid" in result.stdout


def test_check_config_reports_three_mistakes_at_once(tmp_path, cluster_pki):
    config = write_config(tmp_path / "c.yaml", cluster_pki,
                          "securePort: 70000\ndiscovery: {pollIntervall: 5s}\n")
    config.write_text(config.read_text().replace("https://127.0.0.1:6444",
                                                 "http://127.0.0.1:6444"))
    result = mvproxy_cmd("check-config", str(config))
    assert_clean_failure(result)
    assert "3 problems" in result.stderr
    assert "securePort: must be between 1 and 65535, got 70000" in result.stderr
    assert "backend.url: must be an https:// URL, got 'http://127.0.0.1:6444'" in result.stderr
    assert "discovery.pollIntervall: unknown key (did you mean 'pollInterval'?)" in result.stderr


def test_flags_override_the_file_and_are_validated(tmp_path, cluster_pki):
    config = str(write_config(tmp_path / "c.yaml", cluster_pki))
    result = mvproxy_cmd("check-config", config, "--backend-url", "ftp://x",
                         "--discovery-poll-interval", "soon")
    assert_clean_failure(result)
    assert "backend.url: must be an https:// URL, got 'ftp://x'" in result.stderr
    assert "discovery.pollInterval:" in result.stderr


def test_admin_listener_settings_are_validated_by_path(tmp_path, cluster_pki):
    config = write_config(tmp_path / "c.yaml", cluster_pki,
                          "admin: {allowedHosts: [ok.example, 'evil.example:80'],"
                          " metricsPort: 9443, metricsBindAddress: 127.0.0.1}\n")
    result = mvproxy_cmd("check-config", str(config), "--admin-metrics-bind-address", "nope")
    assert_clean_failure(result)
    assert "admin.allowedHosts[1]: must be a DNS name" in result.stderr
    assert "admin.metricsBindAddress: must be an IP address, got 'nope'" in result.stderr


def test_run_help_shows_every_default_the_schema_has():
    """``run --help`` said nothing of where the admin listener binds by default; every
    flag whose setting has a default now shows it, read from the schema."""
    result = mvproxy_cmd("run", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for flag, default in (("--admin-bind-address", "127.0.0.1"), ("--admin-port", "9443"),
                          ("--admin-metrics-port", "9444"), ("--bind-address", "0.0.0.0"),
                          ("--secure-port", "6443"), ("--discovery-poll-interval", "5s"),
                          ("--workers", "1"), ("--v", "2"), ("--log-format", "text")):
        start = text.index(f" {flag} ", text.index("options:"))
        following = text[start + 1:]
        end = following.find(" --", 1)
        assert f"(default {default})" in following[:end if end > 0 else None], (flag, text)
    assert "--admin-metrics-bind-address VALUE IP address of a second listener" in text


def test_a_key_that_does_not_match_its_certificate_names_both_files(tmp_path, cluster_pki):
    config = write_config(tmp_path / "c.yaml", cluster_pki)
    wrong_key = cluster_pki / "apiserver-b" / "front-proxy-client.key"
    config.write_text(config.read_text().replace(
        f"keyFile: {cluster_pki / 'apiserver-a' / 'front-proxy-client.key'}}}",
        f"keyFile: {wrong_key}}}"))
    result = mvproxy_cmd("check-config", str(config))
    assert_clean_failure(result)
    assert "peer.certFile:" in result.stderr
    assert f"{wrong_key}: private key does not match certificate" in result.stderr


def test_a_certificate_not_signed_by_the_peer_client_ca_is_reported(tmp_path, cluster_pki):
    config = write_config(tmp_path / "c.yaml", cluster_pki)
    config.write_text(config.read_text().replace(
        f"clientCAFile: {cluster_pki}/front-proxy-ca.crt,",
        f"clientCAFile: {cluster_pki}/ca.crt, insecureSharedCA: true,"))
    result = mvproxy_cmd("check-config", str(config))
    assert_clean_failure(result)
    assert "peer.certFile:" in result.stderr and "not signed" in result.stderr


def test_a_peer_client_ca_shared_with_the_client_ca_is_refused(tmp_path, cluster_pki):
    """The cluster CA signs users; the CSR API can issue one named front-proxy-client,
    which would then be a peer able to claim system:masters (issue: one trust model)."""
    config = write_config(tmp_path / "c.yaml", cluster_pki)
    shared = config.read_text().replace(f"clientCAFile: {cluster_pki}/front-proxy-ca.crt,",
                                        f"clientCAFile: {cluster_pki}/ca.crt,")
    config.write_text(shared)
    result = mvproxy_cmd("check-config", str(config))
    assert_clean_failure(result)
    assert "peer.clientCAFile: shares a CA with clientCAFile (CN=mvproxy-ca)" in result.stderr
    assert "insecureSharedCA" in result.stderr
    run = mvproxy_cmd("run", "--config", str(config))
    assert_clean_failure(run)
    assert "peer.clientCAFile: shares a CA" in run.stderr
    # A bundle that merely *contains* the cluster CA is the same hole.
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes((cluster_pki / "front-proxy-ca.crt").read_bytes()
                       + (cluster_pki / "ca.crt").read_bytes())
    config.write_text(shared.replace(f"clientCAFile: {cluster_pki}/ca.crt,",
                                     f"clientCAFile: {bundle},"))
    assert "peer.clientCAFile: shares a CA" in mvproxy_cmd("check-config", str(config)).stderr
    # The documented override, for test clusters only.
    config.write_text(shared.replace("peer: {", "peer: {insecureSharedCA: true, "))
    # (the certificate check still applies: front-proxy-client is not signed by ca.crt)
    assert "shares a CA" not in mvproxy_cmd("check-config", str(config)).stderr


@pytest.mark.parametrize("args,message", [
    (["check-config", "missing.yaml"], "missing.yaml: cannot read the configuration file"),
    (["check-config", "{config}", "--peer", "apiserver-b"], "--peer: expected ID=URL"),
    (["check-config", "{config}", "--secure-port", "abc"], "invalid int value: 'abc'"),
    (["certs", "init", "{tmp}/p"], "--server-id"),
    (["certs", "init", "{tmp}/p", "--server-id", "Bad/ID"], "Bad/ID"),
    (["certs", "init", "{tmp}/p", "--server-id", "a", "--days", "0"], "days"),
], ids=["missing config file", "peer without URL", "port not a number",
        "certs init without server id", "certs init with a bad server id",
        "certs init with zero days"])
def test_misuse_gets_one_clear_message_and_exit_2(tmp_path, cluster_pki, args, message):
    config = str(write_config(tmp_path / "c.yaml", cluster_pki))
    args = [a.format(config=config, tmp=tmp_path) for a in args]
    result = mvproxy_cmd(*args, cwd=tmp_path)
    assert_clean_failure(result)
    assert message in result.stderr


def test_certs_init_writes_the_layout_and_refuses_to_overwrite(tmp_path):
    target = tmp_path / "pki"
    first = mvproxy_cmd("certs", "init", str(target), "--server-id", "apiserver-a")
    assert first.returncode == 0, first.stderr
    assert (target / "apiserver-a" / "front-proxy-client.crt").is_file()
    again = mvproxy_cmd("certs", "init", str(target), "--server-id", "apiserver-a")
    assert_clean_failure(again)
    assert "--force" in again.stderr
    forced = mvproxy_cmd("certs", "init", str(target), "--server-id", "apiserver-a", "--force")
    assert forced.returncode == 0, forced.stderr


def test_run_with_an_invalid_configuration_exits_2_before_listening(tmp_path, cluster_pki):
    config = str(write_config(tmp_path / "c.yaml", cluster_pki, "admin: {port: -1}\n"))
    result = mvproxy_cmd("run", "--config", config)
    assert_clean_failure(result)
    assert "admin.port" in result.stderr


def test_check_config_warns_about_a_builtin_peer_proxy(tmp_path, cluster_pki):
    """The manifest check (``builtinmvp``) reaches the operator: a warning, exit 0."""
    config = str(write_config(tmp_path / "c.yaml", cluster_pki))
    manifest = tmp_path / "kube-apiserver.yaml"
    manifest.write_text("spec:\n  containers:\n  - name: kube-apiserver\n"
                        "    image: registry.k8s.io/kube-apiserver:v1.36.1\n"
                        "    command: [kube-apiserver, --peer-ca-file=/pki/ca.crt]\n")
    result = mvproxy_cmd("check-config", config, "--kube-apiserver-manifest", str(manifest))
    assert result.returncode == 0, result.stderr
    assert "warning:" in result.stderr and "--peer-ca-file" in result.stderr
    missing = mvproxy_cmd("check-config", config, "--kube-apiserver-manifest",
                          str(tmp_path / "absent.yaml"))
    assert_clean_failure(missing)
    assert "absent.yaml" in missing.stderr
