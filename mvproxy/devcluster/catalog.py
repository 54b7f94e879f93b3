"""The Kubernetes API surface of one minor release, as a simulated server serves it.

Catalogs (``catalogs/1.NN.json``) are derived by ``scripts/gen_catalogs.py`` from real
kube-apiserver discovery documents and shipped as package data, because users do not
have the source documents. This module only reads them: no I/O beyond package data.
Order matters and is kept everywhere: groups in priority order (core first), versions
in preference order, resources as the server lists them.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from importlib import resources

_CATALOG_DIR = "catalogs"
_CATALOG_NAME = re.compile(r"(\d+)\.(\d+)\.json")
# "1.36", "v1.36", "1.36.3", "v1.36.3-rc.1+abc": only major.minor selects a catalog.
_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.\d+)?(?:[-+].*)?")


@dataclass(frozen=True)
class SubresourceEntry:
    """A subresource; group/version are "" when its kind lives in the parent's group."""

    subresource: str
    kind: str
    group: str
    version: str
    verbs: tuple[str, ...]


@dataclass(frozen=True)
class ResourceEntry:
    resource: str
    kind: str
    singular: str
    namespaced: bool
    verbs: tuple[str, ...]
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: tuple[SubresourceEntry, ...] = ()

    def subresource(self, name: str) -> SubresourceEntry | None:
        # A handful of subresources at most: a scan is cheaper than an index.
        return next((s for s in self.subresources if s.subresource == name), None)


@dataclass(frozen=True)
class VersionEntry:
    version: str
    resources: tuple[ResourceEntry, ...]
    _by_resource: dict[str, ResourceEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_resource", {r.resource: r for r in self.resources})

    def resource(self, name: str) -> ResourceEntry | None:
        return self._by_resource.get(name)


@dataclass(frozen=True)
class GroupEntry:
    """An API group ("" is core); ``versions[0]`` is the preferred version."""

    name: str
    versions: tuple[VersionEntry, ...]
    _by_version: dict[str, VersionEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_version", {v.version: v for v in self.versions})

    def version(self, name: str) -> VersionEntry | None:
        return self._by_version.get(name)


@dataclass(frozen=True)
class Catalog:
    """Everything one release's discovery shows; lookups are O(1) dict hits."""

    kubernetes_version: str
    git_version: str
    groups: tuple[GroupEntry, ...]
    _by_group: dict[str, GroupEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_group", {g.name: g for g in self.groups})

    def group(self, name: str) -> GroupEntry | None:
        return self._by_group.get(name)

    def group_version(self, group: str, version: str) -> VersionEntry | None:
        entry = self._by_group.get(group)
        return entry.version(version) if entry else None

    def resource(self, group: str, version: str, resource: str) -> ResourceEntry | None:
        entry = self.group_version(group, version)
        return entry.resource(resource) if entry else None

    def without(self, keys: Iterable[str]) -> Catalog:
        """This catalog minus what ``keys`` name (``--runtime-config`` keys set to false).

        ``group/version`` (core: ``v1`` or ``api/v1``) removes a whole group/version (and
        the group once it has no version left); the sim-only extension
        ``group/version/resource/subresource`` (core: ``v1/pods/exec`` or
        ``/v1/pods/exec``) removes one subresource. ValueError names a malformed key or
        one that names nothing in this catalog, so a typo never goes unnoticed.
        """
        drop_gv: set[tuple[str, str]] = set()
        drop_sub: set[tuple[str, str, str, str]] = set()
        for key in keys:
            parsed = _runtime_key(key)
            if len(parsed) == 2:
                if self.group_version(*parsed) is None:
                    raise ValueError(f"runtime-config key {key!r}: no group/version "
                                     f"{_gv(*parsed)} in Kubernetes {self.kubernetes_version}")
                drop_gv.add(parsed)
            else:
                group, version, resource, sub = parsed
                entry = self.resource(group, version, resource)
                if entry is None or entry.subresource(sub) is None:
                    raise ValueError(f"runtime-config key {key!r}: no subresource "
                                     f"{resource}/{sub} in {_gv(group, version)} of "
                                     f"Kubernetes {self.kubernetes_version}")
                drop_sub.add(parsed)
        groups = []
        for g in self.groups:
            versions = []
            for v in g.versions:
                if (g.name, v.version) in drop_gv:
                    continue
                resources = tuple(
                    replace(r, subresources=tuple(
                        s for s in r.subresources
                        if (g.name, v.version, r.resource, s.subresource) not in drop_sub))
                    for r in v.resources)
                versions.append(VersionEntry(v.version, resources))
            if versions:
                groups.append(GroupEntry(g.name, tuple(versions)))
        return Catalog(self.kubernetes_version, self.git_version, tuple(groups))


_CORE_PREFIXES = ("", "api")


def _gv(group: str, version: str) -> str:
    return f"{group}/{version}" if group else version


def _runtime_key(key: str) -> tuple[str, str] | tuple[str, str, str, str]:
    """``(group, version)`` or ``(group, version, resource, subresource)``; "" is core."""
    parts = key.strip().removeprefix("/").split("/")
    if any(not p for p in parts):
        raise ValueError(f"runtime-config key {key!r}: empty segment")
    if len(parts) == 1:  # "v1": the core group/version
        return ("", parts[0])
    if len(parts) == 2:
        return ("" if parts[0] in _CORE_PREFIXES else parts[0], parts[1])
    if len(parts) == 3:  # "v1/pods/exec": a core subresource
        return ("", parts[0], parts[1], parts[2])
    if len(parts) == 4:
        return (parts[0], parts[1], parts[2], parts[3])
    raise ValueError(f"runtime-config key {key!r}: expected group/version or "
                     f"group/version/resource/subresource")


def disabled_keys(runtime_config: str | None) -> list[str]:
    """The keys a ``--runtime-config`` value (``KEY=false,KEY2=false``) turns off.

    ``KEY`` or ``KEY=true`` asks for something a catalog already serves and is accepted
    as a no-op; any other value is a ValueError.
    """
    disabled = []
    for item in (runtime_config or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        value = value.strip().lower() if sep else "true"
        if value not in ("true", "false"):
            raise ValueError(f"runtime-config {item.strip()!r}: value must be true or false")
        _runtime_key(key)  # malformed keys fail even when set to true
        if value == "false":
            disabled.append(key.strip())
    return disabled


def _catalog_files() -> resources.abc.Traversable:
    return resources.files(__package__).joinpath(_CATALOG_DIR)


@functools.lru_cache(maxsize=1)
def _available() -> tuple[str, ...]:
    found = (_CATALOG_NAME.fullmatch(p.name) for p in _catalog_files().iterdir())
    keys = sorted((int(m[1]), int(m[2])) for m in found if m)
    return tuple(f"{major}.{minor}" for major, minor in keys)


def available_versions() -> list[str]:
    """Minor releases with a catalog, oldest first ("1.31" .. "1.37")."""
    return list(_available())


def _minor(version: str) -> str:
    match = _VERSION.fullmatch(version.strip())
    key = f"{int(match[1])}.{int(match[2])}" if match else None
    if key not in _available():
        raise ValueError(
            f"no catalog for Kubernetes version {version!r}; "
            f"available: {', '.join(_available())}"
        )
    return key


def _subresource(raw: dict) -> SubresourceEntry:
    return SubresourceEntry(raw["subresource"], raw["kind"], raw.get("group", ""),
                            raw.get("version", ""), tuple(raw["verbs"]))


def _resource(raw: dict) -> ResourceEntry:
    return ResourceEntry(
        resource=raw["resource"], kind=raw["kind"], singular=raw["singularResource"],
        namespaced=raw["scope"] == "Namespaced", verbs=tuple(raw["verbs"]),
        short_names=tuple(raw.get("shortNames", ())),
        categories=tuple(raw.get("categories", ())),
        subresources=tuple(_subresource(s) for s in raw.get("subresources", ())),
    )


def _group(raw: dict) -> GroupEntry:
    versions = tuple(
        VersionEntry(v["version"], tuple(_resource(r) for r in v["resources"]))
        for v in raw["versions"]
    )
    return GroupEntry(raw["name"], versions)


@functools.lru_cache(maxsize=None)
def _load(minor: str) -> Catalog:
    raw = json.loads(_catalog_files().joinpath(f"{minor}.json").read_text("utf-8"))
    groups = tuple(_group(g) for g in raw["groups"])
    return Catalog(raw["kubernetesVersion"], raw["gitVersion"], groups)


def load_catalog(version: str) -> Catalog:
    """The catalog for a release ("1.36", "v1.36" or "1.36.3"); ValueError if unknown."""
    return _load(_minor(version))
