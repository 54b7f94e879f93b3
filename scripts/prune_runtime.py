#!/usr/bin/env python3
"""Remove the development-only parts of an installed mvproxy from a runtime tree.

The wheel carries the simulator (``mvproxy.devcluster``: code and the release
catalogs) because ``pip install mvproxy`` users run ``mvproxy demo``; the container
image and the standalone binary run only the daemon, so both builds call this on the
directory they ship (a site-packages or ``pip install --target`` directory). The
package's RECORD is rewritten to match, so pip still sees a consistent install.

Usage: prune_runtime.py SITE_PACKAGES_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

# Paths (relative to site-packages) that only `mvproxy sim` and `mvproxy demo` use.
DEV_ONLY = ("mvproxy/devcluster",)


def prune(site: Path) -> list[str]:
    """Delete DEV_ONLY under ``site``; the removed paths, relative to ``site``."""
    if not (site / "mvproxy" / "__init__.py").is_file():
        raise SystemExit(f"prune_runtime: no installed mvproxy package under {site}")
    removed = []
    for rel in DEV_ONLY:
        target = site / rel
        if target.exists():
            shutil.rmtree(target)
            removed.append(rel)
    for record in site.glob("mvproxy-*.dist-info/RECORD"):
        lines = record.read_text().splitlines(keepends=True)
        kept = [line for line in lines
                if not any(line.startswith(rel + "/") for rel in DEV_ONLY)]
        record.write_text("".join(kept))
    return removed


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    for rel in prune(Path(argv[0])):
        print(f"prune_runtime: removed {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
