"""The device plugin's topology and XID health with a real kubelet (tests/kubeletcheck.py: the
kubelet's device manager asks GetPreferredAllocation, counts healthy devices for admission, and
checkpoints what each container got) on a simulated host whose GPUs 0+2 and 1+3 share a PCIe
switch, and on which a test injects XIDs through the simulated NVML's events (nvmlevents.inject_xid).

- A pod asking for two GPUs gets a pair under one switch (NVML order would give GPUs 0 and 1),
  and the next such pod the other pair.
- XID 79 takes its GPU out of what the kubelet may allocate within seconds; an application's XID
  (13) does not. The GPU is allocatable again once it has gone and come back.
"""

import os
import time

import kubeletcheck
import nvmlevents
import pytest
from hookcheck import config_with, listed_uuids

SHOW = "nvidia-smi -L; sleep 3600"
PLUGIN = {"version": "v1"}
XID_DEADLINE = 10  # seconds: "within seconds" (the plugin is told at once; the kubelet logs it at once)


@pytest.fixture(scope="module")
def node(simulated_host, require, tmp_path_factory):
    require("root", "runc", "busybox", "gcc")
    kubeletcheck.kubelet_binary()
    host = simulated_host(gpus=4, pcie_switches="0+2,1+3")
    tmp = tmp_path_factory.mktemp("k8s-topology")
    hook_config = config_with(host, tmp, f"records_directory: {tmp / 'records'}\n")
    with kubeletcheck.running(kubeletcheck.ContainerdKubelet(tmp / "node", hook_config)) as node:
        plugin = kubeletcheck.DevicePlugin(hook_config, node, tmp, PLUGIN, "plugin")
        try:
            node.wait_for_resource("nvidia.com/gpu", 4)
            yield node, host, plugin
        finally:
            nvmlevents.clear_events(host["root"])
            assert plugin.stop() == 0, plugin.output()


def switch_pairs(host) -> set:
    """{frozenset of the uuids of GPUs under one switch}, from the simulator's description."""
    pairs: dict = {}
    for gpu in host["gpus"]:
        pairs.setdefault(gpu["pcie_switch"], set()).add(gpu["uuid"])
    return {frozenset(p) for p in pairs.values()}


def test_two_gpus_come_from_one_pcie_switch(node):
    node, host, plugin = node
    pairs = switch_pairs(host)
    assert pairs == {frozenset((host["gpus"][0]["uuid"], host["gpus"][2]["uuid"])),
                     frozenset((host["gpus"][1]["uuid"], host["gpus"][3]["uuid"]))}  # fmt: skip
    got = []
    try:
        for name in ("pair-a", "pair-b"):
            node.add_pod(name, SHOW, limits={"nvidia.com/gpu": 2})
            node.wait_for_phase(name, "Running")
            (ids,) = node.allocated_devices(name).values()  # the kubelet's checkpoint
            assert frozenset(ids) in pairs, (name, ids, host["gpus"])
            assert sorted(listed_uuids(node.wait_for_log(name, "UUID"))) == sorted(ids)  # what the pod sees
            got.append(frozenset(ids))
        assert set(got) == pairs  # the second pod: the other switch's pair
    finally:
        for name in ("pair-a", "pair-b"):
            node.remove_pod(name)


def test_a_critical_xid_takes_its_gpu_out_of_allocatable(node):
    node, host, plugin = node
    gpu0, gpu1 = host["gpus"][0], host["gpus"][1]
    deadline = time.monotonic() + 30
    while "XID health: waiting on NVML events" not in plugin.output():
        assert time.monotonic() < deadline, plugin.output()
        time.sleep(0.1)
    node.wait_for_resource("nvidia.com/gpu", 4)
    nvmlevents.inject_xid(host["root"], gpu0["uuid"], 13)  # an application's error: not the GPU's
    nvmlevents.inject_xid(host["root"], gpu1["uuid"], 79)  # fell off the bus
    node.wait_for_resource("nvidia.com/gpu", 3, timeout=XID_DEADLINE)
    assert f"XID 13 on {gpu0['uuid']}: not critical here" in plugin.output()
    assert f"Unhealthy: {gpu1['uuid']}: XID 79" in plugin.output()
    assert f"Unhealthy: {gpu0['uuid']}" not in plugin.output()
    assert node.capacity()["nvidia.com/gpu"] == 4  # still there: unhealthy, not gone
    name = "three"
    try:
        node.add_pod(name, SHOW, limits={"nvidia.com/gpu": 3})  # every GPU the kubelet may give
        node.wait_for_phase(name, "Running")
        (ids,) = node.allocated_devices(name).values()
        assert sorted(ids) == sorted(g["uuid"] for g in host["gpus"] if g is not gpu1)
    finally:
        node.remove_pod(name)
    # The GPU goes (its node disappears, as when it falls off the bus) and comes back: allocatable.
    path = os.path.join(host["root"], "dev", f"nvidia{gpu1['minor']}")
    aside = path + ".aside"
    os.rename(path, aside)
    try:
        deadline = time.monotonic() + 30
        while f"{gpu1['uuid']}: its GPU is gone" not in plugin.output():
            assert time.monotonic() < deadline, plugin.output()
            time.sleep(0.1)
    finally:
        os.rename(aside, path)
    node.wait_for_resource("nvidia.com/gpu", 4)
