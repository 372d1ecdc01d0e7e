"""The node services as DaemonSets (issue 28, second part; issue 46 gave the labels a pod of their
own): deploy/build-image.py builds the image offline, it is imported into the cluster's
containerd (tests/kubecheck.py), and the manifests in deploy/kubernetes/ are applied with
kubectl. For the simulated host the test changes only what names the host: the image's
configuration (the simulated driver root, sysfs and the hook's records directory), hostPath
volumes for those (the simulated root read-only for labels, whose sysfs it is), the host paths
of the inventory cache, features.d and the MPS root (the test's own), a port of its own for the
exporter, no NFD nodeSelector (NFD is not here: the test makes the features.d directory NFD
would), no HostToContainer propagation (this machine's / is not a shared mount: it has no
systemd), and the host's network for the labels pod too (this cluster has no CNI plugin to give
a pod a network of its own). The hook on the node accepts the device plugin's volume-mounts
answer and not the variable from unprivileged containers, as docs/deploy.md says to set it.
Then, through the API:
- the node pod runs on the node with its three services ready, and the labels pod with its one;
  every exec probe, run in its container as the kubelet runs it, passes;
- the labels container, another user than root without any capability, writes the feature file
  its configuration names, read here as NFD reads it (through the link its init container made
  in features.d): exactly the simulated host's labels (its description, not the code under
  test), with the MIG strategy of the plugin's file in the ConfigMap;
- that container is no one on the host (issue 46): not uid 0, in a PID namespace of its own, it
  can signal no process of the host's, connect to none of its sockets and write nothing under
  any host path it has but its own directory;
- the watchdog says what it watches, and its heartbeat (what its liveness probe reads) beats;
- the exporter answers on IPv6 and IPv4;
- the toolkit DaemonSet runs the validation gates (route A: the hook is on the node already, so
  it installs nothing); the device plugin registers from inside the pod once gate toolkit
  passed: the node offers nvidia.com/gpu, and no plugin runs on the host;
- a GPU pod is scheduled through it and sees exactly its GPU;
- the exporter answers through its Service (the API server's service proxy), naming that pod;
- the pod's own GPU memory limit is enforced by the DaemonSet's watchdog: over it, the pod is
  killed (137), the watchdog logs the kill and the exporter counts it;
- ready means answering: a stopped exporter (its port still accepting connections) is taken out
  of ready by its readiness probe, and is ready again, the same process, once it answers;
- no container was restarted by its liveness probe meanwhile;
- deleting the DaemonSets takes the GPUs off the node's allocatable resources (the toolkit's,
  with --no-install, leaves the hook).
(tests/deploy/test_manifests.py checks the manifests themselves without a cluster.)
"""

import json
import os
import re
import signal
import socket
import time
import urllib.request

import hookcheck
import kubecheck
import kubeletcheck
import pytest
import yaml
from hookcheck import listed_uuids

from oci_gpu_hook.start.prefilter_rule import START_SERVER_SOCKET

pytestmark = pytest.mark.host(gpus=3, mig=[], needs=("runc", "busybox", "containerd", "ctr", "openssl"))

REPO = kubeletcheck.REPO
PORT = 19400
NS = "oci-gpu-hook"
SERVICES = ("device-plugin", "exporter", "labels", "toolkit", "watchdog")  # each container is named after its command
# The DaemonSets, each its pod's app.kubernetes.io/name.
NODE, LABELS, TOOLKIT = "oci-gpu-hook-node", "oci-gpu-hook-labels", "oci-gpu-hook-toolkit"
PODS = {NODE: ["device-plugin", "exporter", "watchdog"], LABELS: ["labels"], TOOLKIT: ["toolkit"]}
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
    """The manifests for the simulated host (kubecheck.node_manifests). The hook is on the node
    already (route A, as the RPM puts it): the toolkit only runs the gates (--no-install)."""
    return kubecheck.node_manifests(host, tmp, records, PORT, {"INSTALL": "--no-install"})


def daemonset_pod(cluster, name: str = NODE) -> dict:
    (pod,) = cluster.get("pods", "-n", NS, "-l", f"app.kubernetes.io/name={name}")["items"]
    return pod


def pod_with(cluster, container: str) -> dict:
    """The namespace's pod that runs container."""
    (pod,) = [p for p in cluster.get("pods", "-n", NS)["items"]
              if container in {c["name"] for c in p["spec"]["containers"]}]  # fmt: skip
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


def host_mounts(pod: dict, container: str) -> dict:
    """{mountPath: the host path there} of the container's hostPath volumes (with a subPath, the
    path below the volume's)."""
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    found = {}
    for mount in container_spec(pod, container)["volumeMounts"]:
        if "hostPath" in volumes[mount["name"]]:
            host = os.path.join(volumes[mount["name"]]["hostPath"]["path"], mount.get("subPath", ""))
            found[mount["mountPath"]] = host.rstrip("/") or "/"
    return found


def on_the_host(pod: dict, container: str, path: str) -> str:
    """Where path, in the pod's container, lies on the host: through the hostPath volume mounted
    at its directory or above (a path on no such volume is the pod's own, and lost with it)."""
    for mount_path, host in sorted(host_mounts(pod, container).items(), key=lambda m: len(m[0]), reverse=True):
        prefix = mount_path.rstrip("/") + "/"
        if path.startswith(prefix):
            return os.path.join(host, path[len(prefix) :])
    raise AssertionError(f"{container}: {path} is on none of the pod's hostPath volumes")


def in_the_container(pod: dict, container: str, host_path: str) -> list:
    """Every path at which the container sees host_path (through each hostPath volume that holds
    it), and host_path itself, in case its own tree has one."""
    found = [host_path]
    for mount_path, host in host_mounts(pod, container).items():
        if host_path == host or host_path.startswith(host.rstrip("/") + "/"):
            found.append(mount_path.rstrip("/") + host_path[len(host.rstrip("/")) :])
    return found


def exec_in(cluster, pod: dict, container: str, command: list, timeout: float = 60):
    """command run in the pod's container as the kubelet runs an exec probe (the CRI's exec,
    through containerd: the container's user, capabilities and namespaces)."""
    container_id = container_status(pod, container)["containerID"].split("://", 1)[1]
    return cluster.ctr("tasks", "exec", "--fifo-dir", os.path.join(cluster.containerd_dir, "fifo"), "--exec-id",
                       f"probe-{time.monotonic_ns()}", container_id, *command, check=False,
                       timeout=timeout)  # fmt: skip


def run_probe(cluster, pod: dict, container: str, probe: str) -> int:
    """The container's exec probe, run in it as the kubelet runs it; its exit status."""
    return exec_in(cluster, pod, container, container_spec(pod, container)[probe]["exec"]["command"]).returncode


def metrics(cluster) -> str:
    """The exporter's page through its Service (the API server's service proxy); "" while none answers."""
    return cluster.kubectl("get", "--raw", f"/api/v1/namespaces/{NS}/services/oci-gpu-hook-exporter:metrics"
                           "/proxy/metrics", check=False).stdout  # fmt: skip


def test_the_daemonset_runs_and_its_plugin_offers_the_gpus(deployed):
    cluster, host, tmp = deployed

    def running():
        pods = cluster.get("pods", "-n", NS)["items"]
        return len(pods) == len(PODS) and all(s.get("ready") for pod in pods
                                              for s in pod["status"].get("containerStatuses") or [{}])  # fmt: skip

    cluster.wait_until(
        running, 180, "the DaemonSets' pods with their four services ready (the exporter once the gates passed)"
    )
    pods = {name: daemonset_pod(cluster, name) for name in PODS}
    pod, labels_pod = pods[NODE], pods[LABELS]
    for name, services in PODS.items():
        assert pods[name]["spec"]["nodeName"] == cluster.node_name
        assert sorted(s["name"] for s in pods[name]["status"]["containerStatuses"]) == services
    assert sorted(sum(PODS.values(), [])) == list(SERVICES)
    cluster.wait_until(lambda: cluster.node_gpus() == "3", 120, "three GPUs once gate toolkit passed")
    # Every exec probe passes where the kubelet runs it: the image's python3, the paths it reads
    # as the container sees them (the heartbeats come after each service's first round).
    exec_probes = [(p, c["name"], probe) for p in pods.values() for c in p["spec"]["containers"]
                   for probe in ("readinessProbe", "livenessProbe") if "exec" in c.get(probe, {})]  # fmt: skip
    assert {name for _, name, _ in exec_probes} == {"device-plugin", "labels", "toolkit", "watchdog"}
    for in_pod, name, probe in exec_probes:
        passes = lambda in_pod=in_pod, name=name, probe=probe: run_probe(cluster, in_pod, name, probe) == 0  # noqa: E731
        cluster.wait_until(passes, 60, f"{name}'s {probe} to pass")
    # The only device plugin running is the pod's: every such process is in the pod's cgroup.
    plugins = [pid for pid, argv in hookcheck.command_lines().items() if b"device-plugin" in argv]
    assert plugins
    for pid in plugins:
        with open(f"/proc/{pid}/cgroup") as f:
            assert f"pod{pod['metadata']['uid']}" in f.read(), pid
    # labels: another user than root, no capability, no new privileges, and still its file in
    # features.d (test_the_labels_container_is_no_one_on_the_host says what it cannot do).
    (labels,) = [pid for pid, argv in hookcheck.command_lines().items() if b"labels" in argv and b"--heartbeat" in argv]
    with open(f"/proc/{labels}/status") as f:
        status = dict(line.split(":", 1) for line in f.read().splitlines())
    assert [status[k].strip() for k in ("CapEff", "CapPrm", "CapBnd", "NoNewPrivs")] == ["0000000000000000"] * 3 + ["1"]
    uid = container_spec(labels_pod, "labels")["securityContext"]["runAsUser"]
    assert uid != 0 and status["Uid"].split() == [str(uid)] * 4, status["Uid"]
    # Its feature file, read as NFD reads it: features.d/oci-gpu-hook (here the test's directory),
    # the link the init container made to the file the labels' configuration names, in the one
    # directory of features.d the labels may write. The simulated host's labels, with the
    # strategy of the plugin's file in the ConfigMap, which the labels read as the plugin does.
    config, plugin = configured(cluster)
    written_at = on_the_host(labels_pod, "labels", config["node"]["features_file"])
    assert written_at == str(tmp / "features" / ".oci-gpu-hook" / "oci-gpu-hook")
    features = str(tmp / "features" / "oci-gpu-hook")
    assert os.readlink(features) == ".oci-gpu-hook/oci-gpu-hook"
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
    assert os.stat(written_at).st_uid == uid
    assert f"oci-gpu-hook labels: {config['node']['features_file']}: labels written" in cluster.log_of(
        labels_pod, "labels")  # fmt: skip
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
    cluster.wait_until(lambda: cluster.node_gpus() == "3", 120, "the pod's plugin to offer three GPUs")
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


# Run in the labels container with its python3, as an exec probe runs (its user, no capability):
# what it can do to the host. argv[1], JSON: host pids to signal (0: is it there, may I), socket
# paths to connect to, the host paths it has (each walked, submounts and all, to make a file in
# each directory and open each file for writing: nothing is truncated or left), and its own
# directory (expected writable, not walked). Prints what succeeded, as JSON.
REACH = r"""
import json, os, socket, stat, sys

plan = json.loads(sys.argv[1])
found = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups())}
with open("/proc/1/cmdline", "rb") as f:
    found["pid 1"] = [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
found["signalled"] = []
for pid in plan["pids"]:
    try:
        os.kill(pid, 0)
    except OSError:
        continue
    found["signalled"].append(pid)
found["connected"] = []
for path in plan["sockets"]:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        try:
            s.connect(path)
        except OSError:
            continue
    found["connected"].append(path)
points = {}
with open("/proc/self/mountinfo") as f:
    for line in f:
        fields = line.split()
        points[fields[4].encode().decode("unicode_escape")] = fields[fields.index("-") + 1]
# The kernel's own interfaces are not walked: opening one of their files may act.
kernel = {p for p, kind in points.items() if kind in ("proc", "sysfs", "debugfs", "tracefs", "securityfs",
                                                      "configfs", "bpf", "cgroup", "cgroup2", "fusectl")}
tops = plan["tops"]
under = lambda path, top: path == top or path.startswith(top.rstrip("/") + "/")
places = sorted(set(tops) | {p for p in points if any(under(p, t) for t in tops)})
found["submounts"] = sorted(set(places) - set(tops))
written, looked = set(), 0
for place in (p for p in places if p not in kernel):
    for directory, dirs, files in os.walk(place):
        dirs[:] = [d for d in dirs if os.path.join(directory, d) not in kernel]
        looked += 1 + len(files)
        if looked > 50000:
            found["cut short"] = directory
            break
        probe = os.path.join(directory, ".reach-probe")
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        except OSError:
            pass
        else:
            os.unlink(probe)
            written.add(directory)
        if under(directory, plan["own"]):
            dirs[:] = []
            continue
        for name in files:
            path = os.path.join(directory, name)
            try:
                if not stat.S_ISREG(os.lstat(path).st_mode):
                    continue
                os.close(os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK))
            except OSError:
                continue
            written.add(path)
found["writable"] = sorted(written)
print(json.dumps(found))
"""


def accepts(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(5)
        try:
            client.connect(path)
        except OSError:
            return False
    return True


def test_the_labels_container_is_no_one_on_the_host(deployed):
    """Issue 46, item 2. labels was root in all but its capabilities: uid 0 in the host's user and
    PID namespaces, with the host's / read-only at /host. A read-only bind is read-only at its top
    only: the host's /run under it was writable, and from there it rewrote the hook's compiled
    settings; it stopped and killed root's processes, and connected to root-only sockets (the
    runtime's, systemd's). Now, from inside the running container, as its exec probes run: its
    uid is not 0 and its PID namespace is its own (its pid 1 is labels itself); it can signal
    none of root's processes on the host (containerd, the kubelet, the exporter, this test);
    it can connect to none of the host's sockets (containerd's, the kubelet's device-plugin
    socket, the start server's and, where the labels pod would see them, root-only sockets this
    test listens on in the inventory cache and in its features.d directory); and it can write
    nothing under any host path it has, submounts included, but its own directory in
    features.d."""
    cluster, host, tmp = deployed

    def ready():
        statuses = pod_with(cluster, "labels")["status"].get("containerStatuses") or []
        return any(s["name"] == "labels" and s.get("ready") for s in statuses)

    cluster.wait_until(ready, 120, "the labels container to be ready")
    labels_pod, node_pod = pod_with(cluster, "labels"), pod_with(cluster, "exporter")
    config, _ = configured(cluster)
    own = os.path.dirname(config["node"]["features_file"])
    mounts = host_mounts(labels_pod, "labels")
    listening = []
    try:
        # Root's alone (0600), listening, in the host directories the labels pod has: the node
        # pod's inventory cache, NFD's features.d and, in it, the labels' own directory (those of
        # them that are there: before issue 46 the cache was an emptyDir).
        own_on_the_host = os.path.dirname(on_the_host(labels_pod, "labels", f"{own}/x"))
        for directory in sorted({f"{tmp}/cache", f"{tmp}/features", own_on_the_host}):
            if not os.path.isdir(directory):
                continue
            server = socket.socket(socket.AF_UNIX)
            path = os.path.join(directory, "root-only.sock")
            server.bind(path)
            os.chmod(path, 0o600)
            server.listen()
            listening.append((server, path))
        # Only sockets that take a connection here, from root: so that none taken there means
        # that the pod could not reach one, not that nothing was listening.
        reachable = [path for path in [cluster.address, cluster.kubelet_socket, START_SERVER_SOCKET,
                                       *(path for _, path in listening)] if accepts(path)]  # fmt: skip
        assert {cluster.address, cluster.kubelet_socket} | {path for _, path in listening} <= set(reachable)
        plan = {
            "pids": [cluster.containerd.pid, cluster.kubelet.pid, service_pid(node_pod, "exporter"), os.getpid()],
            "sockets": sorted({q for p in reachable for q in in_the_container(labels_pod, "labels", p)}),
            "tops": sorted(mounts),
            "own": own,
        }
        out = exec_in(cluster, labels_pod, "labels", ["/usr/bin/python3", "-I", "-c", REACH, json.dumps(plan)],
                      timeout=120)  # fmt: skip
    finally:
        for server, path in listening:
            server.close()
            os.unlink(path)
    assert out.returncode == 0, out.stdout + out.stderr
    found = json.loads(out.stdout)
    uid = container_spec(labels_pod, "labels")["securityContext"]["runAsUser"]
    assert found["uid"] == uid != 0 and 0 not in [found["gid"], *found["groups"]], found
    assert "labels" in found["pid 1"] and "--cached-inventory" in found["pid 1"], found["pid 1"]
    assert found["signalled"] == [] and found["connected"] == [], found
    assert found["writable"] == [own] and "cut short" not in found, found
    # Seen from the host: the labels process is in PID and IPC namespaces of its own, not the
    # runtime's (the host's, as this test's).
    (labels,) = [pid for pid, argv in hookcheck.command_lines().items() if b"labels" in argv and b"--heartbeat" in argv]
    for kind in ("pid", "ipc"):
        host_ns = os.readlink(f"/proc/{cluster.containerd.pid}/ns/{kind}")
        assert host_ns == os.readlink(f"/proc/self/ns/{kind}") != os.readlink(f"/proc/{labels}/ns/{kind}"), kind
    assert not any(host.startswith(f"{tmp}/run") or host == "/" for host in mounts.values()), mounts


def test_deleting_the_daemonsets_takes_the_gpus_off_the_node(deployed):
    cluster, host, _ = deployed
    cluster.wait_until(lambda: cluster.node_gpus() == "3", 120, "the pod's plugin to offer three GPUs")
    # The probes held all along (a liveness probe that failed would have restarted its container).
    pods = cluster.get("pods", "-n", NS)["items"]
    restarts = {s["name"]: s["restartCount"] for pod in pods for s in pod["status"]["containerStatuses"]}
    assert restarts == dict.fromkeys(SERVICES, 0), restarts
    cluster.kubectl("delete", "-n", NS, f"daemonset/{NODE}", f"daemonset/{LABELS}", f"daemonset/{TOOLKIT}",
                    "--wait=true", "--timeout=60s")  # fmt: skip
    cluster.wait_until(lambda: cluster.node_gpus() == "0", 60, "the node to offer no GPU")
    cluster.wait_until(lambda: cluster.get("pods", "-n", NS)["items"] == [], 60, "both pods to be gone")
