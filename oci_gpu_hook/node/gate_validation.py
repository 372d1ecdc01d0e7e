"""Gate toolkit, run (issue 47): a real GPU container, started through the node's own runtime,
must get exactly the GPU it asked for (node/gates.py).

`oci-gpu-hook toolkit validate` makes a pod on the node: unprivileged, pinned to it by name (the
runtime is under test, not the scheduler), asking for one GPU the way the device plugin's
volume-mounts answer does (a mount at /var/run/nvidia-container-devices/UUID, which a pod's
author cannot forge for another GPU; the hook reads it with accept_volume_mounts), and running
`oci-gpu-hook toolkit workload` from the node image. The workload says what it got in its
termination message (read from the pod's status: no log access to the node is needed): the GPUs
nvidia-smi lists and the GPU device nodes it sees. The gate passes when that is exactly the GPU
asked for, and fails with what it saw otherwise; the verdict goes to the gates' file, and the pod
is deleted.
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


def pod_name(node: str) -> str:
    return f"gate-toolkit-{node}"[:63].rstrip("-.")


def pod(node: str, namespace: str, uuid: str, image: str, host_network: bool = False) -> dict:
    """The validation pod. host_network: the node's network (for a cluster with no pod network:
    the pod needs none, but a pod without the node's network needs one to start)."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod_name(node), "namespace": namespace,
                     "labels": {"app.kubernetes.io/name": "oci-gpu-hook-gate", "oci-gpu-hook.io/gate": "toolkit"}},
        "spec": {
            "nodeName": node, "restartPolicy": "Never", "automountServiceAccountToken": False,
            "hostNetwork": host_network,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{
                "name": "workload", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["/usr/bin/oci-gpu-hook", "toolkit", "workload"],
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "gpu", "mountPath": f"{DEVICE_DIRECTORY}/{uuid}", "readOnly": True}]}],
            "volumes": [{"name": "gpu", "hostPath": {"path": "/dev/null", "type": "CharDevice"}}],
        },
    }  # fmt: skip


def validate(client: Client, node: str, namespace: str, uuid: str, image: str, gates_file: str,
             timeout: float = TIMEOUT, host_network: bool = False) -> str:  # fmt: skip
    """Run the gate; write its verdict (the plugin gate's kept) and return its line."""
    name = pod_name(node)
    path = f"/api/v1/namespaces/{namespace}/pods/{name}"
    _delete(client, path)
    try:
        client.post(f"/api/v1/namespaces/{namespace}/pods", pod(node, namespace, uuid, image, host_network))
        verdict = _verdict(client, path, uuid, name, namespace, timeout)
    finally:
        _delete(client, path, wait=False)
    try:
        verdicts = gates.read(gates_file)
    except ValueError:
        verdicts = {}
    verdicts = {g: v for g, v in verdicts.items() if g != "toolkit"}
    try:
        gates.write(gates_file, {**verdicts, "toolkit": verdict})
    except OSError as e:
        raise PrerequisiteError(f"{gates_file}: cannot write the verdict ({e.strerror}): "
                                f"{gates.line('toolkit', verdict)}") from None  # fmt: skip
    return gates.line("toolkit", verdict)


def _verdict(client: Client, path: str, uuid: str, name: str, namespace: str, timeout: float) -> dict:
    fix = f"kubectl describe pod -n {namespace} {name}; oci-gpu-hook doctor on the node"
    deadline = time.monotonic() + timeout
    while True:
        status = client.get(path).get("status", {})
        if status.get("phase") in ("Succeeded", "Failed"):
            break
        if time.monotonic() > deadline:
            waiting = next((s.get("state", {}).get("waiting") for s in status.get("containerStatuses") or []), None)
            said = f"{waiting.get('reason')}: {waiting.get('message', '')}" if waiting else status.get("phase")
            return gates.verdict("failed", f"the validation pod did not finish in {timeout:.0f} s ({said})", fix)
        time.sleep(1)
    terminated = next((s.get("state", {}).get("terminated") for s in status.get("containerStatuses") or []), None) or {}
    try:
        got = json.loads(terminated.get("message") or "")
        uuids, devices = list(got["uuids"]), list(got["devices"])
    except (ValueError, KeyError, TypeError):
        why = terminated.get("message") or terminated.get("reason") or status.get("reason") or "no message"
        return gates.verdict("failed", f"the validation container said nothing readable ({why.strip()[:300]})", fix)
    if uuids == [uuid] and len(devices) == 1:
        return gates.verdict("passed")
    saw = f"GPUs {', '.join(uuids) or 'none'} and device nodes {', '.join(devices) or 'none'}"
    return gates.verdict("failed", f"the validation container asked for {uuid} and saw {saw}", fix)


def _delete(client: Client, path: str, wait: bool = True) -> None:
    try:
        client.request("DELETE", path + "?gracePeriodSeconds=0")
    except ApiError as e:
        if e.status == 404:
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
