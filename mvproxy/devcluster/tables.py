"""Server-side printing: objects as a ``meta.k8s.io`` Table, as ``kubectl get`` asks.

kubectl prints whatever columns the server sends: the common kinds get kube's own
columns (see printers), every other resource kube's default ones (Name, Age — what a
CRD without printer columns shows). Age is
rendered on the server the way apimachinery's ``HumanDuration`` does ("5s", "3m2s",
"2d"), so output matches a real cluster's.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from .printers import printer_for

META_GROUP = "meta.k8s.io"
INCLUDE_OBJECT = ("Metadata", "Object", "None")

def human_duration(seconds: float) -> str:
    """apimachinery's HumanDuration: coarser the older, at most two units."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    days = hours // 24
    if hours < 24 * 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if days < 365 * 2:
        return f"{days}d"
    years, rest = divmod(days, 365)
    if days < 365 * 8:
        return f"{years}y{rest}d" if rest else f"{years}y"
    return f"{years}y"


def age(obj: dict, now: datetime) -> str:
    stamp = (obj.get("metadata") or {}).get("creationTimestamp")
    if not stamp:
        return "<unknown>"
    try:
        created = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return "<unknown>"
    return human_duration((now - created).total_seconds())


def partial_metadata(obj: dict, version: str = "v1") -> dict:
    """``PartialObjectMetadata``: only the metadata, as metadata-only clients want."""
    return {"kind": "PartialObjectMetadata", "apiVersion": f"{META_GROUP}/{version}",
            "metadata": obj.get("metadata") or {}}


def _row(obj: dict, include: str, version: str, now: datetime, cells: Any) -> dict:
    row: dict[str, Any] = {"cells": cells(obj, lambda o: age(o, now))}
    if include == "Object":
        row["object"] = obj
    elif include == "Metadata":
        row["object"] = partial_metadata(obj, version)
    else:
        row["object"] = None
    return row


def table(objects: list[dict], *, list_meta: dict | None = None, include: str = "Metadata",
          version: str = "v1", headers: bool = True, now: datetime | None = None,
          group: str = "", resource: str = "") -> dict:
    """A Table of ``objects`` of (``group``, ``resource``); ``headers=False`` omits
    columnDefinitions (later watch events)."""
    now = now or datetime.now(timezone.utc)
    printer = printer_for(group, resource)
    return {
        "kind": "Table",
        "apiVersion": f"{META_GROUP}/{version}",
        "metadata": list_meta or {},
        "columnDefinitions": [dict(c) for c in printer.columns] if headers else None,
        "rows": [_row(o, include, version, now, printer.cells) for o in objects],
    }
