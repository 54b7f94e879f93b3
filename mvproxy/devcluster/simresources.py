"""CRUD on every resource of the catalog, over the shared store.

One handler per kube verb, plus the ``status`` and ``scale`` subresources and the
handful of pod subresources clients touch (exec/attach are handed to ``simexec``).
Store calls run in a worker thread: SQLite may wait on another process's write lock
and the event loop must not wait with it. Errors are kube's ``Status`` objects.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from aiohttp import web

from mvproxy.requestinfo import RequestInfo

from . import apistatus, patching, simlogs, simreviews, simwatch, tables
from .catalog import Catalog
from .mediatypes import LIST_CONVERSIONS, OBJECT_CONVERSIONS, Negotiated, negotiate
from .simobjects import (
    RequestError,
    Target,
    apply_defaults,
    check_list_options,
    check_namespace,
    check_object,
    check_url_name,
    deleted_answer,
    dry_run,
    fold_string_data,
    json_response,
    name_for_create,
    present,
    present_item,
    read_body,
    resolve,
    success_status,
    too_large_resource_version,
)
from .store import AlreadyExists, Conflict, Key, NotFound, Store

_PATCHERS: dict[str, Callable[[Any, Any], Any]] = {
    "application/merge-patch+json": patching.merge_patch,
    "application/json-patch+json": patching.json_patch,
    "application/strategic-merge-patch+json": patching.strategic_merge_patch,
    "application/apply-patch+yaml": patching.strategic_merge_patch,
    "application/apply-patch+cbor": patching.strategic_merge_patch,
}
_PATCH_RETRIES = 5
_SCALE_VERSION = "autoscaling/v1"
#: How long a list asking for a resourceVersion the store has not reached yet waits for
#: it (kube's watch cache: 3 s), and how often it looks.
_FRESHNESS_WAIT = 3.0
_FRESHNESS_POLL = 0.05


class ResourceAPI:
    """The resource half of a simulated kube-apiserver."""

    def __init__(self, catalog: Catalog, store: Store, *, bookmark_interval: float = 1.0):
        self.catalog = catalog
        self.store = store
        self.bookmark_interval = bookmark_interval
        # Where this server's watch history begins (a watch from before is 410).
        self.horizon = store.current_resource_version()

    async def handle(self, request: web.Request, info: RequestInfo) -> web.StreamResponse:
        try:
            t = resolve(self.catalog, info)
            if t.sub is not None:
                return await self._subresource(request, t)
            if simreviews.is_review(t):  # questions to the authorizer: never stored
                return await simreviews.create(request, t, await read_body(request))
            handler = getattr(self, "_" + t.info.verb)
            return await handler(request, t)
        except RequestError as exc:
            return exc.response

    async def _run(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def _load(self, t: Target, name: str) -> dict:
        try:
            return await self._run(self.store.get, t.key(name))
        except NotFound:
            raise RequestError(t.error_not_found(name)) from None

    # --- reads ------------------------------------------------------------------

    def _output(self, request: web.Request, t: Target, obj: dict) -> web.Response:
        chosen = negotiate(request.headers.get("Accept"), OBJECT_CONVERSIONS)
        if chosen is None:
            return apistatus.not_acceptable()
        shown = present(t, obj)
        if chosen.kind == "Table":
            meta = {"resourceVersion": obj["metadata"].get("resourceVersion", "")}
            return json_response(_table(request, t, [shown], meta, chosen))
        if chosen.kind == "PartialObjectMetadata":
            return json_response(tables.partial_metadata(shown, chosen.version))
        return json_response(shown)

    async def _get(self, request: web.Request, t: Target) -> web.Response:
        return self._output(request, t, await self._load(t, t.path_name))

    async def _list(self, request: web.Request, t: Target) -> web.Response:
        chosen = negotiate(request.headers.get("Accept"), LIST_CONVERSIONS)
        if chosen is None:
            return apistatus.not_acceptable()
        q = request.query
        wanted = check_list_options(request, watch=False)
        if wanted and q.get("resourceVersionMatch", "NotOlderThan") == "NotOlderThan":
            current = await self._fresh_enough(wanted)
            if current < wanted:
                return too_large_resource_version(wanted, current)
        try:
            limit = max(int(q.get("limit") or 0), 0)
            items, rv, token = await self._run(
                self.store.list, t.group, t.resource, t.scope(),
                label_selector=q.get("labelSelector", ""),
                field_selector=q.get("fieldSelector", ""),
                limit=limit, continue_token=q.get("continue", ""))
        except ValueError as exc:
            return apistatus.bad_request(str(exc))
        meta = {"resourceVersion": rv, **({"continue": token} if token else {})}
        if chosen.kind == "Table":
            return json_response(_table(request, t, [present(t, o) for o in items], meta,
                                        chosen))
        shown = [present_item(t, o) for o in items]
        if chosen.kind == "PartialObjectMetadataList":
            return json_response({
                "kind": "PartialObjectMetadataList",
                "apiVersion": f"meta.k8s.io/{chosen.version}", "metadata": meta,
                "items": [tables.partial_metadata(o, chosen.version) for o in shown]})
        return json_response({"kind": t.entry.kind + "List", "apiVersion": t.api_version,
                              "metadata": meta, "items": shown})

    async def _fresh_enough(self, wanted: int) -> int:
        """The store's resourceVersion once it reaches ``wanted``, or after waiting
        ``_FRESHNESS_WAIT`` (other servers sharing the store may be about to write)."""
        deadline = asyncio.get_running_loop().time() + _FRESHNESS_WAIT
        while True:
            current = await self._run(self.store.current_resource_version)
            if current >= wanted or asyncio.get_running_loop().time() >= deadline:
                return current
            await asyncio.sleep(_FRESHNESS_POLL)

    async def _watch(self, request: web.Request, t: Target) -> web.StreamResponse:
        return await simwatch.serve(request, t, self.store, self.bookmark_interval,
                                    self.horizon)

    # --- writes -----------------------------------------------------------------

    async def _create(self, request: web.Request, t: Target) -> web.Response:
        obj = check_object(t, await read_body(request))
        return await self._create_object(request, t, obj)

    async def _create_object(self, request: web.Request, t: Target, obj: dict) -> web.Response:
        check_namespace(t, obj)
        name = name_for_create(t, obj)
        for owned in ("resourceVersion", "uid", "creationTimestamp", "generation"):
            obj["metadata"].pop(owned, None)
        apply_defaults(t, obj)
        if t.entry.namespaced:
            await self._require_namespace(t)
        if dry_run(request):
            # Filled in as a real create would, though nothing is stored.
            obj["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=_now())
            return json_response(present(t, obj), 201)
        try:
            created = await self._run(self.store.create, t.key(name), obj)
        except AlreadyExists:
            return apistatus.already_exists(t.group, t.resource, name)
        return json_response(present(t, created), 201)

    async def _require_namespace(self, t: Target) -> None:
        try:
            await self._run(self.store.get, Key("", "namespaces", "", t.namespace))
        except NotFound:
            raise RequestError(apistatus.object_not_found("", "namespaces", t.namespace)) from None

    async def _update(self, request: web.Request, t: Target) -> web.Response:
        obj = check_object(t, await read_body(request))
        check_url_name(t, obj)
        check_namespace(t, obj)
        current = await self._load(t, t.path_name)
        return await self._store_update(request, t, self._merge_main(t, current, obj))

    def _merge_main(self, t: Target, current: dict, new: dict) -> dict:
        """A write to the main resource cannot change .status where /status exists."""
        if t.entry.subresource("status") is not None:
            new = dict(new)
            if "status" in current:
                new["status"] = current["status"]
            else:
                new.pop("status", None)
        return new

    async def _store_update(self, request: web.Request, t: Target, obj: dict, *,
                            bump_generation: bool = True, show: Callable | None = None
                            ) -> web.Response:
        show = show or (lambda o: present(t, o))
        if t.group == "" and t.resource == "secrets" and t.sub is None:
            fold_string_data(obj)
        if dry_run(request):
            return json_response(show(obj))
        try:
            updated = await self._run(self.store.update, t.key(t.path_name), obj,
                                      bump_generation=bump_generation)
        except NotFound:
            return t.error_not_found(t.path_name)
        except Conflict:
            return apistatus.conflict(t.group, t.resource, t.path_name,
                                      apistatus.OBJECT_MODIFIED)
        return json_response(show(updated))

    async def _patch(self, request: web.Request, t: Target) -> web.Response:
        return await self._patch_view(request, t, _identity, self._merge_main)

    async def _patch_view(self, request: web.Request, t: Target,
                          view: Callable[[Target, dict], dict],
                          fold: Callable[[Target, dict, dict], dict], *,
                          bump_generation: bool = True, show: Callable | None = None
                          ) -> web.Response:
        """Patch ``view(object)``, fold the result back and write it; retried on races.

        As in kube, a patch that does not pin metadata.resourceVersion is re-applied to
        the fresh object when another writer got in between.
        """
        ctype = request.content_type
        patcher = _PATCHERS.get(ctype)
        if patcher is None:
            return apistatus.unsupported_patch_type()
        patch = await read_body(request)
        for _ in range(_PATCH_RETRIES):
            try:
                current = await self._run(self.store.get, t.key(t.path_name))
            except NotFound:
                if ctype.startswith("application/apply-patch") and t.sub is None:
                    return await self._create_object(request, t, check_object(t, patch))
                return t.error_not_found(t.path_name)
            try:
                patched = patcher(view(t, current), patch)
            except patching.PatchTestFailed:
                return apistatus.status_response(
                    422, "the server rejected our request due to an error in our request",
                    reason="Invalid", details={})
            except patching.PatchError as exc:
                return apistatus.status_response(422, str(exc), reason="Invalid")
            pinned = _pinned_rv(patch)
            obj = fold(t, current, self._checked_patch(t, patched, current, pinned))
            response = await self._store_update(request, t, obj,
                                                bump_generation=bump_generation, show=show)
            if response.status != 409 or pinned:
                return response
        return response

    def _checked_patch(self, t: Target, patched: Any, current: dict, pinned: bool) -> dict:
        kind = t.sub.kind if t.sub and t.sub.kind == "Scale" else None
        version = _SCALE_VERSION if kind else None
        obj = check_object(t, patched, kind=kind, api_version=version)
        check_url_name(t, obj)
        if not pinned:
            obj["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        return obj

    async def _delete(self, request: web.Request, t: Target) -> web.Response:
        options = await read_body(request) if request.can_read_body else None
        expected = _precondition_rv(options)
        if dry_run(request) or _options_dry_run(options):
            return json_response(deleted_answer(t, await self._load(t, t.path_name)))
        try:
            deleted = await self._run(self.store.delete, t.key(t.path_name),
                                      expected_resource_version=expected)
        except NotFound:
            return t.error_not_found(t.path_name)
        except Conflict as exc:
            return apistatus.precondition_conflict(t.group, t.entry.kind, t.path_name,
                                                   expected, exc.actual)
        if t.group == "" and t.resource == "namespaces":
            # Deleting a namespace deletes what is in it (kube does it asynchronously),
            # including resources only other servers sharing the store serve.
            await self._run(self.store.delete_namespace_contents, t.path_name)
            # The answer is kube's (the namespace Terminating until its controller has
            # emptied it), though here that has already happened.
            deleted = _terminating(deleted)
        return json_response(deleted_answer(t, deleted))

    async def _deletecollection(self, request: web.Request, t: Target) -> web.Response:
        q = request.query
        try:
            deleted = await self._run(
                self.store.delete_collection, t.group, t.resource, t.scope(),
                label_selector=q.get("labelSelector", ""),
                field_selector=q.get("fieldSelector", ""))
        except ValueError as exc:
            return apistatus.bad_request(str(exc))
        rv = str(await self._run(self.store.current_resource_version))
        return json_response({"kind": t.entry.kind + "List", "apiVersion": t.api_version,
                              "metadata": {"resourceVersion": rv},
                              "items": [present_item(t, o) for o in deleted]})

    # --- subresources -----------------------------------------------------------

    async def _subresource(self, request: web.Request, t: Target) -> web.StreamResponse:
        sub, verb = t.info.subresource, t.info.verb
        if sub == "status":
            return await self._status(request, t)
        if sub == "scale":
            return await self._scale(request, t)
        if sub in ("exec", "attach"):
            pod = await self._load(t, t.path_name)
            from . import simexec  # noqa: PLC0415 - optional, written separately

            return await simexec.handle_exec(request, t.info, pod)
        if sub == "portforward":
            pod = await self._load(t, t.path_name)
            from . import simportforward  # noqa: PLC0415 - like simexec

            return await simportforward.handle_portforward(request, pod)
        if sub == "log":
            if t.info.verb != "get":
                return apistatus.method_not_allowed()
            return await simlogs.handle_log(request, await self._load(t, t.path_name))
        if sub == "eviction":
            return await self._evict(request, t)
        if sub in ("ephemeralcontainers", "resize", "approval", "finalize") and verb != "create":
            return await self._generic_subresource(request, t)
        return apistatus.not_simulated(405, f"{verb} {t.entry.resource}/{sub}")

    async def _status(self, request: web.Request, t: Target) -> web.Response:
        """/status: reads the whole object, writes only .status (generation unchanged)."""
        if t.info.verb == "get":
            return await self._get(request, t)
        if t.info.verb == "patch":
            return await self._patch_view(request, t, _identity, _fold_status,
                                          bump_generation=False)
        obj = check_object(t, await read_body(request))
        check_url_name(t, obj)
        current = await self._load(t, t.path_name)
        return await self._store_update(request, t, _fold_status(t, current, obj),
                                        bump_generation=False)

    async def _scale(self, request: web.Request, t: Target) -> web.Response:
        """/scale: an autoscaling/v1 Scale view of .spec.replicas and .status.replicas."""
        show = functools.partial(_scale_view, t)
        if t.info.verb == "get":
            return json_response(show(await self._load(t, t.path_name)))
        if t.info.verb == "patch":
            return await self._patch_view(request, t, _scale_view, _fold_scale, show=show)
        scale = check_object(t, await read_body(request), kind="Scale",
                             api_version=_SCALE_VERSION)
        check_url_name(t, scale)
        current = await self._load(t, t.path_name)
        return await self._store_update(request, t, _fold_scale(t, current, scale), show=show)

    async def _generic_subresource(self, request: web.Request, t: Target) -> web.Response:
        if t.info.verb == "get":
            return await self._get(request, t)
        if t.info.verb == "patch":
            return await self._patch_view(request, t, _identity, _fold_all)
        obj = check_object(t, await read_body(request))
        check_url_name(t, obj)
        return await self._store_update(request, t, obj)

    async def _evict(self, request: web.Request, t: Target) -> web.Response:
        try:
            await self._run(self.store.delete, t.key(t.path_name))
        except NotFound:
            return t.error_not_found(t.path_name)
        return json_response(success_status(201), 201)


# --- pure helpers ---------------------------------------------------------------------


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _terminating(namespace: dict) -> dict:
    shown = copy.deepcopy(namespace)
    shown["metadata"]["deletionTimestamp"] = _now()
    shown.setdefault("status", {})["phase"] = "Terminating"
    return shown


def _identity(t: Target, obj: dict) -> dict:
    return obj


def _fold_all(t: Target, current: dict, new: dict) -> dict:
    return new


def _fold_status(t: Target, current: dict, new: dict) -> dict:
    obj = copy.deepcopy(current)
    obj["status"] = new.get("status", {})
    obj["metadata"]["resourceVersion"] = new["metadata"].get(
        "resourceVersion") or current["metadata"]["resourceVersion"]
    return obj


def _selector_string(obj: dict) -> str:
    selector = (obj.get("spec") or {}).get("selector") or {}
    labels = selector.get("matchLabels", selector) if isinstance(selector, dict) else {}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if isinstance(v, str))


def _scale_view(t: Target, obj: dict) -> dict:
    meta = obj["metadata"]
    keep = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
    spec_replicas = (obj.get("spec") or {}).get("replicas", 1)
    status = {"replicas": (obj.get("status") or {}).get("replicas", 0)}
    if selector := _selector_string(obj):
        status["selector"] = selector
    return {"kind": "Scale", "apiVersion": _SCALE_VERSION,
            "metadata": {k: meta[k] for k in keep if k in meta},
            "spec": {"replicas": spec_replicas}, "status": status}


def _fold_scale(t: Target, current: dict, scale: dict) -> dict:
    replicas = (scale.get("spec") or {}).get("replicas", 0)
    if not isinstance(replicas, int) or replicas < 0:
        raise RequestError(apistatus.invalid(
            "autoscaling", "Scale", t.path_name,
            f"spec.replicas: Invalid value: {replicas}: must be greater than or equal to 0"))
    obj = copy.deepcopy(current)
    obj.setdefault("spec", {})["replicas"] = replicas
    rv = scale["metadata"].get("resourceVersion")
    obj["metadata"]["resourceVersion"] = rv or current["metadata"]["resourceVersion"]
    return obj


def _pinned_rv(patch: Any) -> bool:
    """Whether a patch sets metadata.resourceVersion itself (then no retry on conflict)."""
    if isinstance(patch, dict):
        return bool((patch.get("metadata") or {}).get("resourceVersion"))
    if isinstance(patch, list):
        return any(isinstance(op, dict) and op.get("path") == "/metadata/resourceVersion"
                   for op in patch)
    return False


def _precondition_rv(options: Any) -> str:
    if isinstance(options, dict):
        return str((options.get("preconditions") or {}).get("resourceVersion") or "")
    return ""


def _options_dry_run(options: Any) -> bool:
    return isinstance(options, dict) and "All" in (options.get("dryRun") or [])


def _table(request: web.Request, t: Target, objects: list[dict], meta: dict,
           chosen: Negotiated) -> dict:
    include = request.query.get("includeObject") or "Metadata"
    if include not in tables.INCLUDE_OBJECT:
        raise RequestError(apistatus.bad_request(
            f'Unable to convert to Table as requested: includeObject: Invalid value: '
            f'"{include}": must be \'Metadata\', \'Object\', \'None\', or empty'))
    return tables.table(objects, list_meta=meta, include=include, version=chosen.version,
                        group=t.group, resource=t.resource)

