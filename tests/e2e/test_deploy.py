"""The node services as a DaemonSet (issue 28, second part): deploy/build-image.py builds the image
offline, it is imported into the cluster's containerd (tests/kubecheck.py), and the manifests in
deploy/kubernetes/ are applied with kubectl. For the simulated host the test changes only what
names the host: the image's configuration (the simulated driver root, the hook's records
directory), hostPath volumes for those two, a port of its own for the exporter, no NFD
nodeSelector (NFD is not here: the test makes the features.d directory NFD would), and no
HostToContainer propagation (this machine's / is not a shared mount: it has no systemd). The
hook on the node accepts the device plugin's volume-mounts answer and not the variable from
unprivileged containers, as docs/deploy.md says to set it. Then, through the API:
- the DaemonSet's pod runs on the node, all four services in it, ready; every exec probe, run in
  its container as the kubelet runs it, passes;
- the labels container, without any capability, writes the feature file its configuration
  names, read here where the pod's hostPath volume puts it on the host: exactly the simulated
  host's labels (its description, not the code under test), with the MIG strategy of the
  plugin's file in the ConfigMap;
- the watchdog says what it watches, and its heartbeat (what its liveness probe reads) beats;
- the exporter answers on IPv6 and IPv4;
- the device plugin registers from inside the pod: the node offers nvidia.com/gpu, and no plugin
  runs on the host;
- a GPU pod is scheduled through it and sees exactly its GPU;
- the exporter answers through its Service (the API server's service proxy), naming that pod;
- the pod's own GPU memory limit is enforced by the DaemonSet's watchdog: over it, the pod is
  killed (137), the watchdog logs the kill and the exporter counts it;
- ready means answering: a stopped exporter (its port still accepting connections) is taken out
  of ready by its readiness probe, and is ready again, the same process, once it answers;
- no container was restarted by its liveness probe meanwhile;
- deleting the DaemonSet takes the GPUs off the node's allocatable resources.
(tests/deploy/test_manifests.py checks the manifests themselves without a cluster.)
"""

import glob
import json
import os
import re
import signal
import time
import urllib.request

import hookcheck
import kubecheck
import kubeletcheck
import pytest
import yaml
from hookcheck import listed_uuids

pytestmark = pytest.mark.host(gpus=3, mig=[], needs=("runc", "busybox", "containerd", "ctr", "openssl"))

REPO = kubeletcheck.REPO
PORT = 19400
NS = "oci-gpu-hook"
SERVICES = ("device-plugin", "exporter", "labels", "watchdog")  # each container is named after its command
LIMIT = 256 << 20  # the GPU pod's own memory limit (OCI_GPU_HOOK_GPU_MEMORY_LIMIT)


@pytest.fixture(scope="module")
def deployed(host, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deploy")
    records = tmp / "run" / "containers"
    # What docs/deploy.md says the host's hook needs for the shipped volume-mounts answer.
    settings = f"records_directory: {records}\naccept_volume_mounts: true\naccept_envvar_when_unprivileged: false\n"
    with kubecheck.cluster_on(host, tmp, settings) as cluster:
        cluster.ctr("images", "import", build_image(tmp))
        cluster.apply(*manifests(host, tmp, str(records)))
        yield cluster, host, tmp


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
            # sys_root: the simulated host's sysfs (its PCI classes, its DMI name), as proc_root.
            config["node"].update(exporter_listen=f":{PORT}", sys_root=root)
            doc["data"]["config.yaml"] = yaml.safe_dump(config)
        elif doc["kind"] == "DaemonSet":
            spec = doc["spec"]["template"]["spec"]
            spec.pop("nodeSelector")
            moved = {"/run/oci-gpu-hook": str(tmp / "run"), "/etc/kubernetes/node-feature-discovery/features.d":
                     str(tmp / "features"), "/run/nvidia/mps": str(tmp / "mps")}  # fmt: skip
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


def allocatable(cluster) -> str | None:
    return (cluster.node() or {}).get("status", {}).get("allocatable", {}).get("nvidia.com/gpu")


def daemonset_pod(cluster) -> dict:
    (pod,) = cluster.get("pods", "-n", NS)["items"]
    return pod


def container_status(pod: dict, name: str) -> dict:
    (status,) = [s for s in pod["status"]["containerStatuses"] if s["name"] == name]
    return status


def container_spec(pod: dict, name: str) -> dict:
    (spec,) = [c for c in pod["spec"]["containers"] if c["name"] == name]
    return spec


def service_pid(pod: dict, name: str) -> int:
    """The host pid of the pod's `oci-gpu-hook NAME` (the launcher's python, in the pod's cgroup)."""
    found = []
    for pid, argv in hookcheck.command_lines().items():
        if b"/usr/bin/oci-gpu-hook" in argv and name.encode() in argv:
            try:
                with open(f"/proc/{pid}/cgroup") as f:
                    if f"pod{pod['metadata']['uid']}" in f.read():
                        found.append(pid)
            except OSError:
                continue  # gone meanwhile
    (pid,) = found
    return pid


def configured(cluster) -> tuple:
    """(the services' configuration, the device plugin's), from the ConfigMap the cluster holds."""
    data = cluster.get("configmap", "-n", NS, "oci-gpu-hook-node")["data"]
    return yaml.safe_load(data["config.yaml"]), yaml.safe_load(data["device-plugin.yaml"])


def on_the_host(pod: dict, container: str, path: str) -> str:
    """Where path, in the pod's container, lies on the host: through the hostPath volume mounted
    at its directory or above (a path on no such volume is the pod's own, and lost with it)."""
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = container_spec(pod, container)["volumeMounts"]
    for mount in sorted(mounts, key=lambda m: len(m["mountPath"]), reverse=True):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix) and "hostPath" in volumes[mount["name"]]:
            return os.path.join(volumes[mount["name"]]["hostPath"]["path"], path[len(prefix) :])
    raise AssertionError(f"{container}: {path} is on none of the pod's hostPath volumes")


def run_probe(cluster, pod: dict, container: str, probe: str) -> int:
    """The container's exec probe, run in it as the kubelet runs it (the CRI's exec, through
    containerd); its exit status."""
    command = container_spec(pod, container)[probe]["exec"]["command"]
    container_id = container_status(pod, container)["containerID"].split("://", 1)[1]
    out = cluster.ctr("tasks", "exec", "--fifo-dir", os.path.join(cluster.containerd_dir, "fifo"), "--exec-id",
                      f"probe-{time.monotonic_ns()}", container_id, *command, check=False,
                      timeout=60)  # fmt: skip
    return out.returncode


def metrics(cluster) -> str:
    """The exporter's page through its Service (the API server's service proxy); "" while none answers."""
    return cluster.kubectl("get", "--raw", f"/api/v1/namespaces/{NS}/services/oci-gpu-hook-exporter:metrics"
                           "/proxy/metrics", check=False).stdout  # fmt: skip


def test_the_daemonset_runs_and_its_plugin_offers_the_gpus(deployed):
    cluster, host, tmp = deployed

    def running():
        pods = cluster.get("pods", "-n", NS)["items"]
        return len(pods) == 1 and all(s.get("ready") for s in pods[0]["status"].get("containerStatuses") or [{}])

    cluster.wait_until(running, 120, "the DaemonSet's pod with its four services ready")
    pod = daemonset_pod(cluster)
    assert pod["spec"]["nodeName"] == cluster.node_name
    assert sorted(s["name"] for s in pod["status"]["containerStatuses"]) == list(SERVICES)
    cluster.wait_until(lambda: allocatable(cluster) == "3", 60, "the pod's plugin to offer three GPUs")
    # Every exec probe passes where the kubelet runs it: the image's python3, the paths it reads
    # as the container sees them (the heartbeats come after each service's first round).
    exec_probes = [(c["name"], probe) for c in pod["spec"]["containers"]
                   for probe in ("readinessProbe", "livenessProbe") if "exec" in c.get(probe, {})]  # fmt: skip
    assert {name for name, _ in exec_probes} == {"device-plugin", "labels", "watchdog"}
    for name, probe in exec_probes:
        passes = lambda name=name, probe=probe: run_probe(cluster, pod, name, probe) == 0  # noqa: E731
        cluster.wait_until(passes, 60, f"{name}'s {probe} to pass")
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
    # Its feature file, read where the DaemonSet's hostPath volume puts the file its configuration
    # names (NFD's features.d; here the test's directory): the simulated host's labels, with the
    # strategy of the plugin's file in the ConfigMap, which the labels read as the plugin does.
    config, plugin = configured(cluster)
    features = on_the_host(pod, "labels", config["node"]["features_file"])
    assert features == str(tmp / "features" / "oci-gpu-hook")
    expected = hookcheck.expected_labels(host, plugin["flags"]["migStrategy"])

    def written() -> dict:
        try:
            with open(features) as f:
                return dict(line.split("=", 1) for line in f.read().splitlines())
        except FileNotFoundError:
            return {}

    try:  # a round without the others' inventory cache may write less; the next (60 s) has it all
        cluster.wait_until(lambda: written() == expected, 75, "the labels container to write the host's labels")
    except AssertionError:
        pass  # the comparison below says what differs
    labels = written()
    assert labels == expected
    # The literal values of this 3-GPU A100 host, so that a wrong description cannot agree with itself.
    assert [labels[f"nvidia.com/{k}"] for k in ("gpu.count", "gpu.product", "mig.strategy", "gpu.replicas")] == [
        "3", "NVIDIA-A100-SXM4-40GB", "none", "1"]  # fmt: skip
    assert f"oci-gpu-hook labels: {config['node']['features_file']}: labels written" in cluster.log_of(pod, "labels")
    # The watchdog says what it watches (the hook's records), and beats: its liveness probe's file
    # (in the watchdog's own emptyDir) is touched again after each scan.
    watchdog = service_pid(pod, "watchdog")
    records = config["records_directory"]
    assert f"oci-gpu-hook watchdog: watching {records} every 1 s: policy kill" in cluster.log_of(pod, "watchdog")
    command = container_spec(pod, "watchdog")["command"]
    heartbeat = command[command.index("--heartbeat") + 1]
    beat = f"/proc/{watchdog}/root{heartbeat}"
    first = os.stat(beat).st_mtime
    cluster.wait_until(lambda: os.stat(beat).st_mtime > first, 15, "the watchdog's heartbeat to beat again")
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
                                    "env": [{"name": "OCI_GPU_HOOK_GPU_MEMORY_LIMIT", "value": f"{LIMIT >> 20}MiB"}],
                                    "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}  # fmt: skip
    cluster.apply(pod)
    seen = {}

    def listed_its_gpu():
        (api_pod,) = cluster.pods_of("app=cuda")
        seen["uuids"] = listed_uuids(cluster.log_of(api_pod)) if api_pod["status"].get("phase") == "Running" else []
        return bool(seen["uuids"])

    cluster.wait_until(listed_its_gpu, 90, "the GPU pod to list its GPU")
    (uuid,) = seen["uuids"]
    assert uuid in {g["uuid"] for g in host["gpus"]}

    from oci_gpu_hook.toolkit.simulate import control

    pid = cluster.container_pid("cuda")
    control.write(host["root"], processes=[(uuid, pid, LIMIT - (56 << 20))])  # under its limit
    try:
        text = {}

        def scraped():
            text["metrics"] = metrics(cluster)
            return "oci_gpu_hook_container_gpu_memory_used_bytes{" in text["metrics"]

        cluster.wait_until(scraped, 60, "the exporter's metrics through its Service, with the GPU pod")
        (line,) = [x for x in text["metrics"].splitlines()
                   if x.startswith("oci_gpu_hook_container_gpu_memory_used_bytes{")]  # fmt: skip
        assert 'pod="cuda"' in line and 'namespace="default"' in line and f'UUID="{uuid}"' in line, line
        assert cluster.pods_of("app=cuda")[0]["status"]["phase"] == "Running"  # under its limit: left alone

        # Over its limit: the DaemonSet's watchdog kills the pod's processes on that GPU.
        control.write(host["root"], processes=[(uuid, pid, LIMIT + (64 << 20))])

        def killed():
            (status,) = cluster.pods_of("app=cuda")[0]["status"].get("containerStatuses") or [{}]
            return "terminated" in status.get("state", {})

        cluster.wait_until(killed, 60, "the DaemonSet's watchdog to kill the GPU pod over its limit")
    finally:
        control.clear(host["root"])
    (status,) = cluster.pods_of("app=cuda")[0]["status"]["containerStatuses"]
    assert status["state"]["terminated"]["exitCode"] == 137, status  # SIGKILL, the watchdog's
    log = cluster.log_of(daemonset_pod(cluster), "watchdog")
    (kill,) = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert {k: kill[k] for k in ("action", "pod", "namespace", "device", "pids", "limit_bytes")} == {
        "action": "kill", "pod": "cuda", "namespace": "default", "device": uuid, "pids": [pid], "limit_bytes": LIMIT,
    }  # fmt: skip
    counted = re.compile(r'^oci_gpu_hook_watchdog_actions_total\{action="kill"\} 1$', re.M)
    cluster.wait_until(lambda: counted.search(metrics(cluster)), 30, "the exporter to count the watchdog's kill")
    cluster.kubectl("delete", "pod/cuda", "--wait=true", "--timeout=60s")


def test_ready_means_the_exporter_answers(deployed):
    """Its readiness probe asks the exporter itself (its /): stopped (SIGSTOP: the process still
    runs and its port still accepts connections, but nothing answers), it is taken out of ready,
    so out of its Service's endpoints; continued, it is ready again, the same process (its
    liveness probe's three failures, 30 s apart, take longer than the readiness probe's)."""
    cluster, host, _ = deployed

    def exporter_ready(wanted: bool):
        return lambda: container_status(daemonset_pod(cluster), "exporter").get("ready") is wanted

    cluster.wait_until(exporter_ready(True), 60, "the exporter to be ready")
    pid = service_pid(daemonset_pod(cluster), "exporter")
    os.kill(pid, signal.SIGSTOP)
    try:
        cluster.wait_until(exporter_ready(False), 60, "the stopped exporter to be taken out of ready")
    finally:
        os.kill(pid, signal.SIGCONT)
    cluster.wait_until(exporter_ready(True), 60, "the exporter to be ready again once it answers")
    assert service_pid(daemonset_pod(cluster), "exporter") == pid


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
