"""A round of `toolkit rollout` (node/rollout.py) that cannot run, against a real API server: the
control plane of ../shared/tools/kube alone (tests/kubecheck.py), a Node made through the API,
and a service account with the toolkit's rights (kubecheck.toolkit_rbac). Each failure before
the validation pod is a failed gate toolkit, with its line, said on the Node; none leaves an
older verdict standing, and none ends the loop:
- the Node's kubelet reports no runtime (a Node made by hand has no nodeInfo);
- install cannot run (here, not from the node image's bundle: toolkit/host.py refuses);
- the node's inventory cannot be read (a driver root with nothing in it: no driver loaded).
A failure for another reason is a new Warning event, though no label moves.
"""

from __future__ import annotations

import kubecheck
from hookcheck import config_with

from oci_gpu_hook.node import gate_report, gates
from oci_gpu_hook.node.kubeapi import Client
from oci_gpu_hook.node.rollout import Rollout
from oci_gpu_hook.start import inventory_cache, settings
from oci_gpu_hook.toolkit import host as host_module

NODE = "gpu-node-r"
NAMESPACE = "oci-gpu-hook"
RBAC = kubecheck.toolkit_rbac(NAMESPACE, "toolkit", pods=True) + [
    {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}},
]


def test_a_round_that_cannot_run_fails_gate_toolkit_with_its_line(simulated_host, tmp_path, require):
    require("root", "openssl")
    host = simulated_host(gpus=1)
    config = config_with(host, tmp_path, "")
    empty = tmp_path / "no-driver"
    empty.mkdir()
    (tmp_path / "nodriver").mkdir()
    no_driver = config_with(host, tmp_path / "nodriver", f"driver_root: {empty}\ndev_root: {empty}\n"
                                                        f"proc_root: {empty}\n")  # fmt: skip
    gates_file = gates.gates_path(settings.load(config).records_path)
    with kubecheck.control_plane(tmp_path / "cp") as cluster:
        cluster.apply(*RBAC)
        token = tmp_path / "token"
        token.write_text(cluster.kubectl("create", "token", "toolkit", "-n", NAMESPACE).stdout.strip())
        client = Client(f"https://127.0.0.1:{kubecheck.API_PORT}", str(token), f"{cluster.pki}/ca.crt")
        said = []

        def round_with(install, runtime=None, with_config=config):
            Rollout(client, NODE, NAMESPACE, None, "localhost/oci-gpu-hook-node:0.1.0", gates_file,
                    lambda: inventory_cache.load(settings.load(with_config)), install, None, said.append,
                    runtime).round()  # fmt: skip
            verdicts = gates.read(gates_file)
            assert verdicts["plugin"]["state"] == "pending", verdicts
            assert verdicts["toolkit"]["state"] == "failed", verdicts
            (ready,) = [c for c in cluster.get("node", NODE)["status"]["conditions"]
                        if c["type"] == gate_report.CONDITION]  # fmt: skip
            line = gates.line("toolkit", verdicts["toolkit"])
            assert (ready["status"], ready["reason"], ready["message"]) == ("False", "GateToolkitFailed", line)
            assert line in said, said
            return verdicts["toolkit"]["why"]

        # An older pass must not stand for a round that could not run.
        gates.write(gates_file, {"toolkit": gates.verdict("passed"), "plugin": gates.verdict("passed")})
        why = round_with(lambda runtime: [])
        assert why.startswith("the node's runtime is not reported: the toolkit installs for containerd and"), why

        def install(runtime):
            return host_module.install(str(tmp_path / "host"), [runtime])

        why = round_with(install, runtime="containerd")
        assert why.startswith("install on the host failed: toolkit: runs from the node image's bundle"), why
        why = round_with(None, with_config=no_driver)
        assert why == f"{empty}/proc/driver/nvidia/version: not found: the NVIDIA kernel driver is not loaded", why
        found = cluster.get("events.events.k8s.io", "-A")["items"]
        failures = [e["note"] for e in found if e["reason"] == "GateToolkitFailed" and e["regarding"]["name"] == NODE]
        assert len(failures) == 3, failures  # one per reason, though the label stayed "failed"
