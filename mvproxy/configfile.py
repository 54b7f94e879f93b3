"""Reading mvproxy's configuration file: YAML text → the document ``config`` validates.

Kept apart from ``config`` (the model and its validation) so that PyYAML is imported
only by the commands that read a file (``run``, ``check-config``), never by the
modules on the request path that only need the dataclasses.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import yaml

from mvproxy.config import Config, describe, from_document
from mvproxy.errors import ConfigError, Problem


def load_config(path: str | os.PathLike[str] | None,
                overrides: Mapping[str, object] | None = None) -> Config:
    """Read, override, validate: the only way a ``Config`` should be made outside tests.

    ``path`` None means no file (flags only). Raises ``ConfigError`` listing every
    problem (``config.from_document``); its source is the path or ``<flags>``.
    """
    if path is None:
        return from_document(None, None, overrides)
    source = os.fspath(path)
    return from_document(_read_document(source), source, overrides)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (as Kubernetes' strict decoding does):
    with plain PyYAML the last one silently wins, hiding a half-edited file."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # unhashable keys are reported later as unknown keys
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_document(source: str) -> dict[Any, Any]:
    try:
        with open(source, "rb") as file:
            data = file.read()
    except OSError as error:
        raise ConfigError(source, [Problem(
            source, f"cannot read the configuration file: {error.strerror}")]) from None
    try:
        document = yaml.load(data, Loader=_StrictLoader)
    except yaml.YAMLError as error:
        raise ConfigError(source, [Problem(source, _describe_yaml_error(error))]) from None
    if not isinstance(document, dict):
        got = "an empty document" if document is None else describe(document)
        raise ConfigError(source, [Problem(source, f"must be a YAML mapping, got {got}")])
    return document


def _describe_yaml_error(error: yaml.YAMLError) -> str:
    if not isinstance(error, yaml.MarkedYAMLError) or error.problem_mark is None:
        return f"invalid YAML: {error}"
    mark = error.problem_mark
    context = f" ({error.context})" if error.context else ""
    return (f"invalid YAML at line {mark.line + 1}, column {mark.column + 1}: "
            f"{error.problem}{context}")
