"""Parse an HTTP request line into kube-apiserver's ``RequestInfo``.

Pure and allocation-light: no I/O and no aiohttp import. It runs on every proxied
request (routing) and in the simulated API server, so both agree with
kube-apiserver on what a request *is*: group, version, resource, subresource,
namespace, name and the Kubernetes verb.

The rules follow kube-apiserver's request-info resolver (``k8s.io/apiserver``
``pkg/endpoints/request``), with the prefixes ``api`` (core group, no group
segment) and ``apis`` (named groups):

* The path is split on ``/`` after stripping every leading and trailing ``/``.
  Empty segments in the middle (``//``) are kept as empty strings, exactly as
  kube does, so ``/api/v1//pods`` has resource ``""`` and name ``pods``.
* ``/api/<v>/<rest...>`` and ``/apis/<g>/<v>/<rest...>`` with a non-empty
  ``<rest>`` are resource requests. Shorter API paths (``/api``, ``/api/v1``,
  ``/apis``, ``/apis/<g>``, ``/apis/<g>/<v>``) are discovery (non-resource)
  requests. **Deliberate difference from kube:** for those, ``api_prefix``,
  ``api_group`` and ``api_version`` are still filled as far as the path goes,
  because routing needs the group/version of ``/apis/<g>/<v>``. Kube leaves them
  empty. Every other path (``/healthz``, ``/version``, ``/openapi/v3/...``) has
  ``api_prefix == ""``.
* A legacy verb segment right after the version is taken as the verb and removed:
  ``watch`` (``/api/v1/watch/namespaces/ns/pods``) and ``proxy``. A ``proxy``
  verb never has a subresource; the remaining parts are a proxied sub-path.
  When nothing follows the verb segment (``/api/v1/watch``), kube reports an
  error. Here the result is what kube knows at that point: a resource request
  with the version filled in, the lowercased HTTP method as verb, and no
  resource. That makes routing fall through to the backend, which gives its own
  answer.
* ``namespaces/<ns>/<resource>/...`` sets the namespace and drops the first two
  parts. ``namespaces/<ns>`` itself and ``namespaces/<ns>/status|finalize`` are
  the ``namespaces`` resource: namespace and name are both ``<ns>``.
* The remaining parts are ``<resource>[/<name>[/<subresource>[/...]]]``.
* Verb from the method: POST create, GET/HEAD get, PUT update, PATCH patch,
  DELETE delete, anything else ``""``. A ``get`` without a name becomes ``list``,
  or ``watch`` if the query has ``watch`` with any value except ``0`` or
  ``false`` (case-insensitive; an empty value counts as true, as in kube). For
  that list/watch, a field selector that requires ``metadata.name`` to equal a
  valid path-segment name sets ``name``. A ``delete`` without a name becomes
  ``deletecollection``.
* Non-resource requests have the lowercased HTTP method as verb and no parts.

Inputs:

* ``path`` must already be percent-decoded (aiohttp's ``request.path``, the same
  as Go's ``URL.Path``). An encoded ``%2F`` therefore splits like a real ``/``,
  as it does in kube.
* ``query`` is either a mapping whose ``[key]``/``get(key)`` gives the *first*
  value (aiohttp's ``request.query`` or a plain ``dict``), or the raw query
  string without the ``?`` (aiohttp's ``request.query_string``). A string is
  parsed only when the answer depends on it, and the same way Go's
  ``url.ParseQuery`` parses it: pairs split on ``&``, pairs containing ``;`` or a
  bad ``%`` escape skipped, ``+`` read as a space, the first value wins. On the
  hot path, passing the string is the cheaper choice: most requests never need
  the query.

Known difference: kube drops the ``fieldSelector`` name when *any* list option
fails to decode (for example a malformed ``labelSelector`` or a non-numeric
``limit``). Here only a malformed field selector has that effect. ``name`` from a
selector is informational (authorization and audit in kube) and routing does not
use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from urllib.parse import unquote_plus

__all__ = ["RequestInfo", "is_long_running", "parse_request_info"]


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What kube-apiserver would record about a request; see the module docstring."""

    is_resource_request: bool
    #: The (decoded) path exactly as given.
    path: str
    #: Resource requests: get list watch create update patch delete deletecollection,
    #: or proxy (legacy path verb), or "" for an unknown method. Otherwise the
    #: lowercased HTTP method.
    verb: str
    #: "api", "apis", or "" for paths outside the API prefixes.
    api_prefix: str
    #: "" for the core group.
    api_group: str
    api_version: str
    namespace: str
    resource: str
    subresource: str
    name: str
    #: Resource requests: the parts from the resource onwards
    #: (``("pods", "foo", "log")``, or ``("namespaces", ns, ...)`` for the namespaces
    #: resource). Empty for non-resource requests.
    parts: tuple[str, ...]


QueryLike = Mapping[str, str] | str

_METHOD_VERBS: dict[str, str] = {
    "POST": "create",
    "GET": "get",
    "HEAD": "get",
    "PUT": "update",
    "PATCH": "patch",
    "DELETE": "delete",
}
_NAMESPACE_SUBRESOURCES = frozenset(("status", "finalize"))
_EMPTY_QUERY: Mapping[str, str] = MappingProxyType({})

# Long-running request rules (kube-apiserver's BasicLongRunningRequestCheck,
# except that logs count only when followed).
_LONG_RUNNING_VERBS = frozenset(("watch", "proxy"))
_LONG_RUNNING_SUBRESOURCES = frozenset(("attach", "exec", "log", "portforward", "proxy"))


def parse_request_info(method: str, path: str, query: QueryLike = "") -> RequestInfo:
    """Parse ``method``, the decoded ``path`` and ``query`` into a ``RequestInfo``."""
    segs = path.strip("/").split("/")
    n = len(segs)
    prefix = segs[0]

    if prefix == "api":
        if n < 3:
            return RequestInfo(
                False, path, method.lower(), "api", "", segs[1] if n == 2 else "",
                "", "", "", "", (),
            )
        group = ""
        i = 1
    elif prefix == "apis":
        if n < 4:
            return RequestInfo(
                False, path, method.lower(), "apis",
                segs[1] if n >= 2 else "", segs[2] if n == 3 else "",
                "", "", "", "", (),
            )
        group = segs[1]
        i = 2
    else:
        return RequestInfo(False, path, method.lower(), "", "", "", "", "", "", "", ())

    version = segs[i]
    i += 1
    # From here on segs[i] exists: there is at least one part after the version.

    head = segs[i]
    if head == "watch" or head == "proxy":
        if n - i < 2:
            # kube: "unable to determine kind and namespace"; report what is known.
            return RequestInfo(
                True, path, method.lower(), prefix, group, version, "", "", "", "", (),
            )
        verb = head
        i += 1
    else:
        verb = _METHOD_VERBS.get(method, "")

    namespace = ""
    if segs[i] == "namespaces" and n - i > 1:
        namespace = segs[i + 1]
        if n - i > 2 and segs[i + 2] not in _NAMESPACE_SUBRESOURCES:
            i += 2

    left = n - i
    resource = segs[i]
    name = segs[i + 1] if left >= 2 else ""
    subresource = segs[i + 2] if left >= 3 and verb != "proxy" else ""
    parts = tuple(segs[i:]) if i else tuple(segs)

    if not name:
        if verb == "get":
            q = _as_mapping(query, ("watch", "fieldSelector"))
            watch = q.get("watch")
            verb = "watch" if watch is not None and _go_bool(watch) else "list"
            selector = q.get("fieldSelector")
            if selector:
                name = _name_from_field_selector(selector)
        elif verb == "delete":
            verb = "deletecollection"

    return RequestInfo(
        True, path, verb, prefix, group, version, namespace, resource, subresource, name, parts,
    )


def is_long_running(info: RequestInfo) -> bool:
    """Whether the request may legitimately stay open indefinitely (no request timeout).

    kube-apiserver's rule (``BasicLongRunningRequestCheck`` with the sets kube-apiserver
    configures): the ``watch`` and ``proxy`` verbs; the ``attach``, ``exec``, ``log``,
    ``portforward`` and ``proxy`` subresources; and ``/debug/pprof/...``. Every ``log``
    request, not only ``follow``: a large log can take minutes to stream.
    """
    if info.verb in _LONG_RUNNING_VERBS:
        return True
    if not info.is_resource_request:
        return info.path.startswith("/debug/pprof/")
    return info.subresource in _LONG_RUNNING_SUBRESOURCES


# --- query handling ---------------------------------------------------------------


def _go_bool(value: str) -> bool:
    """apimachinery's query-string bool: false only for "0" and "false" (any case)."""
    # casefold() is closer than lower() to Go's strings.EqualFold.
    return value != "0" and value.casefold() != "false"


def _as_mapping(query: QueryLike, keys: tuple[str, ...]) -> Mapping[str, str]:
    """``query`` as a first-value mapping; a string is parsed only if it may hold ``keys``."""
    if not isinstance(query, str):
        return query
    if not query:
        return _EMPTY_QUERY
    # A key can only decode to one of ``keys`` if it spells it literally or uses %-escapes.
    if "%" not in query and not any(k in query for k in keys):
        return _EMPTY_QUERY
    return _parse_query(query)


def _parse_query(qs: str) -> dict[str, str]:
    """First value per key, with Go's ``url.ParseQuery`` rules (see the module docstring)."""
    out: dict[str, str] = {}
    for pair in qs.split("&"):
        if not pair or ";" in pair:
            continue
        raw_key, _, raw_value = pair.partition("=")
        key = _query_unescape(raw_key)
        if key is None:
            continue
        value = _query_unescape(raw_value)
        if value is None:
            continue
        if key not in out:
            out[key] = value
    return out


_HEX = frozenset("0123456789abcdefABCDEF")


def _query_unescape(s: str) -> str | None:
    """Decode one query component; ``None`` where Go would reject a ``%`` escape."""
    if "%" not in s:
        return s.replace("+", " ") if "+" in s else s
    end = len(s)
    i = s.find("%")
    while i != -1:
        if i + 2 >= end or s[i + 1] not in _HEX or s[i + 2] not in _HEX:
            return None
        i = s.find("%", i + 3)
    return unquote_plus(s)


# --- field selectors ----------------------------------------------------------------


def _name_from_field_selector(selector: str) -> str:
    """The name a field selector pins with ``metadata.name=X``/``==X``, else "".

    Mirrors apimachinery's ``fields.ParseSelector`` + ``RequiresExactMatch``: terms
    are split on unescaped commas and sorted; a term without an operator, or a value
    with an unescaped ``,``/``=`` or a bad ``\\`` escape, invalidates the whole
    selector. The first (sorted) equality term on ``metadata.name`` wins. The name is
    then dropped unless it is a valid path segment (not ``.``/``..``, no ``/`` or ``%``).
    """
    terms = selector.split(",") if "\\" not in selector else _split_escaped_terms(selector)
    if len(terms) > 1:
        terms.sort()
    found: str | None = None
    for term in terms:
        if not term:
            continue
        eq = term.find("=")
        if eq == -1:
            return ""  # no operator: the selector does not parse
        if eq > 0 and term[eq - 1] == "!":
            field, negated, raw = term[: eq - 1], True, term[eq + 1 :]
        elif term.startswith("=", eq + 1):
            field, negated, raw = term[:eq], False, term[eq + 2 :]
        else:
            field, negated, raw = term[:eq], False, term[eq + 1 :]
        value = _selector_unescape(raw)
        if value is None:
            return ""
        if found is None and not negated and field == "metadata.name":
            found = value
    if not found or found in (".", "..") or "/" in found or "%" in found:
        return ""
    return found


def _split_escaped_terms(selector: str) -> list[str]:
    """Split on commas not preceded by an escaping backslash (escapes are kept)."""
    terms: list[str] = []
    start = 0
    escaped = False
    for i, c in enumerate(selector):
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == ",":
            terms.append(selector[start:i])
            start = i + 1
    terms.append(selector[start:])
    return terms


def _selector_unescape(raw: str) -> str | None:
    """Undo ``\\\\``, ``\\,``, ``\\=``; ``None`` for any other escape or a bare ``,``/``=``."""
    if "\\" not in raw and "," not in raw and "=" not in raw:
        return raw
    out: list[str] = []
    escaped = False
    for c in raw:
        if escaped:
            if c not in "\\,=":
                return None
            out.append(c)
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == "," or c == "=":
            return None
        else:
            out.append(c)
    if escaped:
        return None
    return "".join(out)
