"""SIGHUP: apply a re-read configuration to a running daemon, where that is safe.

Live: the static peer list, discovery polling (interval, timeout, document limit,
staleAfter, forgetAfter), upstream timeouts, the shutdown settings and the log
verbosity. Everything else (listening addresses, certificates' paths, identity
settings, limits, workers, log format) needs a restart: a reload names each such
key, keeps the running value, and applies the rest. A file that does not validate
changes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

from mvproxy import logs
from mvproxy.config import Config
from mvproxy.errors import MvproxyError
from mvproxy.logs import kv
from mvproxy.membership import Peer

log = logging.getLogger(__name__)

LIVE = frozenset((
    "peers", "discovery.pollInterval", "discovery.timeout", "discovery.maxDocumentBytes",
    "discovery.staleAfter", "discovery.forgetAfter", "timeouts.connect", "timeouts.request",
    "timeouts.shutdownGracePeriod", "timeouts.shutdownDelay", "logging.verbosity",
))
"""YAML paths a reload applies; any other changed path is reported and kept."""


def changed_paths(old: Any, new: Any, prefix: str = "") -> Iterator[str]:
    """YAML paths whose values differ, walking the sections of two configurations."""
    for item in dataclasses.fields(old):
        name = item.metadata.get("key", item.name)
        path = f"{prefix}{name}"
        before, after = getattr(old, item.name), getattr(new, item.name)
        if before == after:
            continue
        if path == "peers":  # the static list is live; Lease and DNS settings need a restart
            if before.static != after.static:
                yield path
            yield from (f"peers.{k}" for k in ("leases", "dns")
                        if getattr(before, k) != getattr(after, k))
            continue
        if dataclasses.is_dataclass(before):
            yield from changed_paths(before, after, path + ".")
        else:
            yield path


def merge(old: Config, new: Config) -> tuple[Config, list[str], list[str]]:
    """(the configuration to run with, live paths applied, paths kept until a restart)."""
    applied: list[str] = []
    kept: list[str] = []
    result = old
    for path in changed_paths(old, new):
        (applied if path in LIVE else kept).append(path)
    for path in applied:
        value = _get(new, path.split("."))
        if path == "peers":  # only the static list; Leases and DNS keep their settings
            value = dataclasses.replace(result.membership, static=value.static)
        result = _with(result, path.split("."), value)
    return result, applied, kept


def _attribute(section: Any, key: str) -> str:
    return next(f.name for f in dataclasses.fields(section) if f.metadata.get("key") == key)


def _get(obj: Any, keys: list[str]) -> Any:
    for key in keys:
        obj = getattr(obj, _attribute(obj, key))
    return obj


def _with(obj: Any, keys: list[str], value: Any) -> Any:
    name = _attribute(obj, keys[0])
    if len(keys) > 1:
        value = _with(getattr(obj, name), keys[1:], value)
    return dataclasses.replace(obj, **{name: value})


def reload(daemon: Any, load: Callable[[], Config]) -> bool:
    """Re-read the configuration with ``load`` and apply what can change live; False if
    the new file was refused (the daemon keeps running unchanged)."""
    try:
        new = load()
    except MvproxyError as exc:
        log.error("reload refused; keeping the running configuration",
                  extra=kv(error=str(exc)[:2000]))
        return False
    config, applied, kept = merge(daemon.config, new)
    if "peers" in applied and config.peers and daemon.peer_ssl is None:
        # Started without peer TLS material: peers cannot be added live.
        applied.remove("peers")
        kept.append("peers")
        config = dataclasses.replace(config, membership=daemon.config.membership)
    if kept:
        log.warning("reload: these settings need a restart; keeping the running values",
                    extra=kv(keys=",".join(kept)))
    if not applied:
        log.info("reload: nothing to change")
        return True
    daemon.config = config
    _apply(daemon, config)
    log.info("reload applied", extra=kv(keys=",".join(applied)))
    return True


def _apply(daemon: Any, cfg: Config) -> None:
    daemon.membership.update(Peer(p.server_id, p.url) for p in cfg.peers)
    daemon.poller.settings = dataclasses.replace(
        daemon.poller.settings, interval=cfg.discovery.poll_interval,
        timeout=cfg.discovery.timeout, max_bytes=cfg.discovery.max_document_bytes)
    daemon.cache.stale_after = cfg.discovery.stale_after
    daemon.cache.forget_after = cfg.discovery.forget_after
    for transport in (daemon.transport, daemon.poll_transport):
        transport.set_timeouts(connect=cfg.timeouts.connect, request=cfg.timeouts.request)
    daemon.proxy.discovery.live.update(cfg)
    logs.set_verbosity(cfg.logging.verbosity)
