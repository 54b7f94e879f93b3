"""Authentication, authorization, impersonation and audit for the simulated API server.

The simulated kube-apiserver must treat mvproxy exactly as a real one would, so the
identity rules here follow kube-apiserver's, in its order:

* authentication is a union (requestheader, then client certificate, then static
  bearer token): the first method that yields a user wins; if none does but one of
  them rejected a presented credential, the request is 401 (a bad token is never
  treated as anonymous); with no credential at all the request is anonymous;
* a request without credentials is ``system:anonymous`` (kube-apiserver's default
  ``--anonymous-auth=true``), which may only read the public health/version endpoints
  (``system:public-info-viewer``): everything else is 403 Forbidden, as RBAC answers;
* impersonation, then authorization (a tiny fixed policy standing in for RBAC);
* one audit event per request at the ``Metadata`` level, in kube's JSON shape.

Tokens and bodies are never logged or audited.
"""

from __future__ import annotations

import csv
import hashlib
import io
import ipaddress
import json
import os
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any
from urllib.parse import unquote

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from mvproxy.devcluster.apistatus import status_response
from mvproxy.errors import ConfigError, Problem, UsageError
from mvproxy.requestinfo import RequestInfo, parse_request_info
from mvproxy.tls import issued_by_any, load_ca_bundle, subject_identity

__all__ = [
    "ANONYMOUS",
    "AUDIT_ID",
    "REQUEST_INFO",
    "USER",
    "AuditLog",
    "Authenticator",
    "UserInfo",
    "audit_id_on_prepare",
    "auth_middleware",
]

StrPath = str | os.PathLike[str]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

AUTHENTICATED = "system:authenticated"
UNAUTHENTICATED = "system:unauthenticated"
MASTERS = "system:masters"
VIEWER = "viewer"
PEER_PROXIED_HEADER = "x-kubernetes-peer-proxied"

#: Readable by anyone, even anonymously (kube's system:public-info-viewer).
PUBLIC_PATHS = frozenset(("/healthz", "/livez", "/readyz", "/version", "/version/"))
#: Readable by every authenticated user (system:discovery + system:public-info-viewer);
#: a trailing ``*`` is a prefix match, as in RBAC nonResourceURLs.
DISCOVERY_PATHS = ("/api", "/api/*", "/apis", "/apis/*", "/openapi", "/openapi/*",
                   *sorted(PUBLIC_PATHS))
_READ_VERBS = frozenset(("get", "list", "watch"))
#: mvproxy's own identity for Lease membership (``mvproxy.kubeclient``) and what the
#: docs/membership.md's Role grants it: Leases in kube-system, nothing else (a stand-in for RBAC).
CREDENTIAL_ID = "authentication.kubernetes.io/credential-id"
MVPROXY_GROUP = "system:mvproxies"
MVPROXY_LEASE_NAMESPACE = "kube-system"
_LEASE_VERBS = frozenset(("get", "list", "watch", "create", "update", "delete"))
#: Upgrading GETs that start a session; kube also requires ``create`` for them.
_SESSION_SUBRESOURCES = frozenset(("exec", "attach", "portforward"))


def _freeze_extra(extra: Mapping[str, Iterable[str]]) -> Mapping[str, tuple[str, ...]]:
    return MappingProxyType({k: tuple(v) for k, v in extra.items()})


@dataclass(frozen=True)
class UserInfo:
    """Who a request acts as (kube's ``user.Info``)."""

    name: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "extra", _freeze_extra(self.extra))

    def with_group(self, group: str) -> UserInfo:
        """A copy that is also a member of ``group`` (added once, at the end)."""
        if group in self.groups:
            return self
        return UserInfo(self.name, self.uid, (*self.groups, group), self.extra)


#: kube-apiserver's refusals (authorization, impersonation) carry this header.
NOSNIFF = {"X-Content-Type-Options": "nosniff"}

ANONYMOUS = UserInfo("system:anonymous", groups=(UNAUTHENTICATED,))

# Request storage keys (aiohttp 3.14 warns on plain string keys). The server core's
# request-info middleware should set REQUEST_INFO; the string "request_info" is read too.
REQUEST_INFO = web.RequestKey("request_info", RequestInfo)
#: The effective user (after impersonation).
USER = web.RequestKey("user", UserInfo)
AUDIT_ID = web.RequestKey("audit_id", str)


class _Rejected:
    """A credential was presented and is invalid (kube: an authenticator error)."""


REJECTED = _Rejected()
_Result = UserInfo | _Rejected | None


# --------------------------------------------------------------------------- loading


def load_token_file(path: StrPath) -> dict[str, UserInfo]:
    """Parse a ``--token-auth-file`` CSV: ``token,user,uid[,"group1,group2"]``.

    Like kube-apiserver, a line with fewer than three columns is fatal, a line with an
    empty token is skipped, a later duplicate wins, and blank lines are ignored.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(str(path), [Problem(str(path), f"cannot read token file: {e}")]) from e
    tokens: dict[str, UserInfo] = {}
    reader = csv.reader(io.StringIO(text), skipinitialspace=True, strict=True)
    try:
        for record in reader:
            if not record:
                continue
            if len(record) < 3:
                where = f"{path}:{reader.line_num}"
                raise ConfigError(str(path), [Problem(
                    where, f"token file lines must have at least 3 columns "
                           f"(token, user name, user uid), found {len(record)}")])
            if record[0]:
                groups = tuple(record[3].split(",")) if len(record) > 3 else ()
                tokens[record[0]] = UserInfo(record[1], record[2], groups)
    except csv.Error as e:
        raise ConfigError(str(path), [Problem(f"{path}:{reader.line_num}", f"bad CSV: {e}")]) from e
    return tokens


# --------------------------------------------------------------------------- authentication


def _identity(cert: x509.Certificate) -> tuple[str, tuple[str, ...]]:
    """(CN, organisations): the user name and groups a certificate asserts."""
    return subject_identity(cert.public_bytes(Encoding.DER))


def _peer_certificate(request: web.Request) -> x509.Certificate | None:
    transport = request.transport
    ssl_object = transport.get_extra_info("ssl_object") if transport else None
    der = ssl_object.getpeercert(binary_form=True) if ssl_object else None
    if not der:
        return None
    try:
        return x509.load_der_x509_certificate(der)
    except ValueError:
        return None


def _prefixed_headers(request: web.Request, prefix: str) -> dict[str, tuple[str, ...]]:
    """``<prefix><key>: v`` headers as {key: (v...)}; key lowercased, then %-decoded (kube)."""
    out: dict[str, list[str]] = {}
    n = len(prefix)
    for name, value in request.headers.items():
        if len(name) > n and name[:n].lower() == prefix.lower():
            out.setdefault(unquote(name[n:].lower()), []).append(value)
    return {key: tuple(values) for key, values in out.items()}


def _header_values(request: web.Request, name: str) -> tuple[str, ...]:
    return tuple(v for v in request.headers.getall(name, ()) if v)


@dataclass(frozen=True)
class Authenticator:
    """kube-apiserver's union authenticator, reduced to the three methods the sim needs."""

    cluster_cas: tuple[x509.Certificate, ...]
    front_proxy_cas: tuple[x509.Certificate, ...]
    tokens: Mapping[str, UserInfo] = field(default_factory=dict, hash=False)
    #: CNs allowed to assert X-Remote-*; empty means any front-proxy-CA certificate (kube).
    requestheader_allowed_names: tuple[str, ...] = ("front-proxy-client",)

    @classmethod
    def from_files(cls, ca_file: StrPath, front_proxy_ca_file: StrPath,
                   token_file: StrPath | None = None,
                   requestheader_allowed_names: Sequence[str] = ("front-proxy-client",),
                   ) -> Authenticator:
        """Load the CAs (and static tokens); every problem is a clear startup error."""
        return cls(
            load_ca_bundle(ca_file, "client CA file"),
            load_ca_bundle(front_proxy_ca_file, "requestheader client CA file"),
            MappingProxyType(load_token_file(token_file) if token_file else {}),
            tuple(requestheader_allowed_names),
        )

    def authenticate_detail(self, request: web.Request) -> tuple[UserInfo | None, bool]:
        """(user or None, whether a presented credential was rejected)."""
        cert = _peer_certificate(request)
        rejected = False
        for method in (self._requestheader, self._client_cert, self._bearer_token):
            result = method(request, cert)
            if isinstance(result, UserInfo):
                return result.with_group(AUTHENTICATED), False
            rejected = rejected or result is REJECTED
        return None, rejected

    def _requestheader(self, request: web.Request, cert: x509.Certificate | None) -> _Result:
        """X-Remote-* from an allowed front-proxy client; kube errors on any other cert."""
        if cert is None:
            return None
        if not issued_by_any(cert, self.front_proxy_cas):
            return REJECTED
        allowed = self.requestheader_allowed_names
        if allowed and _identity(cert)[0] not in allowed:
            return REJECTED
        name = request.headers.get("X-Remote-User", "")
        if not name:
            return None
        groups = _header_values(request, "X-Remote-Group")
        return UserInfo(name, "", groups, _prefixed_headers(request, "X-Remote-Extra-"))

    def _client_cert(self, request: web.Request, cert: x509.Certificate | None) -> _Result:
        """CN is the user, O the groups, and the certificate's fingerprint the extra
        authentication.kubernetes.io/credential-id (kube's x509 authenticator, 1.33+)."""
        if cert is None:
            return None
        if not issued_by_any(cert, self.cluster_cas):
            return REJECTED
        cn, orgs = _identity(cert)
        if not cn:
            return None
        fingerprint = hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()
        return UserInfo(cn, groups=orgs, extra={CREDENTIAL_ID: (f"X509SHA256={fingerprint}",)})

    def _bearer_token(self, request: web.Request, cert: x509.Certificate | None) -> _Result:
        parts = request.headers.get("Authorization", "").split(" ", 2)
        if len(parts) < 2 or parts[0].lower() != "bearer" or not parts[1]:
            return None
        return self.tokens.get(parts[1], REJECTED)

    # ----------------------------------------------------------------------- authorization

    def authorize(self, user: UserInfo, info: RequestInfo) -> tuple[bool, str]:
        """(allowed, kube's forbidden message when not): a fixed stand-in for RBAC."""
        verb = _authz_verb(info)
        if _allowed(user, info, verb):
            return True, ""
        return False, forbidden_message(user, info, verb)


def _authz_verb(info: RequestInfo) -> str:
    """WebSocket exec/attach/portforward arrive as GET; kube also demands ``create``."""
    if info.is_resource_request and info.subresource in _SESSION_SUBRESOURCES \
            and info.verb == "get":
        return "create"
    return info.verb


def _path_matches(path: str, patterns: Iterable[str]) -> bool:
    return any(path.startswith(p[:-1]) if p.endswith("*") else path == p for p in patterns)


def _allowed(user: UserInfo, info: RequestInfo, verb: str) -> bool:
    return bool(allowed_by(user, info, verb))


def _binding(kind: str, name: str, role: str, group: str) -> str:
    """kube RBAC's reason for an allowed request."""
    role_kind = "ClusterRole" if kind == "ClusterRoleBinding" else "Role"
    return f'RBAC: allowed by {kind} "{name}" of {role_kind} "{role}" to Group "{group}"'


def _self_review(info: RequestInfo, verb: str) -> bool:
    """system:basic-user: any authenticated user may ask what it may do and who it is."""
    return verb == "create" and not info.subresource and (
        info.api_group, info.resource) in SELF_REVIEWS


#: (group, resource) of the reviews system:basic-user lets every authenticated user create.
SELF_REVIEWS = frozenset((("authorization.k8s.io", "selfsubjectaccessreviews"),
                          ("authorization.k8s.io", "selfsubjectrulesreviews"),
                          ("authentication.k8s.io", "selfsubjectreviews")))


def allowed_by(user: UserInfo, info: RequestInfo, verb: str) -> str:
    """The RBAC-style reason the sim's fixed policy allows this, or "" when it does not.

    The one policy behind both real requests and the access reviews.
    """
    groups = user.groups
    if MASTERS in groups:
        return _binding("ClusterRoleBinding", "cluster-admin", "cluster-admin", MASTERS)
    if info.is_resource_request:
        if MVPROXY_GROUP in groups and _mvproxy_lease_rule(info, verb):
            return _binding("RoleBinding", f"mvproxy/{MVPROXY_LEASE_NAMESPACE}", "mvproxy",
                            MVPROXY_GROUP)
        if VIEWER in groups and verb in _READ_VERBS:
            return _binding("ClusterRoleBinding", VIEWER, "view", VIEWER)
        if AUTHENTICATED in groups and _self_review(info, verb):
            return _binding("ClusterRoleBinding", "system:basic-user", "system:basic-user",
                            AUTHENTICATED)
        return ""
    if verb != "get":
        return ""
    if VIEWER in groups:
        return _binding("ClusterRoleBinding", VIEWER, "view", VIEWER)
    if AUTHENTICATED in groups and _path_matches(info.path, DISCOVERY_PATHS):
        return _binding("ClusterRoleBinding", "system:discovery", "system:discovery",
                        AUTHENTICATED)
    if info.path in PUBLIC_PATHS:
        group = AUTHENTICATED if AUTHENTICATED in groups else UNAUTHENTICATED
        return _binding("ClusterRoleBinding", "system:public-info-viewer",
                        "system:public-info-viewer", group)
    return ""


def rules_for(user: UserInfo, namespace: str) -> tuple[list[dict], list[dict]]:
    """(resourceRules, nonResourceRules) of the fixed policy, as SelfSubjectRulesReview."""
    groups = user.groups
    if MASTERS in groups:
        return ([{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}],
                [{"verbs": ["*"], "nonResourceURLs": ["*"]}])
    resource: list[dict] = []
    non_resource: list[dict] = []
    if AUTHENTICATED in groups:
        for group in sorted({g for g, _ in SELF_REVIEWS}):
            resource.append({"verbs": ["create"], "apiGroups": [group],
                             "resources": sorted(r for g, r in SELF_REVIEWS if g == group)})
        non_resource.append({"verbs": ["get"], "nonResourceURLs": list(DISCOVERY_PATHS)})
    else:
        non_resource.append({"verbs": ["get"], "nonResourceURLs": sorted(PUBLIC_PATHS)})
    if VIEWER in groups:
        resource.append({"verbs": sorted(_READ_VERBS), "apiGroups": ["*"], "resources": ["*"]})
        non_resource.append({"verbs": ["get"], "nonResourceURLs": ["*"]})
    if MVPROXY_GROUP in groups and namespace == MVPROXY_LEASE_NAMESPACE:
        resource.append({"verbs": sorted(_LEASE_VERBS), "apiGroups": ["coordination.k8s.io"],
                         "resources": ["leases"]})
    return resource, non_resource


def _mvproxy_lease_rule(info: RequestInfo, verb: str) -> bool:
    return (info.api_group == "coordination.k8s.io" and info.resource == "leases"
            and not info.subresource and info.namespace == MVPROXY_LEASE_NAMESPACE
            and verb in _LEASE_VERBS)


def _qualified(info: RequestInfo) -> str:
    return f"{info.resource}.{info.api_group}" if info.api_group else info.resource


def forbidden_message(user: UserInfo, info: RequestInfo, verb: str) -> str:
    """kube's wording, e.g. ``pods is forbidden: User "bob" cannot create resource ...``."""
    if not info.is_resource_request:
        return f'forbidden: User "{user.name}" cannot {verb} path "{info.path}"'
    resource = f"{info.resource}/{info.subresource}" if info.subresource else info.resource
    scope = (f'in the namespace "{info.namespace}"' if info.namespace
             else "at the cluster scope")
    why = (f'User "{user.name}" cannot {verb} resource "{resource}" '
           f'in API group "{info.api_group}" {scope}')
    subject = f'{_qualified(info)} "{info.name}"' if info.name else _qualified(info)
    return f"{subject} is forbidden: {why}"


def _forbidden(user: UserInfo, info: RequestInfo, message: str) -> web.Response:
    details: dict[str, str] = {}  # a path's refusal carries an empty one, as kube's
    if info.is_resource_request:
        details = {"name": info.name, "group": info.api_group, "kind": info.resource}
        details = {k: v for k, v in details.items() if v}
    return status_response(403, message, details=details, headers=NOSNIFF)


# --------------------------------------------------------------------------- impersonation


def _impersonation(request: web.Request, user: UserInfo) -> UserInfo | web.Response | None:
    """The impersonated user, an error response, or None when not impersonating."""
    name = request.headers.get("Impersonate-User", "")
    groups = _header_values(request, "Impersonate-Group")
    uid = request.headers.get("Impersonate-Uid", "")
    extra = _prefixed_headers(request, "Impersonate-Extra-")
    if not (name or groups or uid or extra):
        return None
    if not name:
        return status_response(400, "requested impersonation of groups, uid or extra "
                                    "without impersonating a user")
    if MASTERS not in user.groups:
        msg = (f'users "{name}" is forbidden: User "{user.name}" cannot impersonate '
               f'resource "users" in API group "" at the cluster scope')
        return status_response(403, msg, details={"name": name, "kind": "users"},
                               headers=NOSNIFF)
    target = UserInfo(name, uid, groups, extra)
    return target.with_group(UNAUTHENTICATED if name == ANONYMOUS.name else AUTHENTICATED)


# --------------------------------------------------------------------------- audit


def _timestamp(moment: datetime) -> str:
    """kube's MicroTime: RFC 3339, UTC, microseconds."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _audit_user(user: UserInfo | None) -> dict[str, Any]:
    if user is None:
        return {}
    out: dict[str, Any] = {"username": user.name}
    if user.uid:
        out["uid"] = user.uid
    out["groups"] = list(user.groups)
    if user.extra:
        out["extra"] = {k: list(v) for k, v in user.extra.items()}
    return out


def _object_ref(info: RequestInfo) -> dict[str, str] | None:
    if not info.is_resource_request:
        return None
    ref = {"resource": info.resource, "namespace": info.namespace, "name": info.name,
           "apiGroup": info.api_group, "apiVersion": info.api_version,
           "subresource": info.subresource}
    return {k: v for k, v in ref.items() if v}  # omitempty, as kube


def parse_ip(text: str) -> str | None:
    """An address as Go's ``netutils.ParseIPSloppy`` reads it and ``net.IP.String``
    prints it (IPv4 octets may have leading zeros, IPv4-mapped IPv6 prints as IPv4,
    zones are refused), or None."""
    if "%" in text:
        return None
    parts = text.split(".")
    if len(parts) == 4 and all(p.isdigit() and p.isascii() and len(p) <= 3 for p in parts):
        text = ".".join(str(int(p)) for p in parts)  # ParseIPSloppy: 010 is ten
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def source_ips(forwarded_for: str, real_ip: str, remote: str) -> list[str]:
    """kube's ``SourceIPs`` (apimachinery/pkg/util/net/http.go): every valid address
    in the first ``X-Forwarded-For`` field, then ``X-Real-Ip`` unless already listed,
    then the connection's address unless it is the last one listed."""
    ips = [ip for ip in map(parse_ip, (p.strip() for p in forwarded_for.split(","))) if ip]
    real = parse_ip(real_ip) if real_ip else None
    if real and real not in ips:
        ips.append(real)
    address = parse_ip(remote)
    if address and (not ips or ips[-1] != address):
        ips.append(address)
    return ips


def _source_ips(request: web.Request) -> list[str]:
    return source_ips(request.headers.get("X-Forwarded-For", ""),
                      request.headers.get("X-Real-Ip", ""), request.remote or "")


@dataclass
class AuditRecord:
    """What the middleware learns about one request as it goes."""

    audit_id: str
    received: datetime
    info: RequestInfo
    user: UserInfo | None = None
    impersonated: UserInfo | None = None
    decision: str = ""
    code: int = 0


def build_event(request: web.Request, rec: AuditRecord) -> dict[str, Any]:
    """A kube ``audit.k8s.io/v1`` Event at Metadata level, plus ``peerProxied``."""
    peer_proxied = request.headers.get(PEER_PROXIED_HEADER)
    annotations = {}
    if rec.decision:
        annotations["authorization.k8s.io/decision"] = rec.decision
    if peer_proxied is not None:
        annotations["mvproxy.io/peer-proxied"] = peer_proxied
    event: dict[str, Any] = {
        "kind": "Event", "apiVersion": "audit.k8s.io/v1", "level": "Metadata",
        "auditID": rec.audit_id, "stage": "ResponseComplete",
        "requestURI": request.raw_path, "verb": rec.info.verb,
        "user": _audit_user(rec.user),
    }
    if rec.impersonated is not None:
        event["impersonatedUser"] = _audit_user(rec.impersonated)
    event["sourceIPs"] = _source_ips(request)
    if "User-Agent" in request.headers:
        event["userAgent"] = request.headers["User-Agent"]
    ref = _object_ref(rec.info)
    if ref is not None:
        event["objectRef"] = ref
    event["responseStatus"] = {"metadata": {}, "code": rec.code}
    event["requestReceivedTimestamp"] = _timestamp(rec.received)
    event["stageTimestamp"] = _timestamp(datetime.now(timezone.utc))
    event["annotations"] = annotations
    event["peerProxied"] = peer_proxied
    return event


class AuditLog:
    """Append-only JSON lines, flushed per event; ``None`` path discards events.

    One writer per file (each simulated server has its own log). The file is opened
    here, at startup, so an unwritable path is one clear error (UsageError, exit 2)
    rather than a 500 on every request.
    """

    def __init__(self, path: StrPath | None) -> None:
        self.path = Path(path) if path is not None else None
        self._file: IO[str] | None = None
        if self.path is not None:
            self._file = self._open(self.path)

    @staticmethod
    def _open(path: Path) -> IO[str]:
        try:
            return path.open("a", encoding="utf-8")
        except OSError as exc:
            raise UsageError(
                f"cannot open audit log {path}: {exc.strerror or exc}") from None

    def write(self, event: Mapping[str, Any]) -> None:
        if self.path is None:
            return
        if self._file is None:  # written to after close(): reopen
            self._file = self._open(self.path)
        self._file.write(json.dumps(event, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


async def audit_id_on_prepare(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """``app.on_response_prepare`` hook: streamed responses get ``Audit-Id`` too."""
    audit_id = request.get(AUDIT_ID)
    if audit_id and "Audit-Id" not in response.headers:
        response.headers["Audit-Id"] = audit_id


# --------------------------------------------------------------------------- middleware


def _request_info(request: web.Request) -> RequestInfo:
    info = request.get(REQUEST_INFO) or request.get("request_info")
    if info is None:
        info = parse_request_info(request.method, request.path, request.query_string)
    request[REQUEST_INFO] = info
    return info


def _gate(authenticator: Authenticator, request: web.Request,
          rec: AuditRecord) -> web.Response | None:
    """Authenticate, impersonate, authorize; a response means the request stops here."""
    user, rejected = authenticator.authenticate_detail(request)
    if user is None:
        if rejected:
            return status_response(401, "Unauthorized")
        user = ANONYMOUS  # then authorized like anyone: 403 beyond the public paths
    rec.user = user
    target = _impersonation(request, user)
    if isinstance(target, web.Response):
        return target
    if target is not None:
        rec.impersonated = user = target
    request[USER] = user
    allowed, message = authenticator.authorize(user, rec.info)
    rec.decision = "allow" if allowed else "forbid"
    return None if allowed else _forbidden(user, rec.info, message)


def auth_middleware(authenticator: Authenticator, audit: AuditLog) -> Callable[..., Any]:
    """The sim's identity middleware; put it right after the request-info one.

    Sets ``request[USER]`` (the effective user) and ``request[AUDIT_ID]``; register
    :func:`audit_id_on_prepare` too so streamed responses carry ``Audit-Id``.
    """

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        rec = AuditRecord(request.headers.get("Audit-ID") or str(uuid.uuid4()),
                          datetime.now(timezone.utc), _request_info(request))
        request[AUDIT_ID] = rec.audit_id
        rec.code = 500  # until we know better (an unexpected exception)
        try:
            # Not `or`: a StreamResponse is a (usually empty, so falsy) mapping.
            response: web.StreamResponse | None = _gate(authenticator, request, rec)
            if response is None:
                response = await handler(request)
            rec.code = response.status
        except web.HTTPException as exc:
            rec.code = exc.status
            raise
        finally:
            audit.write(build_event(request, rec))
        if not response.prepared and "Audit-Id" not in response.headers:
            response.headers["Audit-Id"] = rec.audit_id
        return response

    return middleware
