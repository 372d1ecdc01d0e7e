"""The node services as a DaemonSet (issue 28, second part): deploy/build-image.py builds the image
offline, it is imported into the cluster's containerd (tests/kubecheck.py), and the manifests in
deploy/kubernetes/ are applied with kubectl. For the simulated host the test changes only what
names the host: the image's configuration (the simulated driver root, the hook's records
directory), hostPath volumes for those two, a port of its own for the exporter, no NFD
nodeSelector (NFD is not here: the test makes the features.d directory NFD would), and no
HostToContainer propagation (this machine's / is not a shared mount: it has no systemd). The
hook on the node accepts the device plugin's volume-mounts answer and not the variable from
unprivileged containers, as docs/deploy.md says to set it. Then, through the API:
- the DaemonSet's pod runs on the node, all four services in it, ready; the labels container
  without any capability writes the feature file; the exporter answers on IPv6 and IPv4;
- the device plugin registers from inside the pod: the node offers nvidia.com/gpu, and no plugin
  runs on the host;
- a GPU pod is scheduled through it and sees exactly its GPU;
- the exporter answers through its Service (the API server's service proxy), naming that pod;
- no container was restarted by its liveness probe meanwhile;
- deleting the DaemonSet takes the GPUs off the node's allocatable resources.
(tests/deploy/test_manifests.py checks the manifests themselves without a cluster.)
"""

import glob
import os
import re
import urllib.request

import hookcheck
import kubecheck
import kubeletcheck
import pytest
import yaml
from hookcheck import config_with

pytestmark = pytest.mark.host(gpus=3, mig=[], needs=("runc", "busybox", "containerd", "ctr", "openssl"))

REPO = kubeletcheck.REPO
PORT = 19400
NS = "oci-gpu-hook"


@pytest.fixture(scope="module")
def deployed(host, tmp_path_factory):
    kubecheck.programs()
    tmp = tmp_path_factory.mktemp("deploy")
    records = tmp / "run" / "containers"
    # What docs/deploy.md says the host's hook needs for the shipped volume-mounts answer.
    hook_config = config_with(host, tmp, f"records_directory: {records}\naccept_volume_mounts: true\n"
                                         "accept_envvar_when_unprivileged: false\n")  # fmt: skip
    before = kubecheck.host_state()
    cluster = kubecheck.Cluster(tmp / "node", hook_config)
    try:
        cluster.start()
        image = build_image(tmp)
        cluster.ctr("images", "import", image)
        cluster.apply(*manifests(host, tmp, str(records)))
        yield cluster, host, tmp
    finally:
        cluster.close()
    assert kubecheck.host_state() == before


def build_image(tmp) -> str:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, os.path.join(REPO, "deploy", "build-image.py"), "--output",
                          str(tmp / "node.tar")], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def manifests(host, tmp, records: str) -> list:
    """deploy/kubernetes/*.yaml, with what names the host changed for the simulated one."""
    docs = []
    for path in sorted(glob.glob(os.path.join(REPO, "deploy", "kubernetes", "*.yaml"))):
        with open(path) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    root = host["root"]
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            config = yaml.safe_load(doc["data"]["config.yaml"])
            config.update(driver_root=root, dev_root=root, proc_root=root, records_directory=records)
            # features_file stays the manifest's: the features volume below puts it under tmp.
            config["node"].update(exporter_listen=f":{PORT}")
            doc["data"]["config.yaml"] = yaml.safe_dump(config)
        elif doc["kind"] == "DaemonSet":
            spec = doc["spec"]["template"]["spec"]
            spec.pop("nodeSelector")
            moved = {"/run/oci-gpu-hook": str(tmp / "run"), "/etc/kubernetes/node-feature-discovery/features.d":
                     str(tmp / "features")}  # fmt: skip
            for volume in spec["volumes"]:
                if "hostPath" in volume and volume["hostPath"]["path"] in moved:
                    volume["hostPath"]["path"] = moved[volume["hostPath"]["path"]]  # the type stays
            spec["volumes"].append({"name": "simulated-host", "hostPath": {"path": root, "type": "Directory"}})
            spec["volumes"].append({"name": "records", "hostPath": {"path": str(tmp / "run"), "type": "Directory"}})
            for container in spec["containers"]:
                # HostToContainer needs / to be a shared mount, as systemd makes it; this machine
                # has no systemd, and its / is private.
                for mount in container["volumeMounts"]:
                    mount.pop("mountPropagation", None)
                container["volumeMounts"].append({"name": "simulated-host", "mountPath": root})
                container["volumeMounts"].append({"name": "records", "mountPath": str(tmp / "run")})
                for port in container.get("ports", []):
                    port["containerPort"] = PORT
    (tmp / "run").mkdir(exist_ok=True)
    (tmp / "features").mkdir(mode=0o755, exist_ok=True)  # NFD's worker makes features.d
    return docs


def listed(text: str) -> list:
    return re.findall(r"UUID: (GPU-[0-9a-f-]+)\)", text)


def allocatable(cluster) -> str | None:
    return (cluster.node() or {}).get("status", {}).get("allocatable", {}).get("nvidia.com/gpu")


def test_the_daemonset_runs_and_its_plugin_offers_the_gpus(deployed):
    cluster, host, tmp = deployed

    def running():
        pods = cluster.get("pods", "-n", NS)["items"]
        return len(pods) == 1 and all(s.get("ready") for s in pods[0]["status"].get("containerStatuses") or [{}])

    cluster.wait_until(running, 120, "the DaemonSet's pod with its four services ready")
    (pod,) = cluster.get("pods", "-n", NS)["items"]
    assert pod["spec"]["nodeName"] == cluster.node_name
    assert sorted(s["name"] for s in pod["status"]["containerStatuses"]) == [
        "device-plugin", "exporter", "labels", "watchdog"]  # fmt: skip
    cluster.wait_until(lambda: allocatable(cluster) == "3", 60, "the pod's plugin to offer three GPUs")
    # The only device plugin running is the pod's: every such process is in the pod's cgroup.
    plugins = [pid for pid, argv in hookcheck.command_lines().items() if b"device-plugin" in argv]
    assert plugins
    for pid in plugins:
        with open(f"/proc/{pid}/cgroup") as f:
            assert f"pod{pod['metadata']['uid']}" in f.read(), pid
    # labels: no capability, no new privileges, and still its file in features.d.
    (labels,) = [pid for pid, argv in hookcheck.command_lines().items() if b"labels" in argv and b"--heartbeat" in argv]
    with open(f"/proc/{labels}/status") as f:
        status = dict(line.split(":", 1) for line in f.read().splitlines())
    assert [status[k].strip() for k in ("CapEff", "CapPrm", "CapBnd", "NoNewPrivs")] == ["0000000000000000"] * 3 + ["1"]
    features = tmp / "features" / "oci-gpu-hook"
    cluster.wait_until(features.exists, 60, "the labels container to write the feature file")
    assert "nvidia.com/gpu.count=3\n" in features.read_text()
    # The exporter on every address (hostNetwork: the node's): IPv6 and IPv4.
    for address in ("[::1]", "127.0.0.1"):
        with urllib.request.urlopen(f"http://{address}:{PORT}/", timeout=30) as r:
            assert r.status == 200, address


def test_a_gpu_pod_and_the_exporter_through_its_service(deployed):
    cluster, host, _ = deployed
    cluster.wait_until(lambda: allocatable(cluster) == "3", 120, "the pod's plugin to offer three GPUs")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cuda", "labels": {"app": "cuda"}},
           "spec": {"hostNetwork": True, "automountServiceAccountToken": False, "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": kubeletcheck.CONTAINER, "image": kubeletcheck.IMAGE,
                                    "imagePullPolicy": "Never", "command": ["sh", "-c", "nvidia-smi -L; sleep 3600"],
                                    "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}  # fmt: skip
    cluster.apply(pod)
    seen = {}

    def listed_its_gpu():
        (api_pod,) = cluster.pods_of("app=cuda")
        seen["uuids"] = listed(cluster.log_of(api_pod)) if api_pod["status"].get("phase") == "Running" else []
        return bool(seen["uuids"])

    cluster.wait_until(listed_its_gpu, 90, "the GPU pod to list its GPU")
    (uuid,) = seen["uuids"]
    assert uuid in {g["uuid"] for g in host["gpus"]}

    from oci_gpu_hook.toolkit.simulate import control

    control.write(host["root"], processes=[(uuid, cluster.container_pid("cuda"), 200 << 20)])
    try:
        text = {}

        def scraped():
            out = cluster.kubectl("get", "--raw", f"/api/v1/namespaces/{NS}/services/oci-gpu-hook-exporter:metrics"
                                  "/proxy/metrics", check=False)  # fmt: skip
            text["metrics"] = out.stdout
            return "oci_gpu_hook_container_gpu_memory_used_bytes{" in out.stdout

        cluster.wait_until(scraped, 60, "the exporter's metrics through its Service, with the GPU pod")
    finally:
        control.clear(host["root"])
    (line,) = [x for x in text["metrics"].splitlines() if x.startswith("oci_gpu_hook_container_gpu_memory_used_bytes{")]
    assert 'pod="cuda"' in line and 'namespace="default"' in line and f'UUID="{uuid}"' in line, line
    cluster.kubectl("delete", "pod/cuda", "--wait=true", "--timeout=60s")


def test_deleting_the_daemonset_takes_the_gpus_off_the_node(deployed):
    cluster, host, _ = deployed
    cluster.wait_until(lambda: allocatable(cluster) == "3", 120, "the pod's plugin to offer three GPUs")
    # The probes held all along (a liveness probe that failed would have restarted its container).
    (pod,) = cluster.get("pods", "-n", NS)["items"]
    restarts = {s["name"]: s["restartCount"] for s in pod["status"]["containerStatuses"]}
    assert restarts == dict.fromkeys(("device-plugin", "exporter", "labels", "watchdog"), 0), restarts
    cluster.kubectl("delete", "-n", NS, "daemonset/oci-gpu-hook-node", "--wait=true", "--timeout=60s")
    cluster.wait_until(lambda: allocatable(cluster) == "0", 60, "the node to offer no GPU")
    assert cluster.get("pods", "-n", NS)["items"] == []
