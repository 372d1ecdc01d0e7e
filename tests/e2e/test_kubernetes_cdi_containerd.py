"""The CDI answers on containerd (issue 39, item 7): the kubelet on a real containerd 1.7 (Debian
13's, which applies CDI: `enable_cdi`, its specs in the node's cdi_dir), the hook in its base spec,
and the project's `device-plugin` answering Allocate with CDI devices, on a simulated host with 2
GPUs, time-sliced 2 ways with a memory share each. containerd applies the devices from the spec
`cdi generate` wrote, and the hook, which it runs too, gives nothing but still records each
replica, marked as applied by the runtime, with its share: so the real watchdog kills the replica
over its share, and the real exporter names the pods. CRI-O's side: test_kubernetes_crio.
"""

import os
import subprocess

import kubeletcheck
import pytest
from hookcheck import config_with, listed_uuids

from oci_gpu_hook.start import container_record
from oci_gpu_hook.toolkit.containers import hook_command

SHOW = "nvidia-smi -L; ls /dev; sleep 3600"


@pytest.fixture(scope="module")
def node(simulated_host, require, tmp_path_factory):
    """(node, host, hook config, records directory, tmp dir); the host is checked afterwards."""
    require("root", "runc", "busybox", "gcc", "curl", "dpkg-deb")
    kubeletcheck.kubelet_binary()
    containerd = kubeletcheck.containerd17()
    host = simulated_host(gpus=2)
    tmp = tmp_path_factory.mktemp("k8s-cdi")
    records = tmp / "records"
    hook_config = config_with(host, tmp, f"records_directory: {records}\n")
    node = kubeletcheck.ContainerdKubelet(tmp / "node", hook_config, containerd_bin=containerd, cdi=True)
    with kubeletcheck.running(node):
        yield node, host, hook_config, str(records), tmp


def record_of(records: str, container_id: str):
    return next((r for r in container_record.read_all(records).values() if r and r["id"] == container_id), None)


@pytest.mark.parametrize("strategy", ["cdi-cri", "cdi-annotations"])
def test_a_cdi_replica_over_its_share_is_killed_and_its_pod_named(node, strategy):
    """Before item 7 the hook stood down where the runtime had applied the devices and wrote no
    record: the watchdog and the exporter saw neither pod."""

    from oci_gpu_hook.toolkit.simulate import control

    node, host, hook_config, records, tmp = node
    spec = os.path.join(node.cdi_dir, "oci-gpu-hook.yaml")
    out = subprocess.run([*hook_command(hook_config), "cdi", "generate", "--output", spec], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = {"flags": {"plugin": {"deviceListStrategy": strategy}},
           "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2,
                                                      "memoryLimit": "per-replica"}]}}}  # fmt: skip
    plugin = kubeletcheck.DevicePlugin(hook_config, node, tmp, doc, f"plugin-{strategy}")
    names = (f"{strategy}-over", f"{strategy}-under")
    try:
        node.wait_for_resource("nvidia.com/gpu", 4)
        for name in names:
            node.add_pod(name, SHOW, limits={"nvidia.com/gpu": 1})
        held = {}
        for name in names:
            node.wait_for_phase(name, "Running")
            held[name] = listed_uuids(node.wait_for_log(name, "UUID"))
        assert all(len(u) == 1 for u in held.values()), held
        pids = {name: node.container_pid(name) for name in names}
        totals = {g["uuid"]: g["model"]["memory_total"] for g in host["gpus"]}
        for name in names:
            (uuid,) = held[name]
            spec_of = node.oci_spec(name)
            minor = next(g["minor"] for g in host["gpus"] if g["uuid"] == uuid)
            # containerd put the GPU's node in linux.devices (from the CDI spec); the hook, its
            # prestart hook, recorded the replica with its share and marked it so.
            assert f"/dev/nvidia{minor}" in {d["path"] for d in spec_of["linux"].get("devices", [])}, spec_of
            record = record_of(records, node.container_id(name))
            assert record is not None, os.listdir(records) if os.path.isdir(records) else records
            assert (record["applied_by"], record["pid"]) == ("runtime", pids[name]), record
            assert record["gpu_memory_limit"] == {uuid: totals[uuid] // 2}, record
            assert record["kubernetes"]["pod"] == node.full_name(name), record
        kubeletcheck.over_share_is_named_and_killed(node, host, hook_config, tmp, pids, held, totals, *names)
    finally:
        control.clear(host["root"])
        for name in names:
            if node.pod(name) is not None:
                node.remove_pod(name)
        assert plugin.stop() == 0, plugin.output()
        os.unlink(spec)
