"""SIGHUP: apply a re-read configuration to a running daemon, where that is safe.

Live: the static peer list, discovery polling (interval, timeout, document limit,
staleAfter, forgetAfter), upstream timeouts, the shutdown settings and the log
verbosity. Everything else (listening addresses, certificates' paths, identity
settings, limits, workers, log format) needs a restart: a reload names each such
key, keeps the running value, and applies the rest. A file that does not validate
changes nothing. The daemon is reached only through ``Reloadable``: one setter per
section a reload may change, so mypy checks that a reload touches nothing else.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from mvproxy.config import Config, DiscoveryConfig, StaticPeer, TimeoutsConfig
from mvproxy.errors import MvproxyError
from mvproxy.logs import kv

log = logging.getLogger(__name__)

LIVE = frozenset((
    "peers", "discovery.pollInterval", "discovery.timeout", "discovery.maxDocumentBytes",
    "discovery.staleAfter", "discovery.forgetAfter", "timeouts.connect", "timeouts.request",
    "timeouts.shutdownGracePeriod", "timeouts.shutdownDelay", "logging.verbosity",
))
"""YAML paths a reload applies; any other changed path is reported and kept."""


class Reloadable(Protocol):
    """What a reload may change in a running daemon (``app.Daemon``), and nothing else.
    Each setter also records its section in ``config``, so that the running
    configuration always says what runs."""

    @property
    def config(self) -> Config:
        """The configuration running now."""

    @property
    def peers_reachable(self) -> bool:
        """Started with peer TLS material: only then can static peers be added live."""

    def set_peers(self, peers: Sequence[StaticPeer]) -> None:
        """The static peer list (Lease and DNS membership keep their settings)."""

    def set_discovery(self, discovery: DiscoveryConfig) -> None:
        """Polling (interval, timeout, document limit), ``staleAfter``, ``forgetAfter``
        and the ``Retry-After`` that follows the interval."""

    def set_timeouts(self, timeouts: TimeoutsConfig) -> None:
        """Upstream connect and request timeouts; the shutdown grace period and delay."""

    def set_verbosity(self, verbosity: int) -> None:
        """The log verbosity."""


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


def reload(daemon: Reloadable, load: Callable[[], Config]) -> bool:
    """Re-read the configuration with ``load`` and apply what can change live; False if
    the new file was refused (the daemon keeps running unchanged)."""
    try:
        new = load()
    except MvproxyError as exc:
        log.error("reload refused; keeping the running configuration",
                  extra=kv(error=str(exc)[:2000]))
        return False
    config, applied, kept = merge(daemon.config, new)
    if "peers" in applied and config.peers and not daemon.peers_reachable:
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
    _apply(daemon, config, {path.split(".")[0] for path in applied})
    log.info("reload applied", extra=kv(keys=",".join(applied)))
    return True


def _apply(daemon: Reloadable, cfg: Config, sections: set[str]) -> None:
    """Call the setter of each section with an applied path, and only those."""
    if "peers" in sections:
        daemon.set_peers(cfg.peers)
    if "discovery" in sections:
        daemon.set_discovery(cfg.discovery)
    if "timeouts" in sections:
        daemon.set_timeouts(cfg.timeouts)
    if "logging" in sections:
        daemon.set_verbosity(cfg.logging.verbosity)
