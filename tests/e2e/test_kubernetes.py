"""`oci-gpu-hook device-plugin` with a real kubelet (Kubernetes 1.32's device manager, admission and
CRI code) and Debian's containerd, whose base runtime spec gives every app container the hook, on
a simulated host with 4 GPUs, the last one in MIG mode (tests/kubeletcheck.py runs the node).

Two plugin configurations, one node:
- mixed MIG strategy, the environment variable: `nvidia.com/gpu: 1` pods each see exactly one
  distinct GPU, a `nvidia.com/mig-<profile>` pod sees exactly its MIG device, and a kubelet
  restart leaves them running with their GPUs while the plugin registers again;
- time-slicing (4 replicas, renamed .shared, failRequestsGreaterThanOne, a per-replica memory
  limit), volume-mount device lists and the hook's strict settings: five pods share the GPUs and
  none is refused, a pod asking for two is refused with the plugin's reason, and the hook records
  each pod's share. (The watchdog acting on those shares, and the scheduling, MIG and time-slicing
  ground a cluster covers, are tested against a real cluster: tests/e2e/test_cluster.py. This
  standalone kubelet stays for what only it shows quickly: a kubelet restart under running pods,
  the device manager's admission refusals, volume-mount lists.)
"""

import kubeletcheck
import pytest
from hookcheck import config_with, listed_uuids

from oci_gpu_hook.start import container_record
from oci_gpu_hook.toolkit.simulate import control

SHOW = "nvidia-smi -L; sleep 3600"
STRICT = "accept_volume_mounts: true\naccept_envvar_when_unprivileged: false\n"
PLUGIN_ENVVAR = {"flags": {"migStrategy": "mixed", "plugin": {"deviceListStrategy": "envvar"}}}
PLUGIN_SHARED = {
    "flags": {"migStrategy": "mixed", "plugin": {"deviceListStrategy": "volume-mounts"}},
    "sharing": {"timeSlicing": {"renameByDefault": True, "failRequestsGreaterThanOne": True,
                                "resources": [{"name": "nvidia.com/gpu", "replicas": 4,
                                               "memoryLimit": "per-replica"}]}},
}  # fmt: skip


@pytest.fixture(scope="module")
def cluster(simulated_host, require, tmp_path_factory):
    """(node, host, hook config, records directory, tmp dir): a node whose hook has its own
    records directory (a test may add settings: hook_settings()); the node is closed and the host
    checked afterwards."""
    require("root", "runc", "busybox", "gcc")
    kubeletcheck.kubelet_binary()
    host = simulated_host(gpus=4, mig=[3])
    tmp = tmp_path_factory.mktemp("k8s")
    records = tmp / "records"
    hook_config = hook_settings(host, tmp, records, "")
    with kubeletcheck.running(kubeletcheck.ContainerdKubelet(tmp / "node", hook_config)) as node:
        try:
            yield node, host, hook_config, str(records), tmp
        finally:
            control.clear(host["root"])


def hook_settings(host, tmp, records, extra: str) -> str:
    """The hook's configuration file (one path: containerd's base spec names it), rewritten."""
    return config_with(host, tmp, f"records_directory: {records}\n" + extra)


def inventory_units(hook_config, doc):
    """{resource: [plugin_resources.Unit]} as the plugin computes them for doc."""
    from oci_gpu_hook.node.plugin import config as plugin_config
    from oci_gpu_hook.node.plugin import resources as plugin_resources
    from oci_gpu_hook.start import inventory_cache
    from oci_gpu_hook.start import settings as settings_module

    settings = settings_module.load(hook_config)
    resources = plugin_resources.resources(inventory_cache.load(settings), plugin_config.parse(doc, "test"))
    return {r.name: [d.unit for d in r.devices] for r in resources}


def test_whole_gpus_mig_devices_and_a_kubelet_restart(cluster):
    node, host, hook_config, _, tmp = cluster
    units = inventory_units(hook_config, PLUGIN_ENVVAR)
    gpus = {u.uuid for u in units["nvidia.com/gpu"]}
    mig_resource = sorted(n for n in units if n.startswith("nvidia.com/mig-"))[0]
    (mig_unit,) = units[mig_resource]
    plugin = kubeletcheck.DevicePlugin(hook_config, node, tmp, PLUGIN_ENVVAR, "plugin-envvar")
    try:
        node.wait_for_resource("nvidia.com/gpu", 3)
        node.wait_for_resource(mig_resource, 1)
        for name in ("gpu-a", "gpu-b", "gpu-c"):
            node.add_pod(name, SHOW, limits={"nvidia.com/gpu": 1})
        node.add_pod("mig", SHOW, limits={mig_resource: 1})
        seen = {}
        for name in ("gpu-a", "gpu-b", "gpu-c", "mig"):
            node.wait_for_phase(name, "Running")
            seen[name] = listed_uuids(node.wait_for_log(name, "UUID"))
        # Each whole-GPU pod: exactly one GPU, a distinct one, never the MIG GPU.
        assert all(len(seen[n]) == 1 for n in ("gpu-a", "gpu-b", "gpu-c")), seen
        assert {seen[n][0] for n in ("gpu-a", "gpu-b", "gpu-c")} == gpus
        # The MIG pod: its MIG device and nothing else (nvidia-smi names the parent GPU first).
        assert seen["mig"][-1] == mig_unit.uuid and mig_unit.uuid not in gpus
        assert [u for u in seen["mig"] if u.startswith("GPU-")] == [mig_unit.gpu.uuid], seen["mig"]
        pids = {n: node.container_pid(n) for n in seen}

        # The pods reach the new kubelet once the plugin has registered again (see restart_kubelet:
        # in a cluster they come from the API server; this kubelet would otherwise race the plugin).
        registered = plugin.registrations()
        node.restart_kubelet(pods_when=lambda: plugin.registrations() >= registered + len(units))
        node.wait_for_resource("nvidia.com/gpu", 3)
        for name, pid in pids.items():
            assert node.wait_for_phase(name, "Running")["status"]["phase"] == "Running"
            assert node.container_pid(name) == pid
            again = node.exec(name, ["nvidia-smi", "-L"])
            assert again.returncode == 0 and listed_uuids(again.stdout) == seen[name], again.stderr
            # The kubelet accounts to each pod the device its container has.
            (ids,) = node.allocated_devices(name).values()
            assert ids == seen[name][-1:], (name, ids, seen[name])
        for name in pids:
            node.remove_pod(name)
    finally:
        assert plugin.stop() == 0, plugin.output()


def test_time_sliced_gpus_through_volume_mounts_and_a_refusal(cluster):
    node, host, hook_config, records, tmp = cluster
    # Only the plugin's mounts choose GPUs for unprivileged containers (pods are).
    assert hook_settings(host, tmp, records, STRICT) == hook_config
    units = inventory_units(hook_config, PLUGIN_SHARED)
    by_uuid = {u.uuid: u for u in units["nvidia.com/gpu.shared"]}
    plugin = kubeletcheck.DevicePlugin(hook_config, node, tmp, PLUGIN_SHARED, "plugin-shared")
    names = [f"shared-{i}" for i in range(5)]
    try:
        node.wait_for_resource("nvidia.com/gpu.shared", 12)
        for name in names:
            # A pod's own variable asks for every GPU: the strict hook takes the plugin's mounts only.
            node.add_pod(name, SHOW, limits={"nvidia.com/gpu.shared": 1}, env={"NVIDIA_VISIBLE_DEVICES": "all"})
        node.add_pod("two", SHOW, limits={"nvidia.com/gpu.shared": 2})
        refused = node.wait_for_phase("two", "Failed")["status"]
        assert refused.get("reason") == "UnexpectedAdmissionError", refused
        assert "failRequestsGreaterThanOne" in refused.get("message", ""), refused
        assert "Allocate refused: nvidia.com/gpu.shared: a container may ask for 1" in plugin.output()

        holder = {}
        for name in names:
            node.wait_for_phase(name, "Running")  # none of the five is refused
            (uuid,) = listed_uuids(node.wait_for_log(name, "UUID"))
            holder[name] = uuid
        assert set(holder.values()) == set(by_uuid)  # spread over the three GPUs: shared, not piled up
        shared_uuid = next(u for u in by_uuid if list(holder.values()).count(u) >= 2)
        over, under = [n for n in names if holder[n] == shared_uuid][:2]
        pids = {n: node.container_pid(n) for n in names}

        # The hook recorded each pod's share: a quarter of its GPU.
        limits = {r["pid"]: r["gpu_memory_limit"] for r in container_record.read_all(records).values() if r}
        quarter = by_uuid[shared_uuid].memory_total // 4
        assert limits[pids[over]] == limits[pids[under]] == {shared_uuid: quarter}

        # What the watchdog then does with those shares is tested against the cluster
        # (tests/e2e/test_cluster.py), where the API shows the restart.
    finally:
        control.clear(host["root"])
        for name in names + ["two"]:
            if node.pod(name) is not None:
                node.remove_pod(name)
        assert plugin.stop() == 0, plugin.output()
