"""A real one-node cluster (issue 28, first part): Kubernetes 1.36's API server, scheduler,
controller-manager and kubelet (tests/kubecheck.py), on Debian's containerd whose base runtime
spec gives every app container the hook, and the project's `device-plugin` (mixed MIG strategy)
on a simulated host with four GPUs, the last in MIG mode. Seen through the API, as a user with
kubectl sees it:
- the node's capacity and allocatable show nvidia.com/gpu and the MIG resources;
- a Deployment's pods are scheduled, and each container sees exactly its GPU;
- one request too many stays Pending with the scheduler's reason, and runs once a GPU is freed,
  on the freed GPU;
- a pod asking for a MIG profile gets that MIG device;
- the node labels `oci-gpu-hook labels` writes, from the plugin's own configuration file as the
  DaemonSet's labels read it, are the simulated host's (mixed: its three full GPUs and one label
  set per MIG profile); they reach the node (put there with kubectl, as NFD's local source would:
  NFD is not here), and a nodeSelector on nvidia.com/gpu.product places a pod;
- the exporter names each GPU process's pod, namespace and container as the API does;
- with time-slicing, the watchdog kills the pod over its memory share: the API shows its restart
  and why, and the other pod on the same GPU keeps running.
The host is checked afterwards: no process, mount, cgroup, sysctl or iptables rule left changed.
Every expected GPU, MIG device and label comes from the simulated host's description (the `host`
fixture), never from the code under test.
"""

import json
import subprocess

import kubecheck
import kubeletcheck
import pytest
from hookcheck import config_with, expected_labels, listed_uuids

from oci_gpu_hook.toolkit.containers import hook_command

pytestmark = pytest.mark.host(
    gpus=4, mig=[3], needs=("runc", "busybox", "containerd", "ctr", "openssl", "pynvml", "prometheus_client")
)

SHOW = "nvidia-smi -L; sleep 3600"
PLUGIN = {"flags": {"migStrategy": "mixed", "plugin": {"deviceListStrategy": "envvar"}}}


@pytest.fixture(scope="module")
def cluster(host, tmp_path_factory):
    """(cluster, plugin, {resource: [units]}), the host checked after tear-down."""
    tmp = tmp_path_factory.mktemp("cluster")
    with kubecheck.cluster_on(host, tmp, f"records_directory: {tmp / 'records'}\n") as cluster:
        plugin = kubeletcheck.DevicePlugin(cluster.hook_config, cluster, tmp, PLUGIN, "plugin")
        try:
            cluster.tmp, cluster.host = tmp, host
            yield cluster, plugin, expected_units(host)
        finally:
            plugin.stop()


def expected_units(host: dict) -> dict:
    """{resource: [{"uuid", "memory_total", "gpu": its GPU's UUID}]}: what the mixed strategy must
    offer on the simulated host, from its description: each GPU without MIG as nvidia.com/gpu,
    each MIG device as nvidia.com/mig-<profile> (NVIDIA's device plugin's names)."""
    assert PLUGIN["flags"]["migStrategy"] == "mixed"
    units = {"nvidia.com/gpu": []}
    for gpu in host["gpus"]:
        if not gpu["mig"]:
            units["nvidia.com/gpu"].append({"uuid": gpu["uuid"], "memory_total": gpu["model"]["memory_total"],
                                            "gpu": gpu["uuid"]})  # fmt: skip
        for mig in gpu["mig"]:
            units.setdefault(f"nvidia.com/mig-{mig['profile']}", []).append(
                {"uuid": mig["uuid"], "memory_total": mig["memory_total"], "gpu": gpu["uuid"]})  # fmt: skip
    return units


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


def pod(name: str, limits: dict, restart: str = "Never", **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {**pod_spec(limits), "restartPolicy": restart, **spec}}  # fmt: skip


def running_with_uuids(cluster, selector: str, count: int, timeout: float = 90) -> dict:
    """{pod name: the UUIDs its container listed}, once count pods of selector run and said so."""
    seen = {}

    def ready():
        pods = [p for p in cluster.pods_of(selector) if p["status"].get("phase") == "Running"
                and not p["metadata"].get("deletionTimestamp")]  # fmt: skip
        seen.clear()
        seen.update({p["metadata"]["name"]: listed_uuids(cluster.log_of(p)) for p in pods})
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
    gpus = {u["uuid"] for u in resources["nvidia.com/gpu"]}
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
    assert uuids[-1] == unit["uuid"] and [u for u in uuids if u.startswith("GPU-")] == [unit["gpu"]]
    cluster.kubectl("delete", "pod/mig", "--wait=true", "--timeout=60s")


def test_node_labels_reach_the_node_and_steer_a_pod(cluster):
    """`labels` writes NFD's local-source feature file; NFD is not here, so the test puts the
    file's labels on the node with kubectl, which is what NFD's master would do with them. Its
    configuration names the running plugin's file (node.device_plugin_config), as the DaemonSet's
    does: the MIG strategy and the replicas are the plugin's, and the labels must say mixed."""
    cluster, plugin, resources = cluster
    features = cluster.tmp / "features"
    (cluster.tmp / "labels").mkdir()
    # node: replaces the host's node: section whole, so its sysfs (node.sys_root) is named again.
    node = f"node: {{device_plugin_config: {plugin.config_file}, sys_root: {cluster.host['root']}}}"
    config = config_with(cluster.host, cluster.tmp / "labels", node)
    out = subprocess.run([*hook_command(config), "labels", "--output", str(features)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    labels = dict(line.split("=", 1) for line in features.read_text().splitlines())
    assert labels == expected_labels(cluster.host, PLUGIN["flags"]["migStrategy"])
    # The literal values of a 4-GPU host with GPU 3 in MIG mode, so that a wrong description
    # cannot make the test agree with itself: under mixed, gpu.count counts every GPU, the one
    # in MIG mode too, as GFD's does.
    assert (labels["nvidia.com/gpu.count"], labels["nvidia.com/mig.strategy"]) == ("4", "mixed")
    assert labels["nvidia.com/mig-3g.20gb.count"] == "1"
    product = labels["nvidia.com/gpu.product"]
    cluster.kubectl("label", "node", cluster.node_name, "--overwrite", *[f"{k}={v}" for k, v in labels.items()])
    on_node = cluster.node()["metadata"]["labels"]
    assert {k: on_node.get(k) for k in labels} == labels
    try:
        cluster.apply(pod("steered", {"nvidia.com/gpu": 1}, nodeSelector={"nvidia.com/gpu.product": product}),
                      pod("elsewhere", {}, nodeSelector={"nvidia.com/gpu.product": "NVIDIA-NO-SUCH-GPU"}))  # fmt: skip
        running_with_uuids(cluster, "app=steered", 1)

        def unplaced():
            conditions = cluster.pods_of("app=elsewhere")[0]["status"].get("conditions") or []
            return any(c["type"] == "PodScheduled" and "node affinity/selector" in c.get("message", "")
                       for c in conditions)  # fmt: skip

        cluster.wait_until(unplaced, 60, "the pod for another GPU model to stay unscheduled")
    finally:
        cluster.kubectl("delete", "pod/steered", "pod/elsewhere", "--wait=true", "--timeout=60s", check=False)
        cluster.kubectl("label", "node", cluster.node_name, *[f"{k}-" for k in labels], check=False)


def test_the_exporter_names_the_pod_the_api_names(cluster):
    from servicecheck import Exporter

    from oci_gpu_hook.toolkit.simulate import control

    cluster, plugin, resources = cluster
    cluster.apply(pod("metrics", {"nvidia.com/gpu": 1}))
    ((uuid,),) = running_with_uuids(cluster, "app=metrics", 1).values()
    (api_pod,) = cluster.pods_of("app=metrics")
    pid = cluster.container_pid("metrics")
    control.write(cluster.host["root"], processes=[(uuid, pid, 300 << 20)])
    exporter = Exporter(cluster.hook_config, cluster.tmp)
    try:
        samples = exporter.scrape()
    finally:
        exporter.stop()
        control.clear(cluster.host["root"])
        cluster.kubectl("delete", "pod/metrics", "--wait=true", "--timeout=60s")
    used = [(ls.get("pod"), ls.get("namespace"), ls.get("container"), ls.get("UUID"), v) for n, ls, v in samples
            if n == "oci_gpu_hook_container_gpu_memory_used_bytes"]  # fmt: skip
    meta = api_pod["metadata"]
    assert used == [(meta["name"], meta["namespace"], api_pod["spec"]["containers"][0]["name"], uuid, 300 << 20)]


SHARED = {
    "flags": {"migStrategy": "mixed", "plugin": {"deviceListStrategy": "envvar"}},
    "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2,
                                               "memoryLimit": "per-replica"}]}},
}  # fmt: skip


def test_the_watchdog_kills_the_pod_over_its_share_and_the_api_says_so(cluster):
    """Last: it replaces the module's plugin with a time-slicing one."""
    cluster, plugin, resources = cluster
    from oci_gpu_hook.toolkit.simulate import control

    plugin.stop()
    shared = kubeletcheck.DevicePlugin(cluster.hook_config, cluster, cluster.tmp, SHARED, "plugin-shared")
    try:
        cluster.wait_until(lambda: cluster.node_gpus() == "6", 60, "six time-sliced replicas")
        # Six replicas of three GPUs and four pods: at least one GPU is shared by two pods.
        names = [f"sliced-{i}" for i in range(4)]
        cluster.apply(*[pod(n, {"nvidia.com/gpu": 1}, restart="Always") for n in names])
        held = {name: uuids[0] for name, uuids in running_with_uuids(cluster, "app in (" + ",".join(names) + ")",
                                                                      4).items()}  # fmt: skip
        uuid = next(u for u in held.values() if list(held.values()).count(u) == 2)
        over, under = [n for n in names if held[n] == uuid]
        pids = {n: cluster.container_pid(n) for n in (over, under)}
        unit = next(u for u in resources["nvidia.com/gpu"] if u["uuid"] == uuid)
        share = unit["memory_total"] // 2
        control.write(cluster.host["root"], processes=[(uuid, pids[over], share + (64 << 20)),
                                                       (uuid, pids[under], share // 2)])  # fmt: skip
        out = subprocess.run([*hook_command(cluster.hook_config), "watchdog", "--once"], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr
        control.clear(cluster.host["root"])

        def restarted():
            (status,) = cluster.pods_of(f"app={over}")[0]["status"].get("containerStatuses") or [{}]
            return status.get("restartCount", 0) >= 1 and "terminated" in status.get("lastState", {})

        cluster.wait_until(restarted, 60, f"{over}'s container to be restarted after the kill")
        (status,) = cluster.pods_of(f"app={over}")[0]["status"]["containerStatuses"]
        assert status["lastState"]["terminated"]["exitCode"] == 137  # SIGKILL, the watchdog's
        (other,) = cluster.pods_of(f"app={under}")[0]["status"]["containerStatuses"]
        assert other["restartCount"] == 0 and cluster.container_pid(under) == pids[under]
        (killed,) = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
        assert (killed["action"], killed["pids"], killed["device"]) == ("kill", [pids[over]], uuid)
        assert (killed["pod"], killed["namespace"]) == (over, "default")  # the names the API gives
    finally:
        control.clear(cluster.host["root"])
        cluster.kubectl("delete", "pods", "--all", "--wait=true", "--timeout=60s", check=False)
        shared.stop()
