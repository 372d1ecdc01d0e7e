"""The validation gates in order on a real cluster (node/gate_validation.py; issue 47), the node's
containerd running the hook (tests/kubecheck.py), the project's device plugin following the gates'
file (`--gate`), as the rollout will run them:
- (b) before anything passed, the plugin offers nothing: no nvidia.com/gpu on the Node;
- (a) `toolkit validate`: a pod on the node asks for one GPU as the plugin's volume-mounts
  answer does and gets exactly it, through the node's own runtime; the pod is gone after;
- the plugin then registers and the Node advertises the GPUs;
- (c) `toolkit validate --gate plugin`: a pod that asks the scheduler for nvidia.com/gpu: 1 gets
  one of the node's GPUs; `toolkit report` says GPUHookReady True on the Node;
- with the hook told not to read the mounts (its configuration changed under it), gate toolkit
  fails with what the container saw, the plugin withdraws every GPU (allocatable 0), and the
  Node's condition says the gate's line.
The credentials are a service account's, with only the pods and Node rights the commands use.
The cluster has no pod network: the pods run in the node's (--host-network).
"""

from __future__ import annotations

import subprocess

import kubecheck
import kubeletcheck
from imagecheck import build

from oci_gpu_hook.node import gates
from oci_gpu_hook.start import settings
from oci_gpu_hook.toolkit.containers import hook_command

NAMESPACE = "oci-gpu-hook"
IMAGE = "localhost/oci-gpu-hook-node:0.1.0"
PLUGIN = {"flags": {"migStrategy": "none", "plugin": {"deviceListStrategy": "volume-mounts"}}}
RBAC = kubecheck.toolkit_rbac(NAMESPACE, "toolkit", pods=True)


def test_the_gates_in_order_and_a_failure_that_withdraws_the_gpus(simulated_host, tmp_path, require):
    require("root", "openssl", "containerd", "runc", "pynvml")
    host = simulated_host(gpus=2)
    records = tmp_path / "run" / "containers"
    hook_settings = (f"records_directory: {records}\naccept_volume_mounts: true\n"
                     "accept_envvar_when_unprivileged: false\n")  # fmt: skip
    uuids = [g["uuid"] for g in host["gpus"]]
    with kubecheck.cluster_on(host, tmp_path, hook_settings) as cluster:
        out = build(tmp_path / "node.tar", tmp_path / "build")
        assert out.returncode == 0, out.stderr
        cluster.ctr("images", "import", str(tmp_path / "node.tar"))
        cluster.apply(*RBAC)
        token = tmp_path / "token"
        token.write_text(cluster.kubectl("create", "token", "toolkit", "-n", NAMESPACE).stdout.strip())
        config = cluster.hook_config
        api = ["--api-server", f"https://127.0.0.1:{kubecheck.API_PORT}", "--token-file", str(token), "--ca-file",
               f"{cluster.pki}/ca.crt"]  # fmt: skip

        def toolkit(*args):
            return subprocess.run([*hook_command(config), "toolkit", *args, *api], capture_output=True, text=True,
                                  timeout=300)  # fmt: skip

        def validate(gate, *more):
            return toolkit("validate", "--gate", gate, "--node", cluster.node_name, "--image", IMAGE, "--host-network",
                           "--timeout", "60", *more)  # fmt: skip

        gates_file = gates.gates_path(settings.load(config).records_path)
        # (b) The device plugin, following the gates: nothing is offered before gate toolkit passes.
        plugin = kubeletcheck.DevicePlugin(config, cluster, tmp_path, PLUGIN, "plugin", ("--gate", gates_file))
        try:
            cluster.wait_until(lambda: "waiting for gate toolkit to pass" in plugin.output(), 60, "the plugin waiting")
            assert cluster.node_gpus() in (None, "0") and plugin.registrations() == 0
            # (a) Gate toolkit, through the node's runtime: exactly the GPU asked for.
            out = validate("toolkit", "--gpu", uuids[1])
            assert (out.returncode, out.stdout) == (0, "gate toolkit passed\n"), out.stdout + out.stderr
            assert cluster.get("pods", "-n", NAMESPACE)["items"] == []  # the validation pod is gone
            cluster.wait_until(lambda: cluster.node_gpus() == "2", 60, "the GPUs advertised once gate toolkit passed")
            # (c) Gate plugin, through the scheduler and the device plugin: one of the node's GPUs.
            out = validate("plugin")
            assert (out.returncode, out.stdout) == (0, "gate plugin passed\n"), out.stdout + out.stderr
            out = toolkit("report", "--node", cluster.node_name)
            assert out.returncode == 0, out.stderr
            ready = cluster.hook_condition()
            assert (ready.get("status"), ready.get("message")) == ("True", "gates passed: toolkit, plugin"), ready
            # The hook no longer reads the device plugin's mounts: gate toolkit fails with what the
            # container saw, the plugin withdraws every GPU, and the Node says why.
            with open(config) as f:
                text = f.read()
            with open(config, "w") as f:
                f.write(text.replace("accept_volume_mounts: true", "accept_volume_mounts: false"))
            out = validate("toolkit", "--gpu", uuids[1])
            assert out.returncode == 0, out.stderr
            line = (f"gate toolkit failed: the validation container asked for {uuids[1]} and saw GPUs none and "
                    f"device nodes none (fix: kubectl describe pod -n {NAMESPACE} gate-toolkit-{cluster.node_name}; "
                    "oci-gpu-hook doctor on the node)")  # fmt: skip
            assert out.stdout == line + "\n", out.stdout
            cluster.wait_until(lambda: cluster.node_gpus() == "0", 60, "the GPUs withdrawn once gate toolkit failed")
            out = toolkit("report", "--node", cluster.node_name)
            assert out.returncode == 0, out.stderr
            ready = cluster.hook_condition()
            assert (ready.get("status"), ready.get("message")) == ("False", line), ready
            assert plugin.registrations() == 1  # registered once, withdrawn by health
        finally:
            plugin.stop()
