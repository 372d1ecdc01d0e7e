"""MPS sharing and IMEX channels through `oci-gpu-hook device-plugin` and a real kubelet
(Kubernetes 1.32's device manager) on Debian's containerd, whose base runtime spec gives every app
container the hook, on a simulated host with 2 A100-40GB GPUs (tests/kubeletcheck.py runs the node).

- sharing.mps, 2 replicas: the plugin starts the MPS control daemon (the simulator's stand-in
  with the real program's interface) and sets its defaults (20480M per GPU, 50% of the threads);
  the kubelet's Allocate for a replica gives the pod CUDA_MPS_PIPE_DIRECTORY and its limits, the
  daemon's pipe directory (the pod's own nvidia-cuda-mps-control reaches the daemon through it)
  and the daemon's /dev/shm, through the links the runtime resolves to the daemon's generation; a
  pod that quits the daemon has it started again in a new generation, which the next pod reaches;
  stopping the plugin quits the daemon.
- imex.channelIDs [1]: a pod given a GPU also gets /dev/nvidia-caps-imex-channels/channel1 (the
  major /proc/devices gives nvidia-caps-imex-channels, minor 1), usable (the device cgroup lets
  it through), and not channel0.
"""

import os
import shutil
import tempfile
import time

import kubeletcheck
import pytest
from hookcheck import config_with

from oci_gpu_hook.node.plugin import mps

MIB = 1 << 20


@pytest.fixture(scope="module")
def cluster(simulated_host, require, tmp_path_factory):
    require("root", "runc", "busybox", "gcc")
    kubeletcheck.kubelet_binary()
    host = simulated_host(gpus=2)
    tmp = tmp_path_factory.mktemp("k8s-mps")
    hook_config = config_with(host, tmp, "")
    with kubeletcheck.running(kubeletcheck.ContainerdKubelet(tmp / "node", hook_config)) as node:
        yield node, host, hook_config, tmp


def daemon_record(host) -> list:
    """What every simulated MPS control daemon was told, in order (SIM_ROOT/mps-control.log)."""
    try:
        with open(os.path.join(host["root"], "mps-control.log")) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def test_mps_replicas_daemon_defaults_and_the_clients_answer(cluster):
    node, host, hook_config, tmp = cluster
    root = tempfile.mkdtemp(prefix="mps-", dir="/tmp")  # short: the daemon's socket paths have 107 bytes
    pipe = os.path.join(root, "nvidia.com/gpu/pipe")
    doc = {"version": "v1", "flags": {"mpsRoot": root, "plugin": {"deviceListStrategy": "envvar"}},
           "sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}}  # fmt: skip
    before = len(daemon_record(host))
    share = host["gpus"][0]["model"]["memory_total"] // 2 // MIB
    assert share == 20480
    plugin = kubeletcheck.DevicePlugin(hook_config, node, tmp, doc, "plugin-mps")
    try:
        node.wait_for_resource("nvidia.com/gpu", 4)
        # The daemon got its defaults through its stdin commands before the resource was offered,
        # in its generation, which the clients' pipe link names.
        first = os.path.realpath(pipe)
        assert os.path.dirname(os.path.dirname(first)) == os.path.join(root, "nvidia.com/gpu"), first
        told = [line for line in daemon_record(host)[before:] if line.startswith(first + " ")]
        assert [line[len(first) + 1 :] for line in told if "Cmd:" in line] == [
            f"Cmd:set_default_device_pinned_mem_limit 0 {share}M",
            f"Cmd:set_default_device_pinned_mem_limit 1 {share}M",
            "Cmd:set_default_active_thread_percentage 50",
        ], told
        assert os.path.exists(os.path.join(pipe, "control"))
        # The daemon's /dev/shm is its generation's, which the resource's shm link names, not the host's.
        assert os.path.exists(os.path.join(root, "nvidia.com/gpu/shm", "cuda.shm.sim"))
        assert not os.path.exists("/dev/shm/cuda.shm.sim")

        show = (
            'echo "pipe=$CUDA_MPS_PIPE_DIRECTORY mem=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT '
            'threads=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"; ls /dev/shm; '
            "echo get_default_active_thread_percentage | nvidia-cuda-mps-control; echo done; sleep 3600"
        )
        node.add_pod("mps-a", show, limits={"nvidia.com/gpu": 1})
        node.wait_for_phase("mps-a", "Running")
        log = node.wait_for_log("mps-a", "done")
        assert f"pipe={mps.CONTAINER_ROOT}/nvidia.com/gpu/pipe mem=0={share}M threads=50\n" in log, log
        assert "cuda.shm.sim\n" in log, log  # the daemon's /dev/shm
        assert "50.0\n" in log, log  # the pod's own control program reached the daemon through the pipe
        assert daemon_record(host)[-1] == f"{first} Cmd:get_default_active_thread_percentage"
        # failRequestsGreaterThanOne is on for MPS unless the file says otherwise (as NVIDIA's).
        node.add_pod("mps-two", "sleep 3600", limits={"nvidia.com/gpu": 2})
        refused = node.wait_for_phase("mps-two", "Failed")["status"]
        assert refused.get("reason") == "UnexpectedAdmissionError", refused
        # A client pod (root in its container) quits the shared daemon: the plugin's next round
        # starts it again in a new generation, and a pod created then reaches that one (the
        # runtime resolved the links when it made the container), with a /dev/shm of its own.
        quit = "echo quit | nvidia-cuda-mps-control; echo x > /dev/shm/left-by-mps-quit; echo done; sleep 3600"
        node.add_pod("mps-quit", quit, limits={"nvidia.com/gpu": 1})
        node.wait_for_log("mps-quit", "done")
        deadline = time.monotonic() + 60  # a hang guard only
        while os.path.realpath(pipe) == first or not os.path.exists(os.path.join(pipe, "control")):
            assert time.monotonic() < deadline, plugin.output()
            time.sleep(0.2)
        second = os.path.realpath(pipe)
        assert not os.path.exists(first)  # the quit daemon's generation went
        node.add_pod("mps-b", show, limits={"nvidia.com/gpu": 1})
        log = node.wait_for_log("mps-b", "done")
        assert "50.0\n" in log and "left-by-mps-quit" not in log, log
        assert daemon_record(host)[-1] == f"{second} Cmd:get_default_active_thread_percentage"
        for name in ("mps-a", "mps-two", "mps-quit", "mps-b"):
            node.remove_pod(name)
    finally:
        assert plugin.stop() == 0, plugin.output()
    assert daemon_record(host)[-2:] == [f"{second} Cmd:quit", f"{second} Exit with status 0"]
    assert not os.path.exists(os.path.join(pipe, "control"))
    output = plugin.log_path.read_text()
    assert "nvidia.com/gpu: MPS daemon stopped" in output and "the MPS daemon is gone" in output, output
    shutil.rmtree(root)


def test_imex_channel_reaches_the_pod(cluster):
    node, host, hook_config, tmp = cluster
    doc = {"version": "v1", "imex": {"channelIDs": [1], "required": True}}
    major = host["imex_major"]
    plugin = kubeletcheck.DevicePlugin(hook_config, node, tmp, doc, "plugin-imex")
    try:
        node.wait_for_resource("nvidia.com/gpu", 2)
        show = (
            "ls -ln /dev/nvidia-caps-imex-channels; echo $NVIDIA_IMEX_CHANNELS; "
            "cat /dev/nvidia-caps-imex-channels/channel1; echo done; sleep 3600"
        )
        node.add_pod("imex", show, limits={"nvidia.com/gpu": 1})
        node.wait_for_phase("imex", "Running")
        log = node.wait_for_log("imex", "done")
        lines = [line.split() for line in log.splitlines() if line.startswith("crw")]
        # c<mode> 1 0 0 <major>, <minor> <date...> channel1: the one channel, with the host's numbers.
        assert [(line[4], line[5], line[-1]) for line in lines] == [(f"{major},", "1", "channel1")], log
        assert "\n1\n" in log, log
        # Opening it reaches the (absent) driver, not the device cgroup's refusal.
        assert "No such device or address" in log and "Operation not permitted" not in log, log
        node.remove_pod("imex")
    finally:
        assert plugin.stop() == 0, plugin.output()
