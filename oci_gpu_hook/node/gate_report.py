"""The validation gates' verdicts (node/gates.py), said on the Node where operators look
(`oci-gpu-hook toolkit report`; issue 47):
- a label per gate, `oci-gpu-hook.io/gate.NAME=pending|passed|failed`, for selectors (the labels
  and exporter DaemonSets can wait on them);
- one condition, GPUHookReady: True once every gate passed, False with the first failed gate's
  line (and its fix) as its message, Unknown while gates are pending; `kubectl describe node`
  shows it;
- an event (events.k8s.io/v1, regarding the Node) for each gate whose verdict changed since the
  last report, Warning for a failure, with the same line.
"""

from __future__ import annotations

import datetime

from oci_gpu_hook.node import gates
from oci_gpu_hook.node.kubeapi import Client

LABEL_PREFIX = "oci-gpu-hook.io/gate."
CONDITION = "GPUHookReady"
CONTROLLER = "oci-gpu-hook.io/toolkit"


def condition(verdicts: dict) -> dict:
    """The GPUHookReady condition the verdicts make (status, reason, message)."""
    failed = gates.failed(verdicts)
    if failed is not None:
        name = next(g for g in gates.ORDER if verdicts[g]["state"] == "failed")
        return {"status": "False", "reason": f"Gate{name.capitalize()}Failed", "message": failed}
    pending = [g for g in gates.ORDER if verdicts[g]["state"] != "passed"]
    if pending:
        return {"status": "Unknown", "reason": "GatesPending", "message": f"gates pending: {', '.join(pending)}"}
    return {"status": "True", "reason": "GatesPassed", "message": f"gates passed: {', '.join(gates.ORDER)}"}


def report(client: Client, node: str, verdicts: dict, namespace: str = "default") -> list:
    """Label, condition and events on node for verdicts; lines saying what changed."""
    current = client.get(f"/api/v1/nodes/{node}")
    labels = current.get("metadata", {}).get("labels") or {}
    wanted = {LABEL_PREFIX + g: verdicts[g]["state"] for g in gates.ORDER}
    changed = [g for g in gates.ORDER if labels.get(LABEL_PREFIX + g) != wanted[LABEL_PREFIX + g]]
    lines = []
    if changed:
        client.patch(f"/api/v1/nodes/{node}", {"metadata": {"labels": wanted}})
        lines.append("labelled " + " ".join(f"{LABEL_PREFIX}{g}={verdicts[g]['state']}" for g in changed))
    now = _now()
    made = condition(verdicts)
    before = next((c for c in current.get("status", {}).get("conditions") or [] if c.get("type") == CONDITION), {})
    entry = {"type": CONDITION, **made, "lastHeartbeatTime": now,
             "lastTransitionTime": before.get("lastTransitionTime", now) if before.get("status") == made["status"]
             else now}  # fmt: skip
    client.patch(f"/api/v1/nodes/{node}/status", {"status": {"conditions": [entry]}}, strategic=True)
    if before.get("status") != made["status"] or before.get("message") != made["message"]:
        lines.append(f"condition {CONDITION}={made['status']}: {made['message']}")
    uid = current.get("metadata", {}).get("uid")
    for g in changed:
        v = verdicts[g]
        note = gates.line(g, v)
        client.post(f"/apis/events.k8s.io/v1/namespaces/{namespace}/events", {
            "apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"generateName": f"{node}.gate-"},
            "eventTime": _now(micro=True), "reportingController": CONTROLLER, "reportingInstance": node,
            "action": "Validate", "reason": f"Gate{g.capitalize()}{v['state'].capitalize()}",
            "regarding": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid},
            "note": note[:1024], "type": "Warning" if v["state"] == "failed" else "Normal"})  # fmt: skip
        lines.append(f"event Gate{g.capitalize()}{v['state'].capitalize()}: {note}")
    return lines


def _now(micro: bool = False) -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")
