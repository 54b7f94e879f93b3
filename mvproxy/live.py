"""The settings a request reads as it goes, shared by the handlers and changed by reload.

``app`` builds one ``LiveSettings`` and hands the same object to every handler; a
SIGHUP (``reload``) updates it in place, so the next answer follows the new
configuration. A copy of a value taken at build time (an ``int`` handed to a
constructor) would keep the old one for the life of the process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mvproxy.config import Config


def retry_after(poll_interval: float) -> int:
    """Seconds a 503 asks clients to wait: about one discovery poll, at least one."""
    return max(1, math.ceil(poll_interval))


@dataclass(slots=True)
class LiveSettings:
    retry_after: int
    """``Retry-After`` of a 503: ``discovery.pollInterval`` rounded up."""
    probe_timeout: float
    """Seconds a discovery probe to the backend may take (``timeouts.request``)."""
    max_document_bytes: int
    """Largest discovery answer read whole (``discovery.maxDocumentBytes``)."""

    @classmethod
    def of(cls, cfg: Config) -> LiveSettings:
        return cls(retry_after(cfg.discovery.poll_interval), cfg.timeouts.request,
                   cfg.discovery.max_document_bytes)

    def update(self, cfg: Config) -> None:
        """Take ``cfg``'s values (a reload): every holder sees them at once."""
        fresh = LiveSettings.of(cfg)
        self.retry_after = fresh.retry_after
        self.probe_timeout = fresh.probe_timeout
        self.max_document_bytes = fresh.max_document_bytes
