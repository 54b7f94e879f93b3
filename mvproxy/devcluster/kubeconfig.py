"""Write a kubeconfig for a development control plane (the demo and the tests).

File paths (certificate authority, client certificates) are written as absolute paths,
not embedded data, so a user can open the files the kubeconfig points at. The file is
created with mode 0600 (it may hold bearer tokens) and replaced atomically.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

StrPath = str | os.PathLike[str]

_CERT_KEYS = frozenset({"client-certificate", "client-key"})
_TOKEN_KEYS = frozenset({"token"})


def _absolute(path: StrPath) -> str:
    return str(Path(path).absolute())


def _user_entry(name: str, creds: Mapping[str, object]) -> dict[str, str]:
    keys = frozenset(creds)
    if keys == _CERT_KEYS:
        entry = {}
        for key in ("client-certificate", "client-key"):
            path = creds[key]
            if not isinstance(path, (str, os.PathLike)):
                raise ValueError(f"user {name!r}: {key} must be a path")
            entry[key] = _absolute(path)
        return entry
    if keys == _TOKEN_KEYS:
        token = creds["token"]
        if not isinstance(token, str) or "\n" in token:
            raise ValueError(f"user {name!r}: token must be a one-line string")
        return {"token": token}
    if not keys:
        return {}  # no credentials at all: requests are anonymous
    raise ValueError(
        f"user {name!r}: expected either client-certificate and client-key, or token; "
        f"got {', '.join(sorted(keys))}")


def kubeconfig_document(
    *,
    ca_file: StrPath,
    clusters: Sequence[tuple[str, str]],
    users: Mapping[str, Mapping[str, object]],
    contexts: Sequence[tuple[str, str, str]],
    current_context: str,
) -> dict:
    """The kubeconfig as a dict; every reference checked (ValueError names the first bad one)."""
    cluster_names = [name for name, _ in clusters]
    context_names = [name for name, _, _ in contexts]
    for kind, names in (("cluster", cluster_names), ("context", context_names),
                        ("user", list(users))):
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate {kind} name(s): {', '.join(dupes)}")
    for ctx, cluster, user in contexts:
        if cluster not in cluster_names:
            raise ValueError(f"context {ctx!r}: unknown cluster {cluster!r}")
        if user not in users:
            raise ValueError(f"context {ctx!r}: unknown user {user!r}")
    if current_context not in context_names:
        raise ValueError(f"current context {current_context!r} is not one of the contexts")
    for name, server in clusters:
        if not server.startswith("https://"):
            raise ValueError(f"cluster {name!r}: server must be an https:// URL, got {server!r}")

    ca = _absolute(ca_file)
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "preferences": {},
        "clusters": [
            {"name": name, "cluster": {"server": server, "certificate-authority": ca}}
            for name, server in clusters
        ],
        "users": [{"name": name, "user": _user_entry(name, creds)}
                  for name, creds in users.items()],
        "contexts": [
            {"name": ctx, "context": {"cluster": cluster, "user": user}}
            for ctx, cluster, user in contexts
        ],
        "current-context": current_context,
    }


def write_kubeconfig(
    path: StrPath,
    *,
    ca_file: StrPath,
    clusters: Sequence[tuple[str, str]],
    users: Mapping[str, Mapping[str, object]],
    contexts: Sequence[tuple[str, str, str]],
    current_context: str,
) -> Path:
    """Write a kubeconfig to ``path`` (mode 0600, atomic replace); returns the path.

    ``clusters``: (name, server URL); ``users``: name -> {"client-certificate",
    "client-key"} or {"token"} (an empty mapping means no credentials);
    ``contexts``: (context name, cluster name, user name).
    """
    doc = kubeconfig_document(ca_file=ca_file, clusters=clusters, users=users,
                              contexts=contexts, current_context=current_context)
    text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
