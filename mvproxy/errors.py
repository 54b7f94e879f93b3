"""mvproxy's own exception tree.

Callers above a boundary see only these types, never aiohttp's or cryptography's,
so the libraries underneath can change without touching every ``except`` clause.
The CLI turns any ``MvproxyError`` into one clear message and a non-zero exit code;
nothing in this tree should ever surface as a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass


class MvproxyError(Exception):
    """Base of every error mvproxy raises on purpose."""

    #: Process exit code when this error ends a command.
    exit_code = 1


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input: where (a YAML path, flag or file) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class ConfigError(MvproxyError):
    """The configuration (file and flags) is invalid; carries every problem found."""

    exit_code = 2

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = list(problems)
        count = len(self.problems)
        lines = [f"{source}: {count} problem{'s' if count != 1 else ''}"]
        lines += [f"  {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class PKIError(MvproxyError):
    """Certificate material is missing, unreadable, expired or inconsistent."""

    exit_code = 2


class UsageError(MvproxyError):
    """The command line is wrong in a way argparse cannot see (e.g. a bad ``--peer``)."""

    exit_code = 2


class UpstreamError(MvproxyError):
    """Talking to the backend or a peer failed; ``upstream`` names which one.

    The original library exception is chained (``raise ... from``) for the log, but
    callers only ever branch on these types.
    """

    def __init__(self, upstream: str, message: str):
        self.upstream = upstream
        super().__init__(f"{upstream}: {message}")


class UpstreamConnectError(UpstreamError):
    """No connection (refused, unreachable, TLS handshake failed): nothing was sent,
    so the request may safely go to another capable peer."""


class UpstreamUnresolved(UpstreamConnectError):
    """The upstream's host name did not resolve to an address: its endpoint is bad
    (upstream's ``hostport_resolution``), not the fetch."""


class UpstreamTimeout(UpstreamError):
    """The upstream accepted the request but did not answer in time."""


class UpstreamProtocolError(UpstreamError):
    """The upstream answered with something unusable (bad HTTP, oversized body)."""


class UpstreamUnreachable(UpstreamProtocolError):
    """The request was on its way when polling declared the upstream unreachable and
    ended it; no response byte had arrived."""


class UpstreamUnserved(UpstreamError):
    """A peer mvproxy answered that nothing reached *its* backend (its 503 carries the
    ``UNSERVED`` marker), so the request may go to another capable peer."""


class UpstreamShuttingDown(UpstreamUnserved):
    """The upstream refused the request unprocessed because it is shutting down
    (kube-apiserver's ``--shutdown-send-retry-after``: 429 with ``Retry-After`` and
    ``Connection: close``), so it may go to another server; ``retry_after`` is the
    upstream's own value."""

    def __init__(self, upstream: str, message: str, retry_after: str = ""):
        super().__init__(upstream, message)
        self.retry_after = retry_after
