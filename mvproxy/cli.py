"""Command line: parse arguments and hand off to the module that does the work.

Flag names follow kube-apiserver where it has one; they and the subcommand names are
a public contract. Every ``MvproxyError`` ends the process with one clear message
and its exit code (2 for bad input), never with a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mvproxy import __version__
from mvproxy.errors import MvproxyError, UsageError

PROG = "mvproxy"

# flag dest -> YAML path of the same setting; a given flag overrides the file. Help
# shows each setting's default, read from the configuration schema (``default_text``).
RUN_FLAGS: dict[str, tuple[str, str]] = {
    "server_id": ("serverID", "stable name of this control-plane member"),
    "bind_address": ("bindAddress", "IP address of the secure listener"),
    "secure_port": ("securePort", "port of the secure listener"),
    "tls_cert_file": ("tlsCertFile", "serving certificate of the listener"),
    "tls_private_key_file": ("tlsPrivateKeyFile", "private key of --tls-cert-file"),
    "client_ca_file": ("clientCAFile", "CA that verifies downstream client certificates"),
    "backend_url": ("backend.url", "https URL of the backend kube-apiserver"),
    "backend_ca_file": ("backend.caFile", "CA that verifies the backend's serving certificate"),
    "backend_cert_file": ("backend.certFile", "front-proxy client certificate for the backend"),
    "backend_key_file": ("backend.keyFile", "private key of --backend-cert-file"),
    "peer_ca_file": ("peer.caFile", "CA that verifies peers' serving certificates"),
    "peer_client_ca_file": ("peer.clientCAFile",
                            "CA that verifies peers' client certificates (signs only proxies)"),
    "peer_cert_file": ("peer.certFile", "client certificate presented to peers"),
    "peer_key_file": ("peer.keyFile", "private key of --peer-cert-file"),
    "peer_allowed_names": ("peer.allowedNames", "comma-separated peer certificate CNs"),
    "peer_advertise_url": ("peer.advertiseURL", "URL peers use to reach this mvproxy"),
    "peers": ("peers.static", "a static peer as ID=URL (repeatable)"),
    "admin_bind_address": ("admin.bindAddress",
                           "IP address of the admin listener (metrics, health, debug, "
                           "status page; plain HTTP, no authentication)"),
    "admin_port": ("admin.port", "port of the admin listener"),
    "admin_metrics_bind_address": ("admin.metricsBindAddress",
                                   "IP address of a second listener serving /metrics alone, "
                                   "e.g. the node IP for Prometheus (default: none)"),
    "admin_metrics_port": ("admin.metricsPort", "port of the /metrics-only listener"),
    "discovery_poll_interval": ("discovery.pollInterval",
                                "time between discovery polls of each server, e.g. 5s, 500ms"),
    "workers": ("workers", "processes sharing the secure port"),
    "verbosity": ("logging.verbosity", "klog-style log verbosity 0..10"),
    "log_format": ("logging.format", "text or json"),
}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _help(path: str, text: str) -> str:
    from mvproxy.config import default_text  # stdlib only: cheap, but not for --version

    default = default_text(path)
    # argparse expands %-sequences in help: a literal % must be doubled.
    return (text if default is None else f"{text} (default {default})").replace("%", "%%")


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    for dest, (path, text) in RUN_FLAGS.items():
        help_text = _help(path, text)
        if dest == "peers":
            parser.add_argument("--peer", dest="peers", action="append", metavar="ID=URL",
                                help=help_text)
        elif dest == "verbosity":
            parser.add_argument("-v", "--v", dest="verbosity", type=int, metavar="N",
                                help=help_text)
        elif dest == "log_format":
            parser.add_argument("--log-format", dest="log_format", choices=("text", "json"),
                                help=help_text)
        elif dest in ("secure_port", "admin_port", "admin_metrics_port"):
            parser.add_argument(_flag(dest), dest=dest, type=int, metavar="PORT", help=help_text)
        elif dest == "workers":
            parser.add_argument(_flag(dest), dest=dest, type=int, metavar="N", help=help_text)
        else:
            parser.add_argument(_flag(dest), dest=dest, metavar="VALUE", help=help_text)


def _parse_peer(text: str) -> dict[str, str]:
    server_id, sep, url = text.partition("=")
    if not sep or not server_id or not url:
        raise UsageError(f"--peer: expected ID=URL, got {text!r}")
    return {"serverID": server_id, "url": url}


def config_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The flags the user gave, as YAML path -> raw value (what the file would hold)."""
    overrides: dict[str, object] = {}
    for dest, (path, _) in RUN_FLAGS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if dest == "peers":
            value = [_parse_peer(item) for item in value]
        elif dest == "peer_allowed_names":
            value = [name.strip() for name in value.split(",") if name.strip()]
        overrides[path] = value
    return overrides


class _Version(argparse.Action):
    """``--version``: the version and what runs compiled (``compiled``), computed only
    when asked, so that building the parser imports none of the core."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        from mvproxy.compiled import describe

        print(f"{PROG} {__version__} ({describe()})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Mixed Version Proxy sidecar for kube-apiserver.")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="show the version, and whether the core runs compiled, and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser("run", help="run the proxy daemon")
    run.add_argument("--config", metavar="FILE", help="MvproxyConfiguration YAML file")
    _add_run_flags(run)

    # Started by `run --workers N` for each worker; not for people (no help: not listed).
    worker = sub.add_parser("worker")
    worker.add_argument("--config", metavar="FILE")
    worker.add_argument("--overrides", required=True, metavar="JSON")
    worker.add_argument("--index", type=int, required=True)
    worker.add_argument("--admin-socket", required=True, metavar="PATH")

    check = sub.add_parser("check-config", help="validate a configuration file and exit")
    check.add_argument("config", metavar="FILE")
    check.add_argument("--kube-apiserver-manifest", metavar="FILE",
                       help="also warn if this kube-apiserver static pod runs upstream's "
                            "built-in peer proxy (e.g. /etc/kubernetes/manifests/"
                            "kube-apiserver.yaml)")
    _add_run_flags(check)

    certs = sub.add_parser("certs", help="development PKI")
    certs_sub = certs.add_subparsers(dest="certs_command", metavar="ACTION", required=True)
    init = certs_sub.add_parser("init", help="write a kubeadm-like PKI into DIR")
    init.add_argument("directory", metavar="DIR")
    init.add_argument("--server-id", dest="server_ids", action="append", required=True,
                      metavar="ID", help="a control-plane member (repeatable)")
    init.add_argument("--host", dest="hosts", action="append", default=[],
                      metavar="NAME_OR_IP", help="extra serving SAN (repeatable)")
    init.add_argument("--days", type=int, default=365, help="validity (default 365)")
    init.add_argument("--force", action="store_true", help="overwrite an existing DIR")

    sim = sub.add_parser("sim", help="run a simulated kube-apiserver (development)")
    sim.add_argument("--kubernetes-version", default="1.36", metavar="X.Y",
                     help="API catalog to serve (1.31 ... 1.37; default 1.36)")
    sim.add_argument("--server-id", required=True, metavar="ID",
                     help="serves with DIR/ID/apiserver.crt|key")
    sim.add_argument("--pki", required=True, metavar="DIR",
                     help="a `mvproxy certs init` directory")
    sim.add_argument("--secure-port", type=int, required=True, metavar="PORT")
    sim.add_argument("--bind-address", default="127.0.0.1", metavar="IP")
    sim.add_argument("--advertise-address", metavar="IP",
                     help="published in the default/kubernetes endpoints with "
                          "--secure-port (default: --bind-address)")
    sim.add_argument("--store", required=True, metavar="PATH",
                     help="shared SQLite object store (created if missing)")
    sim.add_argument("--token-auth-file", metavar="FILE",
                     help="static tokens, kube-apiserver CSV format")
    sim.add_argument("--audit-log-path", metavar="FILE", help="JSON-lines audit log")
    sim.add_argument("--runtime-config", default="", metavar="KEY=false,...",
                     help="turn off group/versions (apps/v1, core: v1) or, sim only, one "
                          "subresource (v1/pods/exec), like kube-apiserver's flag")
    sim.add_argument("-v", "--v", dest="verbosity", type=int, default=2, metavar="N")
    sim.add_argument("--log-format", choices=("text", "json"), default="text")

    demo = sub.add_parser("demo", help="run a mixed-version control plane on loopback")
    demo.add_argument("--dir", default=".mvproxy-demo", metavar="DIR",
                      help="where the demo keeps its PKI, kubeconfig, store, logs and audit "
                           "logs (store, logs and audit logs start afresh each run) "
                           "(default: %(default)s)")
    demo.add_argument("--versions", metavar="X.Y,...",
                      help="one kube-apiserver per entry, of that release "
                           "(1.31-1.37), each behind its own mvproxy; with --real, full "
                           "releases started oldest first (default: 1.35,1.35,1.36; with "
                           "--real 1.35.4,1.36.3)")
    demo.add_argument("--base-port", type=int, default=16443, metavar="N",
                      help="loopback ports: mvproxy i on N+i, its kube-apiserver on N+100+i, "
                           "its admin listener on N+200+i (with --real also etcd on N+300 "
                           "and N+301); 0 picks free ports (default: %(default)s)")
    demo.add_argument("--membership", choices=("static", "leases"), default="static",
                      help="how the mvproxies find each other: static peers or "
                           "Leases through their kube-apiservers (default: %(default)s)")
    demo.add_argument("--real", action="store_true",
                      help="real etcd and kube-apiservers instead of the simulator, each "
                           "server on its own 127.0.0.x; needs binaries built by "
                           "`python3 scripts/dev.py kube-binaries` (default: off)")
    demo.add_argument("--kube-binaries", metavar="DIR",
                      help="with --real: where the binaries are, as "
                           "DIR/<version>/{kube-apiserver,kube-controller-manager,etcd} "
                           "(default: $MVPROXY_KUBE_BINARIES, else ~/.cache/mvproxy/kube)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except MvproxyError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    # Imports are local so that `mvproxy --version` and `certs` stay fast and so
    # that a subcommand's dependencies never load for another.
    if args.command == "certs":
        from mvproxy.commands import certs_init
        return certs_init(args)
    if args.command == "check-config":
        from mvproxy.commands import check_config
        return check_config(args.config, config_overrides(args),
                            manifest=args.kube_apiserver_manifest)
    if args.command == "run":
        from mvproxy.commands import run
        return run(args.config, config_overrides(args))
    if args.command == "worker":
        from mvproxy.commands import worker
        return worker(args)
    if args.command == "sim":
        from mvproxy.commands import sim
        return sim(args)
    if args.command == "demo":
        from mvproxy.commands import demo
        return demo(args)
    raise UsageError(f"unknown command {args.command!r}")
