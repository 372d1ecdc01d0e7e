"""The GPU cluster of tests/e2e/test_gpu_cluster.py, rolled out, for that test and for `make bench`
(bench/cluster.py): one control plane and three nodes (kubecheck.nodes_of_their_own),
- A, on CRI-O: 8 simulated A100s, GPUs 0 to 3 in MIG mode (three instances each);
- B, on containerd: 4 simulated T4s;
- C, on containerd: no GPU;
each GPU node's own simulated host seen at the one path the DaemonSets' configuration names.
`kubectl apply` of deploy/kubernetes/ rolls the hook out onto A and B (nothing installed by hand),
with deploy/cluster/device-plugin.yaml as the plugin's configuration and deploy/cluster/'s
priority classes; NFD's PCI label is on A and B only, and the labels our labels pods write are put
on the Nodes as NFD's master would."""

from __future__ import annotations

import contextlib
import os
import time

import kubecheck
import kubeletcheck
import yaml
from hookcheck import config_with
from imagecheck import build

from oci_gpu_hook.toolkit.simulate import simulate

NS = "oci-gpu-hook"
A, B, C = "gpu-a100", "gpu-t4", "cpu-only"
NFD_LABEL = "feature.node.kubernetes.io/pci-10de.present"
FEATURES_D = "/etc/kubernetes/node-feature-discovery/features.d"
CLUSTER_DIR = os.path.join(kubeletcheck.REPO, "deploy", "cluster")
GPU_NODES = {A: {"gpus": 8, "mig": [0, 1, 2, 3], "model": "a100"}, B: {"gpus": 4, "model": "t4"}}
RUNTIMES = {A: "crio", B: "containerd", C: "containerd"}
REPLICAS = 4  # deploy/cluster/device-plugin.yaml's time-slicing of nvidia.com/gpu
DAEMONSETS = ("oci-gpu-hook-toolkit", "oci-gpu-hook-node", "oci-gpu-hook-labels")


def cluster_file(name: str) -> list:
    with open(os.path.join(CLUSTER_DIR, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


NEEDS = ("root", "openssl", "runc", "busybox", "gcc", "unshare", "nsenter", "pynvml", "containerd", "ctr", "podman",
         "conmon")  # fmt: skip


@contextlib.contextmanager
def gpu_cluster(tmp):
    """The cluster, rolled out (GPUHookReady on A and B, their GPUs offered, every pod of ours
    running, the labels on the Nodes), under tmp; closed after the block. Yields ({name: its
    Cluster}, {name: its simulated host, with "store", where this machine reaches it}, the seconds
    from `kubectl apply` to every pod of ours running)."""
    # Each GPU node's simulated host is built here, at the path every node's configuration names,
    # then moved aside; the node sees it there again through a bind mount of its own.
    at = tmp / "gpu-host"
    hosts, files = {}, {}
    for name, options in GPU_NODES.items():
        host = simulate(str(at), **options)
        (tmp / name).mkdir()
        config = config_with(host, tmp / name, "records_directory: /run/oci-gpu-hook/containers\n"
                             "accept_volume_mounts: true\naccept_envvar_when_unprivileged: false\n")  # fmt: skip
        with open(config) as f:
            # The hook's configuration, as `install --accept-volume-mounts` leaves it; NFD's
            # features.d, as its worker makes it (a hidden file: NFD reads none).
            files[name] = {"/etc/oci-gpu-hook/config.yaml": f.read(), f"{FEATURES_D}/.nfd-worker": ""}
        store = tmp / f"host-{name}"
        os.rename(at, store)
        hosts[name] = {**host, "store": str(store)}
    at.mkdir()
    out = build(tmp / "node.tar", tmp / "build")
    assert out.returncode == 0, out.stderr
    nodes = [{"name": n, "runtime": RUNTIMES[n], "files": files.get(n, {}),
              "mounts": {str(at): hosts[n]["store"]} if n in hosts else {}} for n in (A, B, C)]  # fmt: skip
    flags = dict(kubecheck.LOST_NODE_FLAGS)
    flags["kube-apiserver"] = [*flags["kube-apiserver"], "--enable-admission-plugins=ExtendedResourceToleration"]
    with kubecheck.nodes_of_their_own(tmp, nodes, flags) as cluster:
        api = cluster[A]
        for name in hosts:
            cluster[name].import_image(str(tmp / "node.tar"))
            api.kubectl("label", "node", name, f"{NFD_LABEL}=true")  # as NFD's worker would
        docs = kubecheck.node_manifests({"root": str(at)}, tmp, None, None, {"RESTART": "signal"},
                                        keep_node_selectors=True, keep_propagation=True, moved=False)  # fmt: skip
        for doc in docs:
            if doc["kind"] == "ConfigMap":
                with open(os.path.join(CLUSTER_DIR, "device-plugin.yaml")) as f:
                    doc["data"]["device-plugin.yaml"] = f.read()
            elif doc["kind"] == "DaemonSet":
                # No exec probes: this machine's bounding set lacks CAP_SYS_RESOURCE, which runc's
                # exec into a privileged container asks for under CRI-O, so they would fail on A
                # and the kubelet restart the device plugin every two minutes. (tests/e2e/
                # test_deploy.py runs each exec probe in its container as the kubelet would.)
                for container in doc["spec"]["template"]["spec"]["containers"]:
                    for probe in ("livenessProbe", "readinessProbe"):
                        if "exec" in container.get(probe, {}):
                            del container[probe]
        applied = time.monotonic()
        api.apply(*docs, *cluster_file("priorityclasses.yaml"))
        api.wait_until(lambda: all_running(api), 600, "every pod of ours running")
        rolled_out = time.monotonic() - applied
        for name in hosts:
            node = cluster[name]
            node.wait_until(node.hook_ready, 600, f"GPUHookReady True on {name}")
        expected = {A: {"nvidia.com/gpu": str(4 * REPLICAS), "nvidia.com/mig-1g.5gb": "4",
                        "nvidia.com/mig-2g.10gb": "4", "nvidia.com/mig-3g.20gb": "4"},
                    B: {"nvidia.com/gpu": str(4 * REPLICAS)}}  # fmt: skip
        for name, wanted in expected.items():
            cluster[name].wait_until(lambda name=name, wanted=wanted: gpu_allocatable(cluster[name]) == wanted, 120,
                                     f"{name} to offer {wanted}")  # fmt: skip
        # The labels our labels pods write, put on the Nodes as NFD's master would.
        for name in hosts:
            node = cluster[name]
            node.wait_until(lambda node=node: "nvidia.com/gpu.product" in features(node), 180,
                            f"the labels pod on {name} to write its feature file")  # fmt: skip
            api.kubectl("label", "node", name, "--overwrite",
                        *[f"{k}={v}" for k, v in features(node).items() if k.startswith("nvidia.com/")])  # fmt: skip
        assert cluster[C].node_gpus() is None
        yield cluster, hosts, rolled_out


def all_running(api) -> bool:
    """Our DaemonSets' pods on both GPU nodes (toolkit, node services, labels), each running with
    every container ready."""
    pods = [p for p in api.get("pods", "-n", NS)["items"]
            if p["metadata"].get("labels", {}).get("app.kubernetes.io/name") in DAEMONSETS]  # fmt: skip
    ready = [p for p in pods if p["status"].get("phase") == "Running"
             and all(c.get("ready") for c in p["status"].get("containerStatuses") or [{}])]  # fmt: skip
    return len(ready) == len(DAEMONSETS) * len(GPU_NODES) == len(pods)


def gpu_allocatable(node) -> dict:
    return {k: v for k, v in node.node_allocatable().items() if k.startswith("nvidia.com/")}


def features(node) -> dict:
    """The node's feature file, read as NFD reads it (through the link in features.d)."""
    try:
        with open(node.on_node(f"{FEATURES_D}/oci-gpu-hook")) as f:
            return dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)
    except FileNotFoundError:
        return {}


def pod(name: str, command: str = "nvidia-smi -L; sleep 3600", resources: dict | None = None,
        namespace: str = "default", **spec) -> dict:  # fmt: skip
    """A pod of the test image on the node's network (no CNI here), asking for resources."""
    container = {"name": kubeletcheck.CONTAINER, "image": kubeletcheck.IMAGE, "imagePullPolicy": "Never",
                 "command": ["sh", "-c", command]}  # fmt: skip
    if resources:
        container["resources"] = {"limits": resources}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"hostNetwork": True, "automountServiceAccountToken": False, "restartPolicy": "Never",
                     "terminationGracePeriodSeconds": 1, "containers": [container], **spec}}  # fmt: skip
