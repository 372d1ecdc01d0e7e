#!/usr/bin/env python3
"""Write prometheusrule.yaml, the Prometheus operator's PrometheusRule, from oci-gpu-hook.rules.yml,
the rules file plain Prometheus loads: `deploy/monitoring/make-prometheusrule.py [--output FILE]`.

The rules file is the one to edit. Its groups become the manifest's spec as they are written,
comments included (indented under `spec:`), so the two cannot say different things;
tests/deploy/test_monitoring.py checks that the manifest is this script's output.
"""

import argparse
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RULES = os.path.join(HERE, "oci-gpu-hook.rules.yml")
MANIFEST = os.path.join(HERE, "prometheusrule.yaml")

HEADER = """\
# Written by make-prometheusrule.py from oci-gpu-hook.rules.yml: edit that file and run the
# script again. For the Prometheus operator only (its CRDs): not in deploy/kubernetes/, which must
# apply on a cluster without them. Give it the labels your Prometheus's ruleSelector asks for
# (docs/alerts.md).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: oci-gpu-hook
  namespace: oci-gpu-hook
  labels:
    app.kubernetes.io/name: oci-gpu-hook-node
spec:
"""


def manifest(rules_text: str) -> str:
    """The PrometheusRule holding rules_text's groups. The file's opening comment speaks of the
    file itself (how to load it), so it is left out; every line from `groups:` on is kept."""
    lines = rules_text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("groups:"))
    return HEADER + "".join("  " + line if line.strip() else line for line in lines[start:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=MANIFEST, help=f"where to write it (default {MANIFEST})")
    args = parser.parse_args()
    with open(RULES, encoding="utf-8") as f:
        text = manifest(f.read())
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
