"""Pure renderers of the discovery documents a real kube-apiserver serves.

From a :class:`~mvproxy.devcluster.catalog.Catalog` to plain dicts: aggregated
``APIGroupDiscoveryList`` (apidiscovery v2 / v2beta1, same shape) for ``/api`` and
``/apis``, and the legacy ``APIVersions``, ``APIGroupList``, ``APIGroup`` and
``APIResourceList``. Keys come in kube-apiserver's field order and follow its
omitempty rules, so a rendering can be compared with a captured response. No I/O and
no HTTP: callers serialise and choose the Content-Type.
"""

from __future__ import annotations

from .catalog import Catalog, GroupEntry, ResourceEntry, SubresourceEntry, VersionEntry

AGGREGATED_V2 = "apidiscovery.k8s.io/v2"
AGGREGATED_V2BETA1 = "apidiscovery.k8s.io/v2beta1"
CORE = ""


def _kind(group: str, version: str, kind: str) -> dict:
    return {"group": group, "version": version, "kind": kind}


def _with_lists(doc: dict, resource: ResourceEntry) -> dict:
    # kube-apiserver omits empty shortNames/categories (omitempty).
    if resource.short_names:
        doc["shortNames"] = list(resource.short_names)
    if resource.categories:
        doc["categories"] = list(resource.categories)
    return doc


def _aggregated_subresource(sub: SubresourceEntry) -> dict:
    return {"subresource": sub.subresource,
            "responseKind": _kind(sub.group, sub.version, sub.kind),
            "verbs": list(sub.verbs)}


def _aggregated_resource(resource: ResourceEntry) -> dict:
    doc = _with_lists({
        "resource": resource.resource,
        "responseKind": _kind("", "", resource.kind),
        "scope": "Namespaced" if resource.namespaced else "Cluster",
        "singularResource": resource.singular,
        "verbs": list(resource.verbs),
    }, resource)
    if resource.subresources:
        doc["subresources"] = [_aggregated_subresource(s) for s in resource.subresources]
    return doc


def _aggregated_version(version: VersionEntry) -> dict:
    return {"version": version.version,
            "resources": [_aggregated_resource(r) for r in version.resources],
            "freshness": "Current"}


def _aggregated_group(group: GroupEntry) -> dict:
    # The core group has no name; ObjectMeta.name is omitempty, so metadata is {}.
    metadata = {"name": group.name} if group.name else {}
    return {"metadata": metadata,
            "versions": [_aggregated_version(v) for v in group.versions]}


def aggregated(catalog: Catalog, *, core: bool, api_version: str = AGGREGATED_V2) -> dict:
    """APIGroupDiscoveryList for ``/api`` (core=True: core only) or ``/apis`` (the rest)."""
    groups = [g for g in catalog.groups if (g.name == CORE) == core]
    return {"kind": "APIGroupDiscoveryList", "apiVersion": api_version,
            "metadata": {}, "items": [_aggregated_group(g) for g in groups]}


def api_versions(server_address: str) -> dict:
    """Legacy ``/api`` APIVersions; server_address is the "host:port" clients should use."""
    return {"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}]}


def group_version(group: str, version: str) -> str:
    """The apiVersion string: "v1" for core, "apps/v1" otherwise."""
    return f"{group}/{version}" if group else version


def _version_ref(group: str, version: str) -> dict:
    return {"groupVersion": group_version(group, version), "version": version}


def _group_body(group: GroupEntry) -> dict:
    return {"name": group.name,
            "versions": [_version_ref(group.name, v.version) for v in group.versions],
            "preferredVersion": _version_ref(group.name, group.versions[0].version)}


def api_group_list(catalog: Catalog) -> dict:
    """Legacy ``/apis`` APIGroupList, groups in priority order, core excluded."""
    groups = [_group_body(g) for g in catalog.groups if g.name != CORE]
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def api_group(catalog: Catalog, name: str) -> dict | None:
    """Legacy ``/apis/<name>`` APIGroup, or None when the group is not served."""
    group = catalog.group(name) if name != CORE else None
    if group is None:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group_body(group)}


def _legacy_subresource(resource: ResourceEntry, sub: SubresourceEntry) -> dict:
    doc = {"name": f"{resource.resource}/{sub.subresource}", "singularName": "",
           "namespaced": resource.namespaced}
    # group/version appear only when the kind lives elsewhere (scale → autoscaling/v1).
    if sub.group:
        doc["group"] = sub.group
    if sub.version:
        doc["version"] = sub.version
    doc.update(kind=sub.kind, verbs=list(sub.verbs))
    return doc


def _legacy_resources(resource: ResourceEntry) -> list[dict]:
    parent = _with_lists({"name": resource.resource, "singularName": resource.singular,
                          "namespaced": resource.namespaced, "kind": resource.kind,
                          "verbs": list(resource.verbs)}, resource)
    return [parent, *(_legacy_subresource(resource, s) for s in resource.subresources)]


def api_resource_list(catalog: Catalog, group: str, version: str) -> dict | None:
    """Legacy ``/api/v1`` or ``/apis/<g>/<v>`` APIResourceList, or None when not served.

    Subresources are separate entries ("pods/status"), as kube-apiserver lists them.
    Like the real server, the core list carries no apiVersion and group lists do.
    """
    entry = catalog.group_version(group, version)
    if entry is None:
        return None
    doc: dict = {"kind": "APIResourceList"}
    if group:
        doc["apiVersion"] = "v1"
    doc["groupVersion"] = group_version(group, version)
    doc["resources"] = [d for r in entry.resources for d in _legacy_resources(r)]
    return doc
