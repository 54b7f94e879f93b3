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
from dataclasses import dataclass, field
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
