"""What each subcommand does, once ``cli`` has parsed its arguments.

Kept apart from ``cli`` so that argument parsing stays declarative and each command
imports only what it needs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mvproxy.errors import MvproxyError, UsageError

if TYPE_CHECKING:  # imported where used: each command loads only what it needs
    import asyncio

    from mvproxy.config import Config


def certs_init(args: argparse.Namespace) -> int:
    from mvproxy import devpki

    written = devpki.init_pki(args.directory, args.server_ids, hosts=args.hosts,
                              days=args.days, force=args.force)
    print(f"wrote {len(written)} files to {args.directory}")
    return 0


def load_checked_config(path: str | None, overrides: dict[str, object]) -> Config:
    """Load, validate and check the certificate material of a configuration."""
    from mvproxy import preflight
    from mvproxy.configfile import load_config

    cfg = load_config(path, overrides)
    return preflight.check(cfg, path or "<flags>")


def check_config(path: str, overrides: dict[str, object], *, manifest: str | None = None
                 ) -> int:
    cfg = load_checked_config(path, overrides)
    if manifest is not None:
        from mvproxy import builtinmvp

        try:
            text = Path(manifest).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--kube-apiserver-manifest: cannot read {manifest}: {exc}") from None
        for warning in builtinmvp.warnings_for(text, manifest):
            print(f"warning: {warning}", file=sys.stderr)
    dynamic = "".join(f", peers from {what}" for what, on in (
        ("Leases", cfg.membership.leases.enabled), ("DNS", cfg.membership.dns.name)) if on)
    print(f"{path}: configuration is valid (serverID {cfg.server_id!r}, "
          f"{len(cfg.peers)} static peer{'s' if len(cfg.peers) != 1 else ''}{dynamic})")
    return 0


def run(path: str | None, overrides: dict[str, object]) -> int:
    """Run the daemon until SIGTERM/SIGINT; exit 0 after draining."""
    import asyncio

    from mvproxy import logs
    from mvproxy.app import build_daemon, serve

    cfg = load_checked_config(path, overrides)
    logs.configure(cfg.logging.format, cfg.logging.verbosity)
    if cfg.workers > 1:
        from mvproxy.workers import supervise

        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(supervise(cfg, path, overrides))
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve(build_daemon(cfg), load=lambda: load_checked_config(path, overrides)))
    return 0


def worker(args: argparse.Namespace) -> int:
    """One worker of ``run --workers N``, started by the supervisor (``workers``)."""
    import asyncio
    import json

    from mvproxy import logs
    from mvproxy.app import WorkerRole, build_daemon, serve

    cfg = load_checked_config(args.config, json.loads(args.overrides))
    logs.configure(cfg.logging.format, cfg.logging.verbosity, static={"worker": args.index})
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve(build_daemon(cfg), WorkerRole(args.index, args.admin_socket),
                         load=lambda: load_checked_config(args.config, json.loads(args.overrides))))
    return 0


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (about 1.45x less CPU per request on the
    data plane), else asyncio's own."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return None
    return uvloop.new_event_loop


def _no_simulator(exc: ModuleNotFoundError) -> MvproxyError:
    """The container image and standalone binary ship only the daemon
    (scripts/prune_runtime.py); say so instead of a traceback."""
    if exc.name is None or not exc.name.startswith("mvproxy.devcluster"):
        raise exc
    return MvproxyError("this build of mvproxy contains only the daemon (no simulator); "
                        "install the wheel (pip install mvproxy) for `mvproxy sim` "
                        "and `mvproxy demo`")


def sim(args: argparse.Namespace) -> int:
    from mvproxy import logs

    try:
        from mvproxy.devcluster.simserver import run_sim
    except ModuleNotFoundError as exc:
        raise _no_simulator(exc) from None

    logs.configure(args.log_format, args.verbosity)
    return run_sim(args)


def demo(args: argparse.Namespace) -> int:
    try:
        from mvproxy.devcluster.demo import run_demo
    except ModuleNotFoundError as exc:
        raise _no_simulator(exc) from None

    return run_demo(args)
