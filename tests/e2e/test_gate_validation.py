"""Gate toolkit on a real cluster (node/gate_validation.py; issue 47): `oci-gpu-hook toolkit
validate` makes a pod on the node that asks for one GPU the way the device plugin's volume-mounts
answer does, runs the node image's `toolkit workload` through the node's own runtime (containerd
with the hook, tests/kubecheck.py), and judges what it got from the pod's status.
- With the hook as docs/deploy.md sets it (accept_volume_mounts): exactly the GPU asked for, the
  gate passes, the verdict is in the gates' file, and the pod is gone.
- With the hook told not to read the mounts (its configuration changed under it): the container
  gets no GPU, the gate fails with what it saw, and `toolkit report` puts that line on the Node.
The credentials are a service account's, with only the pods and Node rights the two commands use.
The cluster has no pod network: the pod runs in the node's (--host-network).
"""

from __future__ import annotations

import subprocess

import kubecheck
from imagecheck import build

from oci_gpu_hook.node import gates
from oci_gpu_hook.start import settings
from oci_gpu_hook.toolkit.containers import hook_command

NAMESPACE = "oci-gpu-hook"
IMAGE = "localhost/oci-gpu-hook-node:0.1.0"
RBAC = kubecheck.toolkit_rbac(NAMESPACE, "toolkit", pods=True)


def test_the_toolkit_gate_passes_for_a_working_hook_and_fails_with_what_it_saw(simulated_host, tmp_path, require):
    require("root", "openssl", "containerd", "runc")
    host = simulated_host(gpus=2)
    records = tmp_path / "run" / "containers"
    hook_settings = (
        f"records_directory: {records}\naccept_volume_mounts: true\naccept_envvar_when_unprivileged: false\n"
    )
    uuid = host["gpus"][1]["uuid"]
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

        gates_file = gates.gates_path(settings.load(config).records_path)
        out = toolkit("validate", "--node", cluster.node_name, "--image", IMAGE, "--gpu", uuid, "--host-network")
        assert (out.returncode, out.stdout) == (0, "gate toolkit passed\n"), out.stdout + out.stderr
        assert gates.read(gates_file)["toolkit"]["state"] == "passed"
        assert cluster.get("pods", "-n", NAMESPACE)["items"] == []  # the validation pod is gone
        # The hook no longer reads the device plugin's mounts: the same request gets nothing.
        with open(config) as f:
            text = f.read()
        with open(config, "w") as f:
            f.write(text.replace("accept_volume_mounts: true", "accept_volume_mounts: false"))
        out = toolkit("validate", "--node", cluster.node_name, "--image", IMAGE, "--gpu", uuid, "--host-network")
        assert out.returncode == 0, out.stderr
        line = (f"gate toolkit failed: the validation container asked for {uuid} and saw GPUs none and device "
                f"nodes none (fix: kubectl describe pod -n {NAMESPACE} gate-toolkit-{cluster.node_name}; "
                "oci-gpu-hook doctor on the node)")  # fmt: skip
        assert out.stdout == line + "\n", out.stdout
        out = toolkit("report", "--node", cluster.node_name)
        assert out.returncode == 0, out.stderr
        (ready,) = [c for c in cluster.node()["status"]["conditions"] if c["type"] == "GPUHookReady"]
        assert (ready["status"], ready["message"]) == ("False", line)
