"""The validation gates, run (issue 47; node/gates.py). Gate toolkit: a real GPU container,
started through the node's own runtime, must get exactly the GPU it asked for. Gate plugin: a pod
that asks the scheduler for one GPU must get exactly one GPU of the node's, and run on it.

`oci-gpu-hook toolkit validate` makes a pod on the node: unprivileged, pinned to it by name (the
runtime is under test, not the scheduler), asking for one GPU the way the device plugin's
volume-mounts answer does (a mount of /dev/null at /var/run/nvidia-container-devices/UUID, which
only a pod allowed host paths can make, as this one is; the hook reads it with
accept_volume_mounts), and running
`oci-gpu-hook toolkit workload` from the node image. The workload says what it got in its
termination message (read from the pod's status: no log access to the node is needed): the GPUs
nvidia-smi lists and the GPU device nodes it sees. The gate passes when that is exactly the GPU
asked for, and fails with what it saw otherwise; the verdict goes to the gates' file, and the pod
is deleted. The plugin gate's pod asks for `nvidia.com/gpu: 1`, placed by the scheduler on the
node (a nodeSelector on its hostname): it runs only once the device plugin advertises the GPUs,
and passes when it got one of the node's GPUs and one device node.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

from oci_gpu_hook.errors import PrerequisiteError
from oci_gpu_hook.node import gates
from oci_gpu_hook.node.kubeapi import ApiError, Client

DEVICE_DIRECTORY = "/var/run/nvidia-container-devices"  # the volume-mounts answer's (start/request.py)
TERMINATION_LOG = "/dev/termination-log"
UUID = re.compile(r"\(UUID: (GPU-[0-9a-fA-F-]+|MIG-[0-9a-fA-F-]+)\)")
TIMEOUT = 120.0


def workload() -> dict:
    """What this container got: {"uuids": nvidia-smi -L's, "devices": the /dev/nvidiaN nodes}."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        listed = ""
    try:
        nodes = sorted(n for n in os.listdir("/dev") if re.fullmatch(r"nvidia[0-9]+", n))
    except OSError:
        nodes = []
    found = {"uuids": UUID.findall(listed), "devices": nodes}
    try:
        with open(TERMINATION_LOG, "w") as f:
            json.dump(found, f)
    except OSError:
        pass  # not in a pod: the caller reads stdout
    return found


DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def pod_name(gate: str, node: str) -> str:
    """gate-GATE-NODE: a node's name is a DNS subdomain of at most 253 bytes, as a pod's is; one
    too long for the prefix is refused rather than cut (two nodes would share a pod)."""
    name = f"gate-{gate}-{node}"
    if not DNS_NAME.fullmatch(node) or len(name) > 253:
        raise PrerequisiteError(f"{node!r}: not a node name a validation pod can be named after")
    return name


def pod(gate: str, node: str, namespace: str, image: str, uuid: str | None = None, resource: str = "nvidia.com/gpu",
        host_network: bool = False, selinux_type: str | None = None) -> dict:  # fmt: skip
    """The validation pod of gate. toolkit: on node by name, asking the hook for GPU uuid through
    the volume-mounts path; plugin: placed on node by the scheduler, asking for one resource.
    host_network: the node's network (for a cluster with no pod network: the pod needs none, but
    a pod without the node's network needs one to start). selinux_type: its container's SELinux
    type (gpu_container_t on a node with SELinux: container_t may not open the GPU's nodes, and
    a GPU pod there runs as the validation pod must); the level stays the runtime's to choose."""
    container = {
        "name": "workload", "image": image, "imagePullPolicy": "IfNotPresent",
        "command": ["/usr/bin/oci-gpu-hook", "toolkit", "workload"],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "readOnlyRootFilesystem": True, "seccompProfile": {"type": "RuntimeDefault"}},
    }  # fmt: skip
    if selinux_type is not None:
        container["securityContext"]["seLinuxOptions"] = {"type": selinux_type}
    spec = {"restartPolicy": "Never", "automountServiceAccountToken": False, "hostNetwork": host_network,
            "tolerations": [{"operator": "Exists"}], "containers": [container]}  # fmt: skip
    if gate == "toolkit":
        spec["nodeName"] = node  # the runtime is under test, not the scheduler
        container["volumeMounts"] = [{"name": "gpu", "mountPath": f"{DEVICE_DIRECTORY}/{uuid}", "readOnly": True}]
        spec["volumes"] = [{"name": "gpu", "hostPath": {"path": "/dev/null", "type": "CharDevice"}}]
    else:
        # By the Node's name, as the DaemonSet controller pins its pods (its hostname label may differ).
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}  # fmt: skip
        container["resources"] = {"limits": {resource: "1"}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name(gate, node), "namespace": namespace,
                         "labels": {"app.kubernetes.io/name": "oci-gpu-hook-gate", "oci-gpu-hook.io/gate": gate}},
            "spec": spec}  # fmt: skip


def validate(client: Client, gate: str, node: str, namespace: str, image: str, gates_file: str, known,
             uuid: str | None = None, resource: str = "nvidia.com/gpu", timeout: float = TIMEOUT,
             host_network: bool = False, selinux_type: str | None = None) -> str:  # fmt: skip
    """Run gate (toolkit: asking for GPU uuid; plugin: for one resource, which must be one of the
    GPUs known, the node's inventory's); write its verdict (the other gate's kept) and return its
    line."""
    name = pod_name(gate, node)
    if not DNS_NAME.fullmatch(namespace):
        raise PrerequisiteError(f"{namespace!r}: not a namespace's name")
    path = f"/api/v1/namespaces/{namespace}/pods/{name}"
    _delete(client, path)
    made = client.post(f"/api/v1/namespaces/{namespace}/pods", pod(gate, node, namespace, image, uuid, resource,
                                                                   host_network, selinux_type))  # fmt: skip
    uid = made.get("metadata", {}).get("uid")
    try:
        verdict = _verdict(client, path, uid, node, [uuid] if gate == "toolkit" else sorted(known), name, namespace,
                           timeout)  # fmt: skip
    finally:
        _delete(client, path, wait=False, uid=uid)
    return record(gates_file, {gate: verdict})


def record(gates_file: str, verdicts: dict) -> str:
    """Write verdicts {gate: verdict} into the gates' file, the other gates' kept (one the file
    cannot be trusted for is pending); the line of the last one given."""
    try:
        kept = gates.read(gates_file)
    except ValueError:
        kept = {}
    gate, verdict = list(verdicts.items())[-1]
    try:
        gates.write(gates_file, {**{g: v for g, v in kept.items() if g not in verdicts}, **verdicts})
    except OSError as e:
        raise PrerequisiteError(f"{gates_file}: cannot write the verdict ({e.strerror}): "
                                f"{gates.line(gate, verdict)}") from None  # fmt: skip
    return gates.line(gate, verdict)


def remove_pods(client: Client, node: str, namespace: str) -> None:
    """Delete this node's validation pods, whatever made them: what a cut run left."""
    for gate in gates.ORDER:
        try:
            _delete(client, f"/api/v1/namespaces/{namespace}/pods/{pod_name(gate, node)}", wait=False)
        except ApiError:
            pass


def gpus(inventory) -> tuple:
    """(every device's UUID: the GPUs' and their MIG devices', the full GPUs' UUIDs) of the
    node's inventory: what gate plugin accepts, and what gate toolkit may ask for (a full GPU
    is one device on one node)."""
    known = [g.uuid for g in inventory.gpus] + [m.uuid for g in inventory.gpus for m in g.mig if m.uuid]
    return known, [g.uuid for g in inventory.gpus if not g.mig]


def _verdict(client: Client, path: str, uid: str | None, node: str, wanted: list, name: str, namespace: str,
             timeout: float) -> dict:  # fmt: skip
    """Passed when the pod this run made (its uid: one of the same name made by anyone else is not
    it), on node, succeeded and its container saw one device, one of wanted, and one device node.
    A MIG device is listed with its GPU: the MIG device is then the one that counts."""
    fix = f"kubectl describe pod -n {namespace} {name}; oci-gpu-hook doctor on the node"
    deadline = time.monotonic() + timeout
    while True:
        try:
            current = client.get(path)
        except ApiError as e:
            if e.status != 404 and time.monotonic() < deadline:
                time.sleep(1)
                continue  # the API server, for a moment
            return gates.verdict("failed", f"the validation pod went away before it finished ({e})", fix)
        if uid is None or current.get("metadata", {}).get("uid") != uid:
            return gates.verdict("failed", "the validation pod was replaced by another of its name", fix)
        status = current.get("status", {})
        if status.get("phase") in ("Succeeded", "Failed"):
            break
        if time.monotonic() > deadline:
            waiting = next((s.get("state", {}).get("waiting") for s in status.get("containerStatuses") or []), None)
            unscheduled = next((c.get("message") for c in status.get("conditions") or []
                                if c.get("type") == "PodScheduled" and c.get("status") == "False"), None)  # fmt: skip
            said = (f"{waiting.get('reason')}: {waiting.get('message', '')}" if waiting else
                    f"not scheduled: {unscheduled}" if unscheduled else status.get("phase"))  # fmt: skip
            if unscheduled and "Insufficient " in unscheduled:
                # Every GPU is in use: nothing is wrong, and the next round asks again.
                return gates.verdict("pending", f"no GPU free to validate with ({said})")
            return gates.verdict("failed", f"the validation pod did not finish in {timeout:.0f} s ({said})", fix)
        time.sleep(1)
    terminated = next((s.get("state", {}).get("terminated") for s in status.get("containerStatuses") or []), None) or {}
    if current.get("spec", {}).get("nodeName") != node:
        return gates.verdict("failed", f"the validation pod ran on {current.get('spec', {}).get('nodeName')}, "
                                       f"not {node}", fix)  # fmt: skip
    if status.get("phase") != "Succeeded" or terminated.get("exitCode") != 0:
        why = terminated.get("message") or terminated.get("reason") or status.get("reason") or "no message"
        return gates.verdict("failed", f"the validation container failed (exit {terminated.get('exitCode')}: "
                                       f"{why.strip()[:300]})", fix)  # fmt: skip
    try:
        got = json.loads(terminated.get("message") or "")
        uuids, devices = list(got["uuids"]), list(got["devices"])
    except (ValueError, KeyError, TypeError):
        why = terminated.get("message") or terminated.get("reason") or status.get("reason") or "no message"
        return gates.verdict("failed", f"the validation container said nothing readable ({why.strip()[:300]})", fix)
    counted = [u for u in uuids if u.startswith("MIG-")] or uuids
    if len(counted) == 1 and counted[0] in wanted and len(devices) == 1:
        return gates.verdict("passed")
    saw = f"GPUs {', '.join(uuids) or 'none'} and device nodes {', '.join(devices) or 'none'}"
    asked = wanted[0] if len(wanted) == 1 else f"one of {', '.join(wanted)}"
    return gates.verdict("failed", f"the validation container asked for {asked} and saw {saw}", fix)


def _delete(client: Client, path: str, wait: bool = True, uid: str | None = None) -> None:
    """Delete the pod at path (only if it is still uid's, where given) and, with wait, until it is gone."""
    body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0}
    if uid is not None:
        body["preconditions"] = {"uid": uid}
    try:
        client.request("DELETE", path, body)
    except ApiError as e:
        if e.status in (404, 409):  # gone, or another's now (its uid not ours): not ours to delete
            return
        raise
    deadline = time.monotonic() + 60
    while wait and time.monotonic() < deadline:
        try:
            client.get(path)
        except ApiError as e:
            if e.status == 404:
                return
            raise
        time.sleep(0.5)
