"""Logging: klog-like text or JSON lines, klog verbosity levels, and redaction.

Every module logs through ``logging.getLogger(__name__)``; structured fields go in
``extra=kv(peer=..., code=...)`` so both formats can render them as key=value pairs.

Verbosity follows klog: ``--v=N`` shows messages logged at ``V(n)`` for ``n <= N``.
``V(0)`` is INFO, ``V(10)`` is DEBUG. Lifecycle facts are logged at V(0..2),
per-request decisions at V(4) and above.

Redaction is defence in depth: code must never pass tokens, keys or bodies to a
logger, but if a header value or an upstream error text slips through, bearer
tokens and PEM private keys are masked before anything is written.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

_KV_ATTR = "mvproxy_kv"
_LEVEL_LETTERS = {logging.CRITICAL: "F", logging.ERROR: "E", logging.WARNING: "W"}
_SECRET_KEYS = frozenset({"authorization", "token", "password", "bearer", "cookie"})
_BEARER = re.compile(r"(?i)\b((?:bearer|basic)\s+)[^\s,;\"']+")
_PEM_KEY = re.compile(
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(-----END [A-Z ]*PRIVATE KEY-----|\Z)", re.S
)
REDACTED = "<redacted>"


def V(n: int) -> int:  # noqa: N802 - named after klog's V()
    """The logging level of klog verbosity ``n``: ``log.log(V(4), ...)``."""
    return logging.INFO - max(0, min(n, 10))


def kv(**fields: Any) -> dict[str, Any]:
    """Structured fields for one log call: ``log.info("msg", extra=kv(peer=p))``."""
    return {_KV_ATTR: fields}


def redact(text: str) -> str:
    """Mask bearer tokens and PEM private keys in free text."""
    return _PEM_KEY.sub(REDACTED, _BEARER.sub(r"\1" + REDACTED, text))


def _is_secret_key(key: str) -> bool:
    lowered = key.lower()
    return any(word in lowered for word in _SECRET_KEYS)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, _KV_ATTR, None) or {}
    clean: dict[str, Any] = {}
    for key, value in fields.items():
        if _is_secret_key(key):
            clean[key] = REDACTED
        elif isinstance(value, (bool, int, float)) or value is None:
            clean[key] = value
        else:  # strings, and anything else rendered as text (a dict of headers, say)
            clean[key] = redact(str(value))
    return clean


def _verbosity(record: logging.LogRecord) -> int:
    return max(0, logging.INFO - record.levelno)


class TextFormatter(logging.Formatter):
    """``I1129 22:27:19.123456 mvproxy.polling] message key="value" n=3``."""

    def __init__(self, static: dict[str, Any] | None = None):
        super().__init__()
        self.static = [f"{k}={_render_value(v)}" for k, v in (static or {}).items()]

    def format(self, record: logging.LogRecord) -> str:
        letter = _LEVEL_LETTERS.get(record.levelno, "I") if record.levelno >= logging.INFO else "I"
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime(record.created))
        micros = int((record.created % 1) * 1_000_000)
        line = f"{letter}{stamp}.{micros:06d} {record.name}] {redact(record.getMessage())}"
        pairs = [f"{k}={_render_value(v)}" for k, v in _fields(record).items()]
        pairs += self.static
        if pairs:
            line += " " + " ".join(pairs)
        if record.exc_info:
            line += "\n" + redact(self.formatException(record.exc_info))
        return line


def _render_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


class JSONFormatter(logging.Formatter):
    """One JSON object per line, with klog's ``v`` and the structured fields."""

    def __init__(self, static: dict[str, Any] | None = None):
        super().__init__()
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": "info" if record.levelno < logging.INFO else record.levelname.lower(),
            "v": _verbosity(record),
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        for key, value in _fields(record).items():
            doc.setdefault(key, value if _is_json_scalar(value) else str(value))
        for key, value in self.static.items():
            doc.setdefault(key, value)
        if record.exc_info:
            doc["error"] = redact(self.formatException(record.exc_info))
        return json.dumps(doc, separators=(",", ":"))


def _is_json_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def configure(fmt: str = "text", verbosity: int = 2, stream: TextIO | None = None, *,
              static: dict[str, Any] | None = None) -> None:
    """Route every ``mvproxy`` (and aiohttp) logger to ``stream`` in ``fmt``.

    Replaces handlers installed by an earlier call, so tests and the CLI may call it
    more than once. ``static`` fields end every line (a worker's index). aiohttp's
    own loggers are quieted to WARNING below ``--v=6``: its access log would
    otherwise write one line per request.
    """
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JSONFormatter(static) if fmt == "json" else TextFormatter(static))
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_mvproxy", False):
            root.removeHandler(old)
    handler._mvproxy = True  # type: ignore[attr-defined]  # our mark, for the next call
    root.addHandler(handler)
    set_verbosity(verbosity)


def set_verbosity(verbosity: int) -> None:
    """The klog-style level, also live (SIGHUP); libraries stay quiet below 6."""
    logging.getLogger().setLevel(V(verbosity))
    library_level = V(verbosity) if verbosity >= 6 else logging.WARNING
    for name in ("aiohttp", "asyncio"):
        logging.getLogger(name).setLevel(library_level)


class Throttle:
    """At most one line per message per ``interval`` for what can happen on every
    request (a dead backend must not write a line per request); the next line says how
    many were left out. Keys are the fixed message texts, so the memory is bounded."""

    def __init__(self, interval: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, logger: logging.Logger, level: int, message: str, *,
            exc_info: BaseException | None = None, **fields: Any) -> bool:
        """Log ``message`` unless it was logged within ``interval``; True if logged."""
        now = self._clock()
        last = self._last.get(message)
        if last is not None and now - last < self.interval:
            self._suppressed[message] = self._suppressed.get(message, 0) + 1
            return False
        self._last[message] = now
        left_out = self._suppressed.pop(message, 0)
        if left_out:
            fields["suppressed_since_last"] = left_out
        logger.log(level, message, exc_info=exc_info, extra=kv(**fields))
        return True

    def warning(self, logger: logging.Logger, message: str, **fields: Any) -> bool:
        return self.log(logger, logging.WARNING, message, **fields)


throttled = Throttle()
"""The process's throttle for request-path warnings and errors."""
