"""`oci-gpu-hook toolkit report` against a real API server (node/gate_report.py, node/kubeapi.py;
issue 47): the gates' verdicts said on a Node as operators see them. The control plane of
../shared/tools/kube alone (tests/kubecheck.py), a Node object made through the API, and a
service account whose ClusterRole allows exactly what the report does (get and patch Nodes, patch
their status, create events): its token is what the command uses, as a pod's would be.
- A failed gate: a label per gate, GPUHookReady False with the gate's line and its fix, a
  Warning event naming it; `kubectl describe node` shows the condition's message and the event.
- Reported again unchanged: no new event, no new label. Failed again for another reason: a new
  Warning event with the new line, no label moved.
- Every gate passed: GPUHookReady True, and events for the gates that changed.
- The token cannot do more than that ClusterRole allows (it cannot delete the Node).
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import kubecheck
from hookcheck import config_with

from oci_gpu_hook.node import gates
from oci_gpu_hook.start import settings
from oci_gpu_hook.toolkit.containers import hook_command

NODE = "gpu-node-a"
NAMESPACE = "oci-gpu-hook"
# What the report needs, and no more (kubecheck.toolkit_rbac), and the Node.
RBAC = kubecheck.toolkit_rbac(NAMESPACE, "reporter") + [
    {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}}},
]


def test_the_gates_verdicts_are_said_on_the_node(simulated_host, tmp_path, require):
    require("root", "openssl")
    host = simulated_host(gpus=1)
    config = config_with(host, tmp_path, "")
    path = gates.gates_path(settings.load(config).records_path)
    with kubecheck.control_plane(tmp_path / "cp") as cluster:
        cluster.apply(*RBAC)
        token = tmp_path / "token"
        token.write_text(cluster.kubectl("create", "token", "reporter", "-n", NAMESPACE).stdout.strip())

        def report():
            return subprocess.run([*hook_command(config), "toolkit", "report", "--node", NODE, "--api-server",
                                   f"https://127.0.0.1:{kubecheck.API_PORT}", "--token-file", str(token), "--ca-file",
                                   f"{cluster.pki}/ca.crt"], capture_output=True, text=True, timeout=120)  # fmt: skip

        def events():
            found = cluster.get("events.events.k8s.io", "-A")["items"]
            return sorted((e["reason"], e["note"], e["type"]) for e in found if e["regarding"]["name"] == NODE)

        why, fix = "containerd ran no hook for the validation container", "oci-gpu-hook doctor on the node"
        gates.write(path, {"toolkit": gates.verdict("failed", why, fix)})
        out = report()
        assert out.returncode == 0, out.stderr
        node = cluster.get("node", NODE)
        labels = node["metadata"]["labels"]
        assert labels["oci-gpu-hook.io/gate.toolkit"] == "failed" and labels["oci-gpu-hook.io/gate.plugin"] == "pending"
        (ready,) = [c for c in node["status"]["conditions"] if c["type"] == "GPUHookReady"]
        line = f"gate toolkit failed: {why} (fix: {fix})"
        assert (ready["status"], ready["reason"], ready["message"]) == ("False", "GateToolkitFailed", line)
        assert events() == [("GatePluginPending", "gate plugin pending", "Normal"),
                            ("GateToolkitFailed", line, "Warning")]  # fmt: skip
        described = cluster.kubectl("describe", "node", NODE).stdout
        events_part = described[described.index("Events:") :]  # the events, not the condition's reason
        assert line in described and re.search(r"Warning\s+GateToolkitFailed", events_part), described
        assert report().stdout == ""  # nothing changed: nothing said, no new event
        assert len(events()) == 2
        # Failed still, for another reason: no label moves, and a new event says the new line.
        other = "install on the host failed: no containerd"
        gates.write(path, {"toolkit": gates.verdict("failed", other, fix)})
        assert report().returncode == 0
        assert ("GateToolkitFailed", f"gate toolkit failed: {other} (fix: {fix})", "Warning") in events()
        assert len(events()) == 3
        gates.write(path, {"toolkit": gates.verdict("passed"), "plugin": gates.verdict("passed")})
        out = report()
        assert out.returncode == 0, out.stderr
        (ready,) = [c for c in cluster.get("node", NODE)["status"]["conditions"] if c["type"] == "GPUHookReady"]
        assert (ready["status"], ready["message"]) == ("True", "gates passed: toolkit, plugin")
        assert [e[0] for e in events()] == ["GatePluginPassed", "GatePluginPending", "GateToolkitFailed",
                                            "GateToolkitFailed", "GateToolkitPassed"]  # fmt: skip
        # A verdicts file that cannot be trusted: the plugin withdraws the GPUs, and the Node says so.
        os.chmod(path, 0o666)
        out = report()
        assert out.returncode != 0 and "cannot be trusted" in out.stderr, out.stderr
        (ready,) = [c for c in cluster.get("node", NODE)["status"]["conditions"] if c["type"] == "GPUHookReady"]
        assert (ready["status"], ready["reason"]) == ("False", "GatesUntrusted"), ready
        # The token can do what the report does, and nothing more.
        denied = subprocess.run([cluster.bin["kubectl"], "--kubeconfig=/dev/null", "--server",
                                 f"https://127.0.0.1:{kubecheck.API_PORT}", "--certificate-authority",
                                 f"{cluster.pki}/ca.crt", "--token", token.read_text(), "delete", "node", NODE],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert denied.returncode != 0 and "forbidden" in denied.stderr, denied.stderr
        assert json.loads(cluster.kubectl("get", "node", NODE, "-o", "json").stdout)["metadata"]["name"] == NODE
