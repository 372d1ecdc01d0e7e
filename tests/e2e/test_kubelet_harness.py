"""The Kubernetes test node itself (tests/kubeletcheck.py): a real kubelet on a real containerd, or
on a real CRI-O (tests/criocheck.py, the OpenShift node's path), runs pods that ask for no GPU
resource; the hook reaches app containers through containerd's base runtime spec or CRI-O's hooks.d;
a pod survives a kubelet restart, and closing the node leaves the host as it was (mounts,
processes, sysctls, cgroups)."""

import criocheck
import kubeletcheck
import pytest
from hookcheck import config_with


@pytest.fixture
def node_prerequisites(require):
    require("root", "runc", "busybox", "gcc")
    kubeletcheck.kubelet_binary()  # built once per machine; skips (fails under REQUIRE_ALL) without it


@pytest.mark.parametrize("runtime", ["containerd", "crio"])
def test_pods_run_survive_a_kubelet_restart_and_leave_nothing_behind(tmp_path, simulated_host, require,
                                                                     node_prerequisites, runtime):  # fmt: skip
    host = simulated_host(gpus=1)
    if runtime == "crio":
        require("podman", "conmon")
        criocheck.programs()
    node = {"containerd": kubeletcheck.ContainerdKubelet, "crio": criocheck.CrioKubelet}[runtime](
        tmp_path / "node", config_with(host, tmp_path, "")
    )
    with kubeletcheck.running(node):  # and the host is as it was after it
        node.add_pod("hello", "echo hello; sleep 3600", limits={})
        # No device plugin here: the variable alone asks the hook for the GPU (what an image may do).
        node.add_pod("smi", "sleep 3600", limits={}, env={"NVIDIA_VISIBLE_DEVICES": "all"})
        node.wait_for_phase("hello", "Running")
        assert node.wait_for_log("hello", "hello") == "hello\n"

        init = node.exec("hello", ["cat", "/proc/1/cmdline"])
        assert init.stdout == "sleep\x003600\x00", init.stderr  # busybox sh execs its last command
        said = node.exec("hello", ["echo", "hi"])
        assert (said.returncode, said.stdout) == (0, "hi\n"), said.stderr
        pid = node.container_pid("hello")
        with open(f"/proc/{pid}/cmdline") as f:
            assert f.read() == init.stdout
        assert "nvidia.com/gpu" not in node.allocatable()  # no plugin runs

        node.wait_for_phase("smi", "Running")
        # containerd's base spec puts the hook at prestart; CRI-O runs a hooks.d prestart hook at
        # createRuntime (the same moment, in the runtime's namespace).
        stage = {"containerd": "prestart", "crio": "createRuntime"}[runtime]
        assert [h["args"][-1] for h in node.oci_spec("smi")["hooks"][stage]] == ["prestart"]
        listed = node.exec("smi", ["nvidia-smi", "-L"])
        assert listed.returncode == 0 and host["gpus"][0]["uuid"] in listed.stdout, listed.stderr
        assert node.exec("hello", ["ls", "/dev"]).stdout.split().count("nvidia0") == 0

        node.restart_kubelet()
        assert node.wait_for_phase("hello", "Running")["status"]["phase"] == "Running"
        assert node.container_pid("hello") == pid

        node.remove_pod("hello")
        assert node.pod("hello") is None
