"""A GPU cluster as operators run it (issue 48), on tests/gpuclustercheck.py's cluster: one control
plane and three nodes on this machine (kubecheck.nodes_of_their_own: each node a host of its own,
with its own mount and network namespaces, cgroup root, kubelet and runtime, as kind makes its
nodes): A, on CRI-O, 8 simulated A100s, GPUs 0 to 3 in MIG mode (1g.5gb, 2g.10gb, 3g.20gb each),
the plugin's strategy mixed; B, on containerd, 4 simulated T4s; C, on containerd, no GPU.
`kubectl apply` of deploy/kubernetes/ rolls the hook out onto A and B (nothing installed by hand),
with deploy/cluster/device-plugin.yaml (every whole GPU time-sliced four ways) and deploy/cluster/'s
priority classes; the labels our labels pods write are put on the Nodes as NFD's master would.
Then, each judged from what the API shows and what the containers got:
- GPU types: a nodeSelector on nvidia.com/gpu.product places a pod on the node of that product,
  a nvidia.com/mig-1g.5gb request lands on A, and each sees a GPU of its node's kind;
- hard partitioning: with the GPU nodes tainted nvidia.com/gpu=present:NoSchedule and the
  ExtendedResourceToleration admission plugin on, CPU pods land on C only, a pod asking for
  nvidia.com/gpu tolerates the taint without writing it, and our DaemonSets still place their pods
  on the tainted nodes; a pod asking only for a MIG profile does not tolerate it (its toleration is
  for its own resource's name) until it writes one;
- quotas: deploy/cluster/quota.yaml refuses the pod past a namespace's nvidia.com/gpu and MIG
  quotas when it is created, with the quota's message;
- soft partitioning: with every mig-3g.20gb device held by gpu-batch pods, a gpu-interactive pod
  preempts one and gets its device; the exporter then names the new pod on it, not the old one,
  the old container's record is gone, and the watchdog does not kill the new pod for memory NVML
  still reports for the old pod's process;
- health across nodes: an XID 79 on one of A's whole GPUs takes its four replicas out of A's
  allocatable, and a pod that would have fit only there before stays Pending with the
  scheduler's reason;
- a node lost: B's kubelet stopped, the Node goes NotReady and unreachable, its CPU pod is
  replaced on a node that can hold it and its T4 pod's replacement stays Pending (no other node
  has a T4). The controllers' timeouts are shortened by flags (kubecheck.LOST_NODE_FLAGS).
The tests run in this order, on one cluster; each undoes what it changed, but the last two leave
the GPU unhealthy and the node lost.
"""

from __future__ import annotations

import json

import gpuclustercheck
import kubeletcheck
import nvmlevents
import pytest
from gpuclustercheck import NS, REPLICAS, A, B, C, cluster_file, gpu_allocatable, pod
from hookcheck import listed_uuids

from oci_gpu_hook.start import container_record
from oci_gpu_hook.toolkit.simulate import control

TAINT = "nvidia.com/gpu=present:NoSchedule"  # docs/kubernetes.md, "A GPU cluster"
LIMIT = 256 << 20  # the preempting pod's own GPU memory limit


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory, require):
    require(*gpuclustercheck.NEEDS)
    with gpuclustercheck.gpu_cluster(tmp_path_factory.mktemp("cluster")) as (cluster, hosts, _):
        yield cluster, hosts


def product(cluster, name: str) -> str:
    return cluster[name].node()["metadata"]["labels"]["nvidia.com/gpu.product"]


def get_pod(api, name: str, namespace: str = "default") -> dict:
    return api.get("pod", "-n", namespace, name)


def running(api, name: str) -> bool:
    return get_pod(api, name).get("status", {}).get("phase") == "Running"


def scheduling_message(api, name: str) -> str:
    """Why the scheduler has not placed the pod (its PodScheduled condition), or ""."""
    conditions = get_pod(api, name).get("status", {}).get("conditions") or []
    return next((c.get("message", "") for c in conditions if c["type"] == "PodScheduled" and c["status"] == "False"),
                "")  # fmt: skip


def delete(api, *names: str, namespace: str = "default") -> None:
    api.kubectl("delete", "pod", "-n", namespace, *names, "--wait=true", "--timeout=120s", "--ignore-not-found")


def seen_by(api, name: str) -> str:
    """What the pod's nvidia-smi -L printed, once it has."""
    return api.log_of(get_pod(api, name))


def migs_seen_by(api, name: str) -> list:
    """The MIG devices the pod's nvidia-smi -L listed (it lists their GPU too)."""
    return [u for u in listed_uuids(seen_by(api, name)) if u.startswith("MIG-")]


def test_gpu_types_land_on_their_nodes(gpu_cluster):
    cluster, hosts = gpu_cluster
    api = cluster[A]
    t4, a100 = product(cluster, B), product(cluster, A)
    assert "T4" in t4 and "A100" in a100, (t4, a100)  # each node's own product, as its labels say
    pods = [pod("on-t4", resources={"nvidia.com/gpu": "1"}, nodeSelector={"nvidia.com/gpu.product": t4}),
            pod("on-a100", resources={"nvidia.com/gpu": "1"}, nodeSelector={"nvidia.com/gpu.product": a100}),
            pod("on-mig", resources={"nvidia.com/mig-1g.5gb": "1"})]  # fmt: skip
    api.apply(*pods)
    try:
        for name in ("on-t4", "on-a100", "on-mig"):
            api.wait_until(lambda name=name: listed_uuids(seen_by(api, name)) if running(api, name) else False, 120,
                           f"{name} to run and list its GPU")  # fmt: skip
        placed = {name: get_pod(api, name)["spec"]["nodeName"] for name in ("on-t4", "on-a100", "on-mig")}
        assert placed == {"on-t4": B, "on-a100": A, "on-mig": A}
        assert "Tesla T4" in seen_by(api, "on-t4") and "A100" in seen_by(api, "on-a100")
        (mig,) = migs_seen_by(api, "on-mig")
        profiles = {m["uuid"]: m["profile"] for g in hosts[A]["gpus"] for m in g["mig"]}
        assert profiles.get(mig) == "1g.5gb", (mig, seen_by(api, "on-mig"))
    finally:
        delete(api, "on-t4", "on-a100", "on-mig")


def test_hard_partitioning_keeps_cpu_pods_off_the_gpu_nodes(gpu_cluster):
    cluster, _ = gpu_cluster
    api = cluster[A]
    for name in (A, B):
        api.kubectl("taint", "nodes", name, TAINT)
    try:
        cpu = [pod(f"cpu-{n}", command="sleep 3600") for n in range(3)]
        gpu = pod("gpu-no-toleration", resources={"nvidia.com/gpu": "1"},
                  nodeSelector={"nvidia.com/gpu.product": product(cluster, B)})  # fmt: skip
        mig = pod("mig-no-toleration", resources={"nvidia.com/mig-1g.5gb": "1"})
        api.apply(*cpu, gpu, mig)
        for p in (*cpu, gpu):
            name = p["metadata"]["name"]
            api.wait_until(lambda name=name: running(api, name), 120, f"{name} to run")
        assert {get_pod(api, f"cpu-{n}")["spec"]["nodeName"] for n in range(3)} == {C}
        # The admission plugin gave the GPU pod the toleration of its resource's name.
        tolerations = get_pod(api, "gpu-no-toleration")["spec"]["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations, tolerations
        assert get_pod(api, "gpu-no-toleration")["spec"]["nodeName"] == B
        # A MIG pod's toleration is for nvidia.com/mig-1g.5gb: the nvidia.com/gpu taint keeps it out
        # of both GPU nodes (and C has no MIG device).
        tolerations = get_pod(api, "mig-no-toleration")["spec"]["tolerations"]
        assert {"key": "nvidia.com/mig-1g.5gb", "operator": "Exists", "effect": "NoSchedule"} in tolerations
        assert not [t for t in tolerations if t.get("key") == "nvidia.com/gpu"], tolerations
        api.wait_until(lambda: "2 node(s) had untolerated taint" in scheduling_message(api, "mig-no-toleration"), 60,
                       "the MIG pod to be refused by the scheduler")  # fmt: skip
        assert "1 Insufficient nvidia.com/mig-1g.5gb" in scheduling_message(api, "mig-no-toleration")
        toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        tolerated = pod("mig-tolerating", resources={"nvidia.com/mig-1g.5gb": "1"}, tolerations=[toleration])
        api.apply(tolerated)
        api.wait_until(lambda: running(api, "mig-tolerating"), 120, "the MIG pod that tolerates the taint to run")
        assert get_pod(api, "mig-tolerating")["spec"]["nodeName"] == A
        # Our DaemonSets tolerate it: a labels pod deleted on a tainted node comes back there.
        (labels,) = [p for p in api.get("pods", "-n", NS, "-l", "app.kubernetes.io/name=oci-gpu-hook-labels")["items"]
                     if p["spec"]["nodeName"] == B]  # fmt: skip
        api.kubectl("delete", "pod", "-n", NS, labels["metadata"]["name"], "--wait=true")

        def back() -> bool:
            pods = api.get("pods", "-n", NS, "-l", "app.kubernetes.io/name=oci-gpu-hook-labels")["items"]
            return any(p["spec"].get("nodeName") == B and p["status"].get("phase") == "Running" for p in pods)

        api.wait_until(back, 120, "the labels pod to come back on the tainted node")
        for daemonset in ("oci-gpu-hook-toolkit", "oci-gpu-hook-node", "oci-gpu-hook-labels"):
            status = api.get("daemonset", "-n", NS, daemonset)["status"]
            assert status["desiredNumberScheduled"] == 2, (daemonset, status)
    finally:
        delete(api, *[f"cpu-{n}" for n in range(3)], "gpu-no-toleration", "mig-no-toleration", "mig-tolerating")
        for name in (A, B):
            api.kubectl("taint", "nodes", name, "nvidia.com/gpu:NoSchedule-")


def test_a_quota_refuses_the_pod_past_it_when_it_is_created(gpu_cluster):
    cluster, _ = gpu_cluster
    api = cluster[A]
    docs = cluster_file("quota.yaml")
    api.apply(*docs)
    (quota,) = [d for d in docs if d["kind"] == "ResourceQuota"]
    namespace, hard = quota["metadata"]["namespace"], quota["spec"]["hard"]
    try:
        api.wait_until(lambda: api.get("resourcequota", "-n", namespace, "gpu-quota").get("status", {}).get("hard")
                       == hard, 60, "the quota controller to take the quota")  # fmt: skip
        for resource in ("nvidia.com/gpu", "nvidia.com/mig-1g.5gb"):
            allowed = int(hard[f"requests.{resource}"])
            short = resource.split("/")[1].replace(".", "-")
            for n in range(allowed):
                api.apply(pod(f"{short}-{n}", command="sleep 3600", resources={resource: "1"}, namespace=namespace))
            # Counted: admission counts what it admits, but the quota it reads may lag its creation.
            api.wait_until(lambda r=f"requests.{resource}", n=str(allowed): used(api, namespace).get(r) == n, 60,
                           f"the quota to count {allowed} {resource}")  # fmt: skip
            over = api.kubectl("apply", "--validate=false", "-f", "-", check=False,
                               input=json.dumps(pod(f"{short}-over", command="sleep 3600", resources={resource: "1"},
                                                    namespace=namespace)))  # fmt: skip
            assert over.returncode != 0, json.dumps(api.get("pods", "-n", namespace)["items"])[-3000:]
            said = (f"exceeded quota: gpu-quota, requested: requests.{resource}=1, used: "
                    f"requests.{resource}={allowed}, limited: requests.{resource}={allowed}")  # fmt: skip
            assert said in over.stderr, over.stderr
            assert api.kubectl("get", "pod", "-n", namespace, f"{short}-over", check=False).returncode != 0
    finally:
        api.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=180s", timeout=240)


def used(api, namespace: str) -> dict:
    return api.get("resourcequota", "-n", namespace, "gpu-quota").get("status", {}).get("used", {})


def test_a_preempting_pod_gets_the_gpu_and_the_node_services_follow(gpu_cluster):
    cluster, hosts = gpu_cluster
    api, node = cluster[A], cluster[A]
    store = hosts[A]["store"]
    batch = [pod(f"batch-{n}", resources={"nvidia.com/mig-3g.20gb": "1"}, priorityClassName="gpu-batch")
             for n in range(4)]  # fmt: skip
    api.apply(*batch)
    names = [p["metadata"]["name"] for p in batch]
    try:
        for name in names:
            api.wait_until(lambda name=name: running(api, name) and migs_seen_by(api, name), 120,
                           f"{name} to run with its MIG device")  # fmt: skip
        held = {name: migs_seen_by(api, name)[0] for name in names}
        assert len(set(held.values())) == 4  # every mig-3g.20gb device of the cluster in use
        # NVML reports GPU memory for every batch pod's process, well over the new pod's limit:
        # what is left of the victim's must not count against the new pod.
        pids = {name: process_of(node, name) for name in names}
        control.write(store, processes=[(held[n], pids[n], 2 << 30) for n in names])
        urgent = pod("urgent", resources={"nvidia.com/mig-3g.20gb": "1"}, priorityClassName="gpu-interactive")
        limit = {"name": "OCI_GPU_HOOK_GPU_MEMORY_LIMIT", "value": f"{LIMIT >> 20}MiB"}
        urgent["spec"]["containers"][0]["env"] = [limit]
        api.apply(urgent)
        api.wait_until(lambda: running(api, "urgent") and migs_seen_by(api, "urgent"), 180,
                       "the gpu-interactive pod to preempt a gpu-batch pod and run")  # fmt: skip
        (got,) = migs_seen_by(api, "urgent")
        (victim,) = [n for n in names if held[n] == got]
        events = api.get("events", "-n", "default", "--field-selector", f"involvedObject.name={victim}")["items"]
        assert any(e.get("reason") == "Preempted" for e in events), [e.get("reason") for e in events]
        assert all(running(api, n) for n in names if n != victim)
        # The exporter names the new pod on that device, and the old one nowhere.
        page = {}

        def named() -> bool:
            page["text"] = node.its_page("http://127.0.0.1:9400/metrics") or ""
            lines = [x for x in page["text"].splitlines() if x.startswith("oci_gpu_hook_container_gpu_allocated{")]
            return any('pod="urgent"' in x for x in lines) and not any(f'pod="{victim}"' in x for x in lines)

        api.wait_until(named, 90, "the exporter to name the new pod and not the old one")
        # The old container's record is gone (the node services collect records of gone containers).
        api.wait_until(lambda: not records_naming(node, victim), 90, "the old pod's container record to go")
        assert records_naming(node, "urgent")
        # The watchdog has scanned since (every second), and left the new pod alone.
        watchdog = [p for p in api.get("pods", "-n", NS, "-l", "app.kubernetes.io/name=oci-gpu-hook-node")["items"]
                    if p["spec"]["nodeName"] == A][0]  # fmt: skip
        log = api.log_of(watchdog, "watchdog")
        assert not [line for line in log.splitlines() if line.startswith("{") and '"urgent"' in line], log[-2000:]
        assert running(api, "urgent")
    finally:
        control.clear(store)
        delete(api, *names, "urgent")


def process_of(node, name: str) -> int:
    """The host pid of the pod's container's init process, from the hook's record of it."""
    named = records_naming(node, name)
    assert len(named) == 1, f"{name}'s container records: {named}"
    return named[0]["pid"]


def records_naming(node, name: str) -> list:
    """The hook's records of the node's containers of pod name, read as the node services read them."""
    found = container_record.read_all(node.on_node("/run/oci-gpu-hook/containers")).values()
    return [r for r in found if r is not None and (r.get("kubernetes") or {}).get("pod") == name]


def test_an_xid_on_one_node_takes_its_gpu_out_of_the_cluster(gpu_cluster):
    """Left unhealthy: the tests after it do not use A's whole GPUs."""
    cluster, hosts = gpu_cluster
    api = cluster[A]
    before = int(gpu_allocatable(cluster[A])["nvidia.com/gpu"])
    whole = [g for g in hosts[A]["gpus"] if not g["mig"]]
    nvmlevents.inject_xid(hosts[A]["store"], whole[0]["uuid"], 79)
    after = str(before - REPLICAS)
    api.wait_until(lambda: gpu_allocatable(cluster[A])["nvidia.com/gpu"] == after, 120,
                   f"A's allocatable nvidia.com/gpu to drop from {before} to {after}")  # fmt: skip
    assert gpu_allocatable(cluster[B])["nvidia.com/gpu"] == str(4 * REPLICAS)  # B's are not A's
    # A pod that would have fit on A before (and only there: its product) stays Pending.
    wanted = before - REPLICAS + 1
    api.apply(pod("too-big", resources={"nvidia.com/gpu": str(wanted)},
                  nodeSelector={"nvidia.com/gpu.product": product(cluster, A)}))  # fmt: skip
    try:
        api.wait_until(lambda: "Insufficient nvidia.com/gpu" in scheduling_message(api, "too-big"), 60,
                       "the scheduler to say why the pod waits")  # fmt: skip
        assert get_pod(api, "too-big")["status"]["phase"] == "Pending"
    finally:
        delete(api, "too-big")


def test_a_lost_node_gives_up_its_gpus_and_its_pods_move_where_they_fit(gpu_cluster):
    """Last: B stays lost."""
    cluster, _ = gpu_cluster
    api, lost = cluster[A], cluster[B]
    t4 = product(cluster, B)
    preferring_b = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "preference": {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                                             "values": [B]}]}}]}}  # fmt: skip
    on_t4 = {"nodeSelector": {"nvidia.com/gpu.product": t4}}
    deployments = [deployment("cpu-work", {"affinity": preferring_b}, None),
                   deployment("t4-work", on_t4, {"nvidia.com/gpu": "1"})]  # fmt: skip
    api.apply(*deployments)
    try:
        for name in ("cpu-work", "t4-work"):
            api.wait_until(lambda name=name: [p for p in app_pods(api, name) if p["spec"].get("nodeName") == B
                                              and p["status"].get("phase") == "Running"], 120,
                           f"{name} to run on {B}")  # fmt: skip
        kubeletcheck._stop(lost.kubelet)
        api.wait_until(lambda: any(t["key"] == "node.kubernetes.io/unreachable" for t in
                                   lost.node()["spec"].get("taints") or []), 120, f"{B} to be unreachable")  # fmt: skip
        ready = [c for c in lost.node()["status"]["conditions"] if c["type"] == "Ready"]
        assert ready[0]["status"] == "Unknown", ready

        def replaced(name: str) -> list:
            return [p for p in app_pods(api, name) if "deletionTimestamp" not in p["metadata"]
                    and p["spec"].get("nodeName") != B]  # fmt: skip

        api.wait_until(lambda: [p for p in replaced("cpu-work") if p["status"].get("phase") == "Running"], 180,
                       "the CPU pod to be replaced on a node that can hold it")  # fmt: skip
        (cpu,) = replaced("cpu-work")
        assert cpu["spec"]["nodeName"] in (A, C)
        api.wait_until(lambda: [p for p in replaced("t4-work") if "Insufficient nvidia.com/gpu" in
                                scheduling_message(api, p["metadata"]["name"]) or "untolerated taint" in
                                scheduling_message(api, p["metadata"]["name"])], 180,
                       "the T4 pod's replacement to wait, with the scheduler's reason")  # fmt: skip
        (gpu,) = replaced("t4-work")
        assert gpu["status"]["phase"] == "Pending" and "nodeName" not in gpu["spec"]
    finally:
        api.kubectl("delete", "deployment", "cpu-work", "t4-work", "--wait=false", check=False)
        if lost.kubelet.poll() is not None:  # back, so that its pods are stopped as the cluster closes
            lost.restart_kubelet(180)


def deployment(name: str, spec: dict, resources: dict | None) -> dict:
    template = pod(name, command="sleep 3600", resources=resources, **spec)
    template["spec"]["restartPolicy"] = "Always"
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}, "spec": template["spec"]}}}  # fmt: skip


def app_pods(api, name: str) -> list:
    return api.get("pods", "-l", f"app={name}")["items"]
