"""A real one-node cluster (issue 28, first part): Kubernetes 1.36's API server, scheduler,
controller-manager and kubelet (tests/kubecheck.py), on Debian's containerd whose base runtime
spec gives every app container the hook, and the project's `device-plugin` (mixed MIG strategy)
on a simulated host with four GPUs, the last in MIG mode. Seen through the API, as a user with
kubectl sees it:
- the node's capacity and allocatable show nvidia.com/gpu and the MIG resources;
- a Deployment's pods are scheduled, and each container sees exactly its GPU;
- one request too many stays Pending with the scheduler's reason, and runs once a GPU is freed,
  on the freed GPU;
- a pod asking for a MIG profile gets that MIG device.
The host is checked afterwards: no process, mount, cgroup, sysctl or iptables rule left changed.
"""

import re

import kubecheck
import kubeletcheck
import pytest
from hookcheck import config_with

pytestmark = pytest.mark.host(gpus=4, mig=[3], needs=("runc", "busybox", "containerd", "ctr", "openssl"))

SHOW = "nvidia-smi -L; sleep 3600"
PLUGIN = {"flags": {"migStrategy": "mixed", "plugin": {"deviceListStrategy": "envvar"}}}


@pytest.fixture(scope="module")
def cluster(host, tmp_path_factory):
    """(cluster, plugin, {resource: [units]}), the host checked after tear-down."""
    kubecheck.programs()
    tmp = tmp_path_factory.mktemp("cluster")
    hook_config = config_with(host, tmp, f"records_directory: {tmp / 'records'}\n")
    before = kubecheck.host_state()
    cluster = kubecheck.Cluster(tmp / "node", hook_config)
    plugin = None
    try:
        cluster.start()
        plugin = kubeletcheck.DevicePlugin(hook_config, cluster, tmp, PLUGIN, "plugin")
        yield cluster, plugin, units(hook_config)
    finally:
        if plugin is not None:
            plugin.stop()
        cluster.close()
    assert kubecheck.host_state() == before


def units(hook_config) -> dict:
    from oci_gpu_hook.node import plugin_config, plugin_devices
    from oci_gpu_hook.start import inventory_cache
    from oci_gpu_hook.start import settings as settings_module

    settings = settings_module.load(hook_config)
    resources = plugin_devices.resources(inventory_cache.load(settings), plugin_config.parse(PLUGIN, "test"))
    return {r.name: [d.unit for d in r.devices] for r in resources}


def pod_spec(limits: dict) -> dict:
    container = {
        "name": kubeletcheck.CONTAINER,
        "image": kubeletcheck.IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", SHOW],
        "resources": {"limits": {k: str(v) for k, v in limits.items()}},
    }
    return {"hostNetwork": True, "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 1,
            "containers": [container]}  # fmt: skip


def pod(name: str, limits: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {**pod_spec(limits), "restartPolicy": "Never"}}  # fmt: skip


def listed(text: str) -> list:
    return re.findall(r"UUID: ((?:GPU|MIG)-[0-9a-f-]+)\)", text)


def running_with_uuids(cluster, selector: str, count: int, timeout: float = 90) -> dict:
    """{pod name: the UUIDs its container listed}, once count pods of selector run and said so."""
    seen = {}

    def ready():
        pods = [p for p in cluster.pods_of(selector) if p["status"].get("phase") == "Running"
                and not p["metadata"].get("deletionTimestamp")]  # fmt: skip
        seen.clear()
        seen.update({p["metadata"]["name"]: listed(cluster.log_of(p)) for p in pods})
        return len(seen) == count and all(seen.values())

    cluster.wait_until(ready, timeout, f"{count} running pods of {selector} that listed their GPUs")
    return dict(seen)


def test_the_node_offers_the_gpus_through_the_api(cluster):
    cluster, plugin, resources = cluster
    mig = next(name for name in resources if name.startswith("nvidia.com/mig-"))

    def offered():
        status = (cluster.node() or {}).get("status", {})
        return all(status.get(kind, {}).get(name) == str(len(resources[name]))
                   for kind in ("capacity", "allocatable") for name in ("nvidia.com/gpu", mig))  # fmt: skip

    cluster.wait_until(offered, 60, "the plugin's resources in the node's capacity and allocatable")
    assert len(resources["nvidia.com/gpu"]) == 3


def test_a_deployment_one_too_many_and_a_freed_gpu(cluster):
    cluster, plugin, resources = cluster
    gpus = {u.uuid for u in resources["nvidia.com/gpu"]}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "cuda"},
        "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "cuda"}},
                 "template": {"metadata": {"labels": {"app": "cuda"}}, "spec": pod_spec({"nvidia.com/gpu": 1})}},
    }  # fmt: skip
    cluster.apply(deployment)
    held = running_with_uuids(cluster, "app=cuda", 3)
    assert all(len(u) == 1 for u in held.values()), held
    assert {u[0] for u in held.values()} == gpus  # each its own, never the MIG GPU

    cluster.apply(pod("extra", {"nvidia.com/gpu": 1}))

    def pending_for_gpus():
        (extra,) = cluster.pods_of("app=extra")
        conditions = {c["type"]: c for c in extra["status"].get("conditions") or []}
        scheduled = conditions.get("PodScheduled", {})
        return scheduled.get("reason") == "Unschedulable" and "Insufficient nvidia.com/gpu" in scheduled["message"]

    cluster.wait_until(pending_for_gpus, 60, "the fourth pod Pending for want of a GPU")
    assert cluster.pods_of("app=extra")[0]["status"]["phase"] == "Pending"

    cluster.kubectl("scale", "deployment/cuda", "--replicas=2")
    (extra,) = running_with_uuids(cluster, "app=extra", 1).values()
    kept = running_with_uuids(cluster, "app=cuda", 2)
    assert extra == list(gpus - {u[0] for u in kept.values()})  # the freed GPU
    cluster.kubectl("delete", "deployment/cuda", "pod/extra", "--wait=true", "--timeout=60s")


def test_a_mig_pod_gets_its_mig_device(cluster):
    cluster, plugin, resources = cluster
    mig = sorted(name for name in resources if name.startswith("nvidia.com/mig-"))[0]
    unit = resources[mig][0]
    cluster.apply(pod("mig", {mig: 1}))
    (uuids,) = running_with_uuids(cluster, "app=mig", 1).values()
    assert uuids[-1] == unit.uuid and [u for u in uuids if u.startswith("GPU-")] == [unit.gpu.uuid]
    cluster.kubectl("delete", "pod/mig", "--wait=true", "--timeout=60s")
