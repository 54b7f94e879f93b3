"""The configuration's YAML keys, read from the dataclass field metadata, for tests that
check documents (the example file, the runbook) name only keys that exist."""

from __future__ import annotations

import dataclasses

from mvproxy.config import Config


def dotted_keys_of(cls: type = Config, prefix: str = "") -> set[str]:
    """Every YAML key the schema knows, as dotted paths (``discovery.pollInterval``)."""
    keys = set()
    for f in dataclasses.fields(cls):
        key = prefix + f.metadata["key"]
        keys.add(key)
        section = getattr(f.metadata["parse"], "cls", None)
        if section is not None:
            keys |= dotted_keys_of(section, key + ".")
    return keys
