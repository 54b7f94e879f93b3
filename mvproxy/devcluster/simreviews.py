"""Access and identity reviews: ``kubectl auth can-i`` and ``kubectl auth whoami``.

``SelfSubjectAccessReview``, ``SelfSubjectRulesReview``, ``SubjectAccessReview``,
``LocalSubjectAccessReview`` and ``SelfSubjectReview`` are questions, not objects: kube
answers them from its authorizer (or authenticator) and stores nothing, so they need
no name (kubectl 1.20 sends none). The answers come from ``simauth``'s policy, the
same one that decides the simulator's real requests, so "can-i" never disagrees with
what the user then meets.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from mvproxy.requestinfo import RequestInfo

from . import apistatus
from .simauth import USER, UserInfo, allowed_by, rules_for
from .simobjects import RequestError, Target, check_object, json_response, present

AUTHORIZATION = "authorization.k8s.io"
AUTHENTICATION = "authentication.k8s.io"
_ACCESS = frozenset(("selfsubjectaccessreviews", "subjectaccessreviews",
                     "localsubjectaccessreviews"))
#: Without an authenticator (in-process tests) the sim allows everything.
_NO_AUTHORIZER = "the simulator runs without an authorizer: everything is allowed"


def is_review(t: Target) -> bool:
    """Whether the URL names one of the review kinds (create is their only verb)."""
    return (t.group == AUTHORIZATION and (t.resource in _ACCESS
                                          or t.resource == "selfsubjectrulesreviews")) or (
        t.group == AUTHENTICATION and t.resource == "selfsubjectreviews")


def _object(value: Any, where: str, t: Target, kind: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(apistatus.invalid(t.group, kind, "",
                                             f"{where}: Invalid value: must be an object"))
    return value


def _str(attrs: dict, key: str) -> str:
    value = attrs.get(key)
    return value if isinstance(value, str) else ""


def _request_info(spec: dict, t: Target, kind: str) -> RequestInfo:
    """The spec's resource or non-resource attributes as the authorizer reads a request."""
    resource = spec.get("resourceAttributes")
    non_resource = spec.get("nonResourceAttributes")
    if (resource is None) == (non_resource is None):
        raise RequestError(apistatus.invalid(
            t.group, kind, "", "spec.resourceAttributes: Invalid value: "
            "exactly one of nonResourceAttributes or resourceAttributes must be specified"))
    if non_resource is not None:
        attrs = _object(non_resource, "spec.nonResourceAttributes", t, kind)
        return RequestInfo(False, _str(attrs, "path"), _str(attrs, "verb"), "", "", "",
                           "", "", "", "", ())
    attrs = _object(resource, "spec.resourceAttributes", t, kind)
    return RequestInfo(True, "", _str(attrs, "verb"), "", _str(attrs, "group"),
                       _str(attrs, "version"), _str(attrs, "namespace"),
                       _str(attrs, "resource"), _str(attrs, "subresource"),
                       _str(attrs, "name"), ())


def _subject(spec: dict, t: Target, kind: str) -> UserInfo:
    """SubjectAccessReview's user: exactly what the spec says (no implied groups)."""
    user, groups = _str(spec, "user"), spec.get("groups") or []
    extra = spec.get("extra") or {}
    ok = (isinstance(groups, list) and all(isinstance(g, str) for g in groups)
          and isinstance(extra, dict) and all(
              isinstance(v, list) and all(isinstance(i, str) for i in v)
              for v in extra.values()))
    if not ok:
        raise RequestError(apistatus.invalid(
            t.group, kind, "", "spec: Invalid value: groups must be a list of "
            "strings and extra a map of string to list of strings"))
    if not user and not groups:
        raise RequestError(apistatus.invalid(
            t.group, kind, "", 'spec.user: Invalid value: "": at least one of '
            "user or group must be specified"))
    return UserInfo(user, _str(spec, "uid"), tuple(groups), extra)


def _decision(user: UserInfo | None, info: RequestInfo) -> dict:
    if user is None:
        return {"allowed": True, "reason": _NO_AUTHORIZER}
    reason = allowed_by(user, info, info.verb)
    return {"allowed": True, "reason": reason} if reason else {"allowed": False}


def _user_info(user: UserInfo | None) -> dict:
    if user is None:
        return {"username": "system:anonymous", "groups": ["system:unauthenticated"]}
    shown: dict[str, Any] = {"username": user.name}
    if user.uid:
        shown["uid"] = user.uid
    if user.groups:
        shown["groups"] = list(user.groups)
    if user.extra:
        shown["extra"] = {k: list(v) for k, v in user.extra.items()}
    return shown


async def create(request: web.Request, t: Target, body: object) -> web.Response:
    """201 with the review's status filled in; nothing is stored."""
    kind = t.entry.kind
    review = check_object(t, body)
    user = request.get(USER)
    if t.resource == "selfsubjectreviews":
        review.pop("spec", None)
        review["status"] = {"userInfo": _user_info(user)}
        return json_response(present(t, review), 201)
    spec = _object(review.get("spec"), "spec", t, kind)
    review["spec"] = spec
    if t.resource == "selfsubjectrulesreviews":
        namespace = _str(spec, "namespace")
        if user is None:
            resource, non_resource = rules_for(UserInfo("", groups=("system:masters",)),
                                               namespace)
        else:
            resource, non_resource = rules_for(user, namespace)
        review["status"] = {"resourceRules": resource, "nonResourceRules": non_resource,
                            "incomplete": False}
        return json_response(present(t, review), 201)
    info = _request_info(spec, t, kind)
    if t.resource == "localsubjectaccessreviews":
        _check_local(spec, t, kind)
        info = _request_info(spec, t, kind)
    if t.resource != "selfsubjectaccessreviews":
        user = _subject(spec, t, kind)
    review["status"] = _decision(user, info)
    return json_response(present(t, review), 201)


def _check_local(spec: dict, t: Target, kind: str) -> None:
    """A LocalSubjectAccessReview asks about resources in its own namespace only."""
    if spec.get("nonResourceAttributes") is not None:
        raise RequestError(apistatus.invalid(
            t.group, kind, "", "spec.nonResourceAttributes: Invalid value: "
            "disallowed on this kind of request"))
    attrs = spec["resourceAttributes"]
    namespace = _str(attrs, "namespace")
    if not namespace:
        attrs["namespace"] = t.namespace
    elif namespace != t.namespace:
        raise RequestError(apistatus.bad_request(
            f"spec.resourceAttributes.namespace must match namespace: {t.namespace}"))
