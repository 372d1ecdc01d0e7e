"""The validation gates' verdicts (node/gates.py), said on the Node where operators look
(`oci-gpu-hook toolkit report`; issue 47):
- a label per gate, `oci-gpu-hook.io/gate.NAME=pending|passed|failed`, for selectors (the labels
  and exporter DaemonSets can wait on them);
- one condition, GPUHookReady: True once every gate passed, False with the first failed gate's
  line (and its fix) as its message, Unknown while gates are pending; `kubectl describe node`
  shows it;
- an event (events.k8s.io/v1, regarding the Node) for each gate whose verdict changed since the
  last report, or that failed again for another reason, Warning for a failure, with the same
  line, at the time of the verdict (so that the events' times say the gates' order).
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


def report(client: Client, node: str, verdicts: dict | None, namespace: str = "default",
           untrusted: str | None = None) -> list:  # fmt: skip
    """Events, labels and condition on node for verdicts; lines saying what changed. The events
    go first: a report that fails half way leaves the labels as they were, so the next one sees
    the same change and makes its events again. untrusted (verdicts None): the gates' file could
    not be trusted, which the device plugin counts as a failure: GPUHookReady False, saying why."""
    current = client.get(f"/api/v1/nodes/{node}")
    labels = current.get("metadata", {}).get("labels") or {}
    lines = []
    if verdicts is None:
        made = {
            "status": "False",
            "reason": "GatesUntrusted",
            "message": untrusted or "the gates' verdicts are unreadable",
        }
        changed, wanted = [], {}
    else:
        made = condition(verdicts)
        wanted = {LABEL_PREFIX + g: verdicts[g]["state"] for g in gates.ORDER}
        changed = [g for g in gates.ORDER if labels.get(LABEL_PREFIX + g) != wanted[LABEL_PREFIX + g]]
    before = next((c for c in current.get("status", {}).get("conditions") or [] if c.get("type") == CONDITION), {})
    noted = list(changed)
    if made["reason"].startswith("Gate") and made["reason"].endswith("Failed") and before.get("message") not in (
            None, made["message"]):  # fmt: skip
        # Failed still, but for another reason (another fix): said again, though no label moves.
        failing = made["reason"][len("Gate") : -len("Failed")].lower()
        noted += [] if failing in noted else [failing]
    uid = current.get("metadata", {}).get("uid")
    for g in noted:
        v = verdicts[g]
        note = gates.line(g, v)
        reason = f"Gate{g.capitalize()}{v['state'].capitalize()}"
        client.post(f"/apis/events.k8s.io/v1/namespaces/{namespace}/events", {
            "apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"generateName": "oci-gpu-hook.gate-"},
            "eventTime": _now(True, v.get("at")), "reportingController": CONTROLLER,
            "reportingInstance": _instance(node),
            "action": "Validate", "reason": reason,
            "regarding": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid},
            "note": _bounded(note, NOTE_LIMIT), "type": "Warning" if v["state"] == "failed" else "Normal"})  # fmt: skip
        lines.append(f"event {reason}: {note}")
    if changed:
        client.patch(f"/api/v1/nodes/{node}", {"metadata": {"labels": wanted}})
        lines.append("labelled " + " ".join(f"{LABEL_PREFIX}{g}={verdicts[g]['state']}" for g in changed))
    now = _now()
    entry = {"type": CONDITION, **made, "lastHeartbeatTime": now,
             "lastTransitionTime": before.get("lastTransitionTime", now) if before.get("status") == made["status"]
             else now}  # fmt: skip
    client.patch(f"/api/v1/nodes/{node}/status", {"status": {"conditions": [entry]}}, strategic=True)
    if before.get("status") != made["status"] or before.get("message") != made["message"]:
        lines.append(f"condition {CONDITION}={made['status']}: {made['message']}")
    return lines


def take_back(client: Client, node: str) -> list:
    """The Node as before any report: no gate label, no GPUHookReady condition (the rollout's
    removal)."""
    client.patch(f"/api/v1/nodes/{node}", {"metadata": {"labels": {LABEL_PREFIX + g: None for g in gates.ORDER}}})
    client.patch(f"/api/v1/nodes/{node}/status", {"status": {"conditions": [{"type": CONDITION, "$patch": "delete"}]}},
                 strategic=True)  # fmt: skip
    return [f"took back the Node's labels {LABEL_PREFIX}* and its condition {CONDITION}"]


NOTE_LIMIT = 1024  # bytes: the API refuses a longer note
INSTANCE_LIMIT = 128  # characters of reportingInstance


def _bounded(text: str, limit: int) -> str:
    data = text.encode()
    return text if len(data) <= limit else data[: limit - 3].decode(errors="ignore") + "..."


def _instance(node: str) -> str:
    """The node's name, or, past the API's limit, its start and a digest of the whole."""
    import hashlib

    if len(node) <= INSTANCE_LIMIT:
        return node
    return node[: INSTANCE_LIMIT - 17] + "-" + hashlib.sha256(node.encode()).hexdigest()[:16]


def _now(micro: bool = False, at: float | None = None) -> str:
    """Now (at: that Unix time) as the API writes times."""
    try:
        now = datetime.datetime.fromtimestamp(at, datetime.timezone.utc)
    except (TypeError, ValueError, OverflowError, OSError):  # None, or not a time
        now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")
