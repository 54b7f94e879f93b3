#!/usr/bin/env python3
"""Write config/prometheus/mvproxy-prometheusrule.yaml from mvproxy-rules.yaml.

The plain rules file (what promtool and a plain Prometheus read) is the one source;
the Prometheus Operator's PrometheusRule carries the same groups under ``spec``. The
text is indented, not re-serialised, so the comments survive. tests/test_monitoring.py
fails when the committed file differs from what this writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

DIR = Path(__file__).resolve().parent.parent / "config" / "prometheus"
SOURCE = DIR / "mvproxy-rules.yaml"
TARGET = DIR / "mvproxy-prometheusrule.yaml"
HEADER = """\
# GENERATED from mvproxy-rules.yaml by `python3 scripts/gen_prometheusrule.py`: edit that
# file, then run the script. The Prometheus Operator's form of mvproxy's alerts; the
# Prometheus that should load it must select this label (its ruleSelector, e.g. the
# kube-prometheus-stack chart's `release: <name>`; add that label here if needed).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: mvproxy
  namespace: kube-system
  labels:
    app.kubernetes.io/name: mvproxy
    app.kubernetes.io/component: alerts
spec:
"""


def render() -> str:
    body = SOURCE.read_text()
    # Drop the source's own leading comment block (it talks about itself).
    lines = body.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("groups:"))
    indented = "".join(f"  {line}\n" if line else "\n" for line in lines[start:])
    return HEADER + indented


def main() -> int:
    TARGET.write_text(render())
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
