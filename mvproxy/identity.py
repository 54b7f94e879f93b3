"""Who the downstream is, and which identity headers go upstream.

Three kinds of downstream (docs/architecture.md, "Identity model"):

- a **peer**: its client certificate was issued by the *peer client CA* (a CA that
  signs only proxies, kubeadm's front-proxy CA) *and* its CN is one of
  ``peer.allowedNames``. Only a peer's ``X-Remote-*`` and
  ``x-kubernetes-peer-proxied`` headers are believed: the peer authenticated the
  user and vouches for it.
- a **user** with a client certificate verified against ``clientCAFile``: user = CN,
  groups = O, and what kube-apiserver's x509 authenticator adds (1.33+): the extra
  ``authentication.kubernetes.io/credential-id`` = ``X509SHA256=<hex SHA-256 of the
  certificate>``, and the UID from the subject's UID attribute (OID
  1.3.6.1.4.1.57683.2) if it has one. mvproxy forwards them as ``X-Remote-User``,
  ``X-Remote-Group``, ``X-Remote-Extra-Authentication.kubernetes.io%2Fcredential-id``
  and ``X-Remote-Uid``, which the backend accepts because mvproxy presents its
  front-proxy client certificate (the UID only where kube-apiserver runs with
  ``--requestheader-uid-headers=X-Remote-Uid``; kubeadm does not set it).
- anyone else (bearer token, or nothing): **anonymous** to mvproxy; credentials pass
  through unchanged and the backend decides, seeing no client certificate at all.

Names are read as kube-apiserver reads them (Go: the last CN, every O), and a
certificate with several CNs is refused outright: OpenSSL-based tools show the
first, Go uses the last, and a peer check that read one while the backend read the
other would let ``/CN=front-proxy-client/CN=alice`` pass as either.

Whether a request has **credentials** at all (``has_credentials``: a peer, a
certificate user, or a bearer token as kube-apiserver reads one) decides whether
routing may send it to a peer: one without is answered by the backend, so it cannot
learn what only peers serve (``routing``'s docstring).

Identity headers from a non-peer are removed before forwarding: otherwise any
client could claim to be ``system:masters``. ``Impersonate-*`` headers stay: the
backend authorizes impersonation itself.

Pure apart from reading the CA files at construction; resolving a certificate is
memoised by its DER bytes, since a connection's certificate repeats on every request
it carries. A certificate reload hands over new CAs (``use_cas``) and the memo goes,
so a removed CA stops identifying anyone at once.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from cryptography import x509

from mvproxy import tls
from mvproxy.errors import PKIError
from mvproxy.logs import throttled
from mvproxy.wire import PEER_PROXIED, RawFields, connection_tokens

log = logging.getLogger(__name__)

REMOTE_USER = "X-Remote-User"
REMOTE_GROUP = "X-Remote-Group"
REMOTE_UID = "X-Remote-Uid"
REMOTE_PREFIX = "x-remote-"
CREDENTIAL_ID_HEADER = "X-Remote-Extra-Authentication.kubernetes.io%2Fcredential-id"
"""kube-apiserver's ``user.CredentialIDKey`` as a requestheader extra (the key is
path-escaped in the header name and lowercased when read, as the aggregator sends it)."""
X509_UID = x509.ObjectIdentifier("1.3.6.1.4.1.57683.2")
"""The subject attribute kube-apiserver reads a certificate user's UID from."""

class Kind(StrEnum):
    """What a downstream connection's certificate makes it (a member equals its string,
    as logs and the admin endpoints show it)."""

    PEER = "peer"
    """A peer's mvproxy: only its ``X-Remote-*`` headers are believed."""
    USER = "user"
    """A certificate verified against ``clientCAFile``: user CN, groups O."""
    ANONYMOUS = "anonymous"
    """No verified certificate: credentials pass through, the backend decides."""
    REFUSED = "refused"
    """A certificate that cannot identify anyone (``Downstream.reason`` says why)."""


PEER, USER, ANONYMOUS, REFUSED = Kind.PEER, Kind.USER, Kind.ANONYMOUS, Kind.REFUSED


@dataclass(frozen=True, slots=True)
class Downstream:
    """The verified identity of a connection (``ANONYMOUS``: no verified certificate)."""

    kind: Kind
    user: str = ""
    groups: tuple[str, ...] = ()
    reason: str = ""
    """For ``REFUSED``: why the certificate cannot identify anyone (shown to the client)."""
    uid: str = ""
    credential_id: str = ""
    """For a USER: what kube-apiserver's x509 authenticator records as its credential
    (``X509SHA256=<hex>``)."""
    header_lines: bytes = field(default=b"", compare=False, repr=False)
    """The ``X-Remote-*`` lines asserted for a USER, encoded once per identity (every
    request of its connection sends them)."""

    @property
    def is_peer(self) -> bool:
        return self.kind == PEER


def user_downstream(user: str, groups: tuple[str, ...], *, uid: str = "",
                    credential_id: str = "") -> Downstream:
    """A certificate user, with its header lines; REFUSED if a name cannot be sent as
    a header value as it is: a control character, or surrounding space or tab (the
    backend trims those, so `` admin`` would arrive as ``admin``)."""
    for name in (user, *groups, uid):
        if name != name.strip(" \t") or any(c < " " or c == "\x7f" for c in name):
            return UNSENDABLE_DOWNSTREAM
    downstream = Downstream(USER, user, groups, uid=uid, credential_id=credential_id)
    text = "".join(f"{name}: {value}\r\n" for name, value in identity_headers(downstream))
    try:
        encoded = text.encode("latin-1")
    except UnicodeEncodeError:
        return UNSENDABLE_DOWNSTREAM
    return Downstream(USER, user, groups, uid=uid, credential_id=credential_id,
                      header_lines=encoded)


def credential_id(der: bytes) -> str:
    """kube-apiserver's credential ID of a client certificate (x509.go)."""
    return "X509SHA256=" + hashlib.sha256(der).hexdigest()


def certificate_uid(cert: x509.Certificate) -> str | None:
    """The subject's UID attribute as kube-apiserver reads it: "" if there is none,
    None (it refuses the certificate) if there are several, an empty one or one that
    is not a string."""
    values = [a.value for a in cert.subject if a.oid == X509_UID]
    if not values:
        return ""
    if len(values) != 1 or not isinstance(values[0], str) or not values[0]:
        return None
    return values[0]


ANONYMOUS_DOWNSTREAM = Downstream(ANONYMOUS)
UNSENDABLE_DOWNSTREAM = Downstream(
    REFUSED, reason="the client certificate's subject holds characters that cannot be "
                    "sent in a header as they are (a control or non-Latin-1 character, "
                    "or a space or tab around a name)")
AMBIGUOUS_DOWNSTREAM = Downstream(
    REFUSED, reason="the client certificate has more than one common name (CN); "
                    "kube-apiserver would use the last one and tools show the first, so "
                    "it identifies nobody here")
BAD_UID_DOWNSTREAM = Downstream(
    REFUSED, reason="the client certificate's subject has several UIDs, an empty one or "
                    "one that is not a string; kube-apiserver refuses such a certificate")


class IdentityResolver:
    """Maps a TLS client certificate (already verified by the handshake) to a Downstream.

    The listener trusts both CAs for the handshake; this decides which one issued
    the certificate, because the two roles carry different rights.
    """

    def __init__(self, *, client_ca_file: str | None, peer_client_ca_file: str | None,
                 peer_allowed_names: Iterable[str], memo_size: int = 1024):
        self._client_cas = tls.load_ca_bundle(client_ca_file,
                                              "client CA file") if client_ca_file else ()
        self._peer_cas = (tls.load_ca_bundle(peer_client_ca_file, "peer client CA file")
                          if peer_client_ca_file else ())
        self._allowed = frozenset(peer_allowed_names)
        self._memo: OrderedDict[bytes, Downstream] = OrderedDict()
        self._memo_size = memo_size

    def use_cas(self, client_cas: tuple[x509.Certificate, ...],
                peer_cas: tuple[x509.Certificate, ...]) -> None:
        """Trust these CAs from now on (reloaded files); forget every memoised answer."""
        self._client_cas, self._peer_cas = tuple(client_cas), tuple(peer_cas)
        self._memo.clear()

    def resolve(self, der: bytes | None) -> Downstream:
        if not der:
            return ANONYMOUS_DOWNSTREAM
        found = self._memo.get(der)
        if found is None:
            found = self._classify(der)
            self._memo[der] = found
            if len(self._memo) > self._memo_size:
                self._memo.popitem(last=False)
        return found

    def _classify(self, der: bytes) -> Downstream:
        try:
            cert = x509.load_der_x509_certificate(der)
            names = tls.common_names(der)
            cn, orgs = tls.subject_identity(der)
        except (ValueError, PKIError):
            # OpenSSL verified it but cryptography cannot parse it: trust nothing it
            # claims; its bearer token (if any) still reaches the backend unchanged.
            throttled.warning(log, "client certificate could not be parsed; treating the "
                                   "connection as anonymous")
            return ANONYMOUS_DOWNSTREAM
        trusted = tls.issued_by_any(cert, self._peer_cas) or tls.issued_by_any(
            cert, self._client_cas)
        if trusted and len(names) > 1:
            throttled.warning(log, "client certificate with several common names refused",
                              common_names=len(names))
            return AMBIGUOUS_DOWNSTREAM
        if cn in self._allowed and tls.issued_by_any(cert, self._peer_cas):
            return Downstream(PEER, cn, orgs)
        if cn and tls.issued_by_any(cert, self._client_cas):
            uid = certificate_uid(cert)
            if uid is None:
                return BAD_UID_DOWNSTREAM
            return user_downstream(cn, orgs, uid=uid, credential_id=credential_id(der))
        return ANONYMOUS_DOWNSTREAM


def is_peer_proxied(downstream: Downstream, headers: Mapping[str, str]) -> bool:
    """Routing rule 1: a peer already chose this server; serve it locally."""
    return downstream.is_peer and headers.get(PEER_PROXIED, "").lower() == "true"


AUTHORIZATION = b"authorization"
WEBSOCKET_PROTOCOL = b"sec-websocket-protocol"
WEBSOCKET_BEARER = b"base64url.bearer.authorization.k8s.io."
"""kube-apiserver's bearer token in a WebSocket subprotocol (browsers cannot set
``Authorization`` on a WebSocket), as its ``websocket`` authenticator reads it."""


def has_credentials(downstream: Downstream, raw: RawFields, *, upgrade: bool = False) -> bool:
    """Whether an API server could authenticate this request as someone: the
    connection is a peer's or a certificate user's, or the request carries a bearer
    token as kube-apiserver reads one, valid or not (mvproxy cannot judge a token):
    the *first* ``Authorization`` field (Go's ``Header.Get``) is ``Bearer <token>``
    with a non-empty token, or, on an upgrade request only, the WebSocket bearer
    subprotocol carries one. Anything else (another scheme, an empty token, a second
    field, a field that ``Connection`` names so that forwarding drops it) is read as
    anonymous by kube-apiserver, so it counts as no credentials here: it would reach a
    peer at no cost to the prober. Pure, on the raw fields (the hot path)."""
    if downstream.kind in (PEER, USER):
        return True
    authorization: bytes | None = None
    subprotocols: list[bytes] = []
    named: set[bytes] | None = None
    for name, value in raw:
        first = name[:1]
        if first in (b"a", b"A") and name.lower() == AUTHORIZATION:
            if authorization is None:
                authorization = value
        elif first in (b"s", b"S") and name.lower() == WEBSOCKET_PROTOCOL:
            subprotocols.append(value)
        elif first in (b"c", b"C") and name.lower() == b"connection":
            named = (named or set()) | connection_tokens(value)
    if authorization is not None and not (named and AUTHORIZATION in named) \
            and _bearer_token(authorization):
        return True
    if upgrade and subprotocols and not (named and WEBSOCKET_PROTOCOL in named):
        return any(protocol.strip(b" \t").startswith(WEBSOCKET_BEARER)
                   and len(protocol.strip(b" \t")) > len(WEBSOCKET_BEARER)
                   for value in subprotocols for protocol in value.split(b","))
    return False


def _bearer_token(value: bytes) -> bool:
    """Whether kube-apiserver's bearer authenticator finds a token in this value:
    trimmed, split on spaces into at most three parts, ``bearer`` in any case first,
    a non-empty second part."""
    parts = value.strip(b" \t").split(b" ", 2)
    return len(parts) >= 2 and parts[0].lower() == b"bearer" and bool(parts[1])


def identity_headers(downstream: Downstream) -> list[tuple[str, str]]:
    """The ``X-Remote-*`` headers mvproxy itself asserts for a certificate user."""
    if downstream.kind != USER:
        return []
    headers = [(REMOTE_USER, downstream.user), *((REMOTE_GROUP, g) for g in downstream.groups)]
    if downstream.uid:
        headers.append((REMOTE_UID, downstream.uid))
    if downstream.credential_id:
        headers.append((CREDENTIAL_ID_HEADER, downstream.credential_id))
    return headers

