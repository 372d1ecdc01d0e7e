"""The cluster rolls the hook out itself (issue 47): `kubectl apply` of deploy/kubernetes/ on a
fresh node, with nothing of ours installed, and nothing typed on the node.

The node is a host of its own (kubecheck.Cluster's node_files): the runtime and the kubelet in a
mount namespace whose /etc, /usr/local, /usr/share, /var/lib, /var/cache and /run are overlays; the runtime
reads its own configuration with no flag (containerd the administrators' /etc/containerd/config.toml, CRI-O
/etc/crio/crio.conf.d as `crio config` prints it: no hook in either), under a supervisor that
starts it again when it exits. The first test runs on each: containerd, and CRI-O as the
OpenShift node has it. What the test changes in the manifests names the simulated host
(kubecheck.node_manifests), and two values of the toolkit's documented ones: RESTART=signal (no
systemd runs this node: the supervisor restarts containerd), and the API server by its address
with the validation pods in the node's network (this cluster has neither a Service network nor a
CNI). The host's /etc/oci-gpu-hook/config.yaml is the simulated host's, with the two keys that
`install --accept-volume-mounts` writes on a node that has none (install keeps one it finds).

- NFD's label is on the node, and on a second Node, which has no GPU, it is not: nothing of ours
  is scheduled there (each DaemonSet wants one pod, and none is bound to that Node).
- The gates pass in order, as the API shows them: the events GateToolkitPassed, then
  GatePluginPassed; the device plugin registered only after gate toolkit passed; the labels pod
  (gate d) was made only once gate plugin passed, and the exporter is ready; GPUHookReady is
  True.
- containerd was restarted once by the install, and a pod asking for nvidia.com/gpu: 1 gets
  exactly one of the node's GPUs.
- The toolkit's token changes its own Node's labels under oci-gpu-hook.io/ only: the
  ValidatingAdmissionPolicies refuse another Node, another label, an owner and another condition
  on its own, a privileged validation pod, another node's, and an event about another Node.
- Deleting the toolkit DaemonSet uninstalls: gate toolkit fails first ("being removed"), then
  the node's /etc is byte for byte as before (the runtime's configuration, the units), /usr/local
  as before (no bundle), no /var/lib/oci-gpu-hook, no gates' file, no gate labels and no
  GPUHookReady condition; containerd was restarted to read its configuration back (CRI-O, which
  watches hooks.d, was not), and the device plugin withdraws the GPUs.
And the failures: a containerd whose configuration install cannot wire (a base spec of the
site's own) fails gate toolkit with install's line and advertises nothing; an upgrade to a new
image while GPU pods start one after another keeps every start whole.
"""

from __future__ import annotations

import json
import os

import hookcheck
import kubecheck
import kubeletcheck
import pytest
from hookcheck import config_with, listed_uuids
from imagecheck import build

from oci_gpu_hook.node import gate_report, gate_validation, gates
from oci_gpu_hook.node.kubeapi import ApiError, Client
from oci_gpu_hook.toolkit import launcher

NS = "oci-gpu-hook"
PORT = 19401
NFD_LABEL = "feature.node.kubernetes.io/pci-10de.present"
TOOLKIT = "app.kubernetes.io/name=oci-gpu-hook-toolkit"


def daemonset_pods(cluster, selector: str) -> list:
    return cluster.get("pods", "-n", NS, "-l", selector)["items"]


def exporter_ready(cluster) -> bool:
    """The node pod's exporter container's readiness, as the kubelet's httpGet probe of /ready set
    it. (The pod's own Ready condition is not: the device plugin's exec probes cannot run here, where
    the bounding set lacks a capability a privileged container's exec asks for.)"""
    pods = daemonset_pods(cluster, "app.kubernetes.io/name=oci-gpu-hook-node")
    statuses = (pods[0]["status"].get("containerStatuses") or []) if pods else []
    return any(c["name"] == "exporter" and c.get("ready") for c in statuses)


def readiness_refused(cluster, pod: dict) -> list:
    """The kubelet's events that the pod's readiness probe got 503 (the exporter's /ready waiting)."""
    items = cluster.get("events", "-n", NS, "--field-selector", f"involvedObject.name={pod['metadata']['name']}")
    return [e for e in items["items"] if e.get("reason") == "Unhealthy" and "statuscode: 503" in e.get("message", "")]


def events(cluster) -> list:
    """Our gate events, oldest first: (reason, eventTime, note)."""
    items = cluster.get("events.v1.events.k8s.io", "-n", "default")["items"]  # a Node's events are there
    ours = [e for e in items if e.get("reportingController") == gate_report.CONTROLLER]
    return sorted(((e["reason"], e["eventTime"], e.get("note", "")) for e in ours), key=lambda e: e[1])


def gpu_pod(name: str, app: str) -> dict:
    """A pod asking the scheduler for one GPU, which lists the GPUs it sees and ends."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": app}},
            "spec": {"hostNetwork": True, "automountServiceAccountToken": False, "restartPolicy": "Never",
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": kubeletcheck.CONTAINER, "image": kubeletcheck.IMAGE,
                                     "imagePullPolicy": "Never", "command": ["sh", "-c", "nvidia-smi -L"],
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}  # fmt: skip


def node_prepared(host: dict, tmp_path) -> tuple:
    """The node image built into tmp_path/node.tar, and the node's files: the host's hook
    configuration, the simulated host's with what `install --accept-volume-mounts` writes on a
    node that has none. (records directory, {path: text})."""
    records = tmp_path / "run" / "containers"
    host_config = config_with(host, tmp_path, f"records_directory: {records}\naccept_volume_mounts: true\n"
                                              "accept_envvar_when_unprivileged: false\n")  # fmt: skip
    with open(host_config) as f:
        node_files = {"/etc/oci-gpu-hook/config.yaml": f.read()}
    out = build(tmp_path / "node.tar", tmp_path / "build")
    assert out.returncode == 0, out.stderr
    return records, node_files


RUNTIME_PROGRAMS = {"containerd": ("containerd", "ctr"), "crio": ("podman", "conmon", "containerd")}


@pytest.mark.parametrize("runtime", ["containerd", "crio"])
def test_the_daemonsets_alone_roll_the_hook_out_and_take_it_back(runtime, simulated_host, tmp_path, require):
    require("root", "openssl", "runc", "busybox", "gcc", "unshare", "nsenter", "pynvml", *RUNTIME_PROGRAMS[runtime])
    host = simulated_host(gpus=2)
    records, node_files = node_prepared(host, tmp_path)
    with kubecheck.cluster_of_its_own(tmp_path, node_files, runtime) as cluster:
        node = cluster.node_name

        def trees():
            return {"etc": hookcheck.tree(cluster.on_node("/etc"), contents=True),
                    "usr_local": hookcheck.tree(cluster.on_node("/usr/local"))}  # fmt: skip

        before = trees()
        cluster.import_image(str(tmp_path / "node.tar"))
        cluster.kubectl("label", "node", node, f"{NFD_LABEL}=true")  # as NFD's worker would
        no_gpu = f"no-gpu-{os.getpid()}"
        cluster.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": no_gpu}})
        cluster.apply(*kubecheck.node_manifests(host, tmp_path, str(records), PORT, {"RESTART": "signal"},
                                                keep_node_selectors=True, keep_propagation=True))  # fmt: skip

        cluster.wait_until(cluster.hook_ready, 300, "GPUHookReady True")
        assert cluster.hook_condition()["message"] == "gates passed: toolkit, plugin"
        cluster.wait_until(lambda: cluster.node_gpus() == "2", 60, "two GPUs advertised")
        # The gates in order, from the API's events and times.
        said = events(cluster)
        passed = [(reason, at) for reason, at, _ in said if reason.endswith("Passed")]
        assert [reason for reason, _ in passed] == ["GateToolkitPassed", "GatePluginPassed"], said
        assert not [e for e in said if e[0].endswith("Failed")], said
        plugin_passed = passed[1][1]
        (node_pod,) = daemonset_pods(cluster, "app.kubernetes.io/name=oci-gpu-hook-node")
        plugin_log = cluster.log_of(node_pod, "device-plugin")
        assert plugin_log.index("waiting for gate toolkit to pass") < plugin_log.index("gate toolkit passed"), (
            plugin_log)  # fmt: skip
        cluster.wait_until(lambda: daemonset_pods(cluster, "app.kubernetes.io/name=oci-gpu-hook-labels"), 60,
                           "the labels pod, once gate plugin passed")  # fmt: skip
        (labels_pod,) = daemonset_pods(cluster, "app.kubernetes.io/name=oci-gpu-hook-labels")
        assert labels_pod["metadata"]["creationTimestamp"] >= plugin_passed[:19] + "Z"
        # Gate (d): the exporter ready (a Service endpoint) once every gate passed; the failing
        # test below sees it kept out while gate toolkit has failed.
        cluster.wait_until(lambda: exporter_ready(cluster), 90, "the exporter ready, once every gate passed")
        labels = cluster.node()["metadata"]["labels"]
        assert {k: v for k, v in labels.items() if k.startswith(gate_report.LABEL_PREFIX)} == {
            f"{gate_report.LABEL_PREFIX}toolkit": "passed", f"{gate_report.LABEL_PREFIX}plugin": "passed"}  # fmt: skip
        # Nothing of ours on the Node without a GPU.
        for name in ("oci-gpu-hook-toolkit", "oci-gpu-hook-node", "oci-gpu-hook-labels"):
            status = cluster.get("daemonset", "-n", NS, name)["status"]
            assert status["desiredNumberScheduled"] == 1, (name, status)
        assert [p for p in cluster.get("pods", "-A")["items"] if p["spec"].get("nodeName") == no_gpu] == []
        # Installed: containerd restarted once to read the hook; a GPU pod gets exactly one GPU.
        assert cluster.runtime_starts() == 2
        cluster.apply(gpu_pod("cuda", "cuda"))
        seen = {}

        def listed():
            (pod,) = cluster.pods_of("app=cuda")
            seen["uuids"] = listed_uuids(cluster.log_of(pod)) if pod["status"].get("phase") == "Succeeded" else []
            return bool(seen["uuids"])

        cluster.wait_until(listed, 90, "the GPU pod to list its GPU")
        (uuid,) = seen["uuids"]
        assert uuid in {g["uuid"] for g in host["gpus"]}
        cluster.kubectl("delete", "pod", "cuda", "--wait=true")

        # The policies type-check against the API's own schemas (a warning would mean a check
        # that fails at every request, or never).
        policies = [p for p in cluster.get("validatingadmissionpolicies")["items"]
                    if p["metadata"]["name"].startswith("oci-gpu-hook-")]  # fmt: skip
        assert len(policies) == 3 and all(p.get("status", {}).get("typeChecking", {}).get("expressionWarnings") in
                                          (None, []) for p in policies), policies  # fmt: skip
        # The toolkit's own credentials: its Node, its labels, nothing else.
        (toolkit_pod,) = daemonset_pods(cluster, TOOLKIT)
        token = tmp_path / "toolkit-token"
        meta = toolkit_pod["metadata"]
        token.write_text(cluster.kubectl("create", "token", "oci-gpu-hook-toolkit", "-n", NS, "--bound-object-kind",
                                         "Pod", "--bound-object-name", meta["name"], "--bound-object-uid",
                                         meta["uid"]).stdout.strip())  # fmt: skip
        client = Client(f"https://127.0.0.1:{kubecheck.API_PORT}", str(token), f"{cluster.pki}/ca.crt")
        refused = {}
        for target, label in ((no_gpu, f"{gate_report.LABEL_PREFIX}toolkit"), (node, "team")):
            try:
                client.patch(f"/api/v1/nodes/{target}", {"metadata": {"labels": {label: "passed"}}})
            except ApiError as e:
                refused[target] = str(e)
        assert "the toolkit changes only the Node its own pod runs on" in refused.get(no_gpu, ""), refused
        assert "the toolkit changes only the Node's labels under oci-gpu-hook.io/" in refused.get(node, ""), refused
        ours = {f"{gate_report.LABEL_PREFIX}toolkit": "passed"}
        client.patch(f"/api/v1/nodes/{node}", {"metadata": {"labels": ours}})  # allowed
        # Nor a Node's owners (the collector would delete it), nor another condition.
        for path, body in ((f"/api/v1/nodes/{node}", {"metadata": {"ownerReferences": [
                               {"apiVersion": "v1", "kind": "Node", "name": no_gpu, "uid": "0"}]}}),
                           (f"/api/v1/nodes/{node}/status", {"status": {"conditions": [
                               {"type": "Ready", "status": "False", "reason": "Forged"}]}})):  # fmt: skip
            try:
                client.patch(path, body, strategic=True)
                refused[path] = None
            except ApiError as e:
                refused[path] = str(e)
        assert "no annotation, finalizer or owner" in (refused[f"/api/v1/nodes/{node}"] or ""), refused
        assert "only the GPUHookReady condition" in (refused[f"/api/v1/nodes/{node}/status"] or ""), refused
        # Its pods: its own node's validation pods, in their shape; its events: about its Node.
        privileged = gate_validation.pod("toolkit", node, NS, kubeletcheck.IMAGE, host["gpus"][0]["uuid"])
        privileged["spec"]["volumes"].append({"name": "root", "hostPath": {"path": "/", "type": "Directory"}})
        privileged["spec"]["containers"][0]["volumeMounts"].append({"name": "root", "mountPath": "/host"})
        elsewhere = gate_validation.pod("plugin", no_gpu, NS, kubeletcheck.IMAGE)
        unconfined = gate_validation.pod("plugin", node, NS, kubeletcheck.IMAGE)
        unconfined["spec"]["securityContext"] = {"seLinuxOptions": {"type": "spc_t"}}
        for body in (privileged, elsewhere, unconfined):
            try:
                client.post(f"/api/v1/namespaces/{NS}/pods", body)
                refused[body["metadata"]["name"]] = None
            except ApiError as e:
                refused[body["metadata"]["name"]] = str(e)
        assert "have no privilege, no capability" in (refused[f"gate-toolkit-{node}"] or ""), refused
        assert "no SELinux type but gpu_container_t" in (refused[f"gate-plugin-{node}"] or ""), refused
        assert "only its own node's validation pods" in (refused[f"gate-plugin-{no_gpu}"] or ""), refused
        # The one type it may give them, what the rollout gives them on a node with SELinux: as a
        # GPU pod there; with a level of its own (another pod's categories), refused.
        confined = gate_validation.pod("plugin", node, NS, kubeletcheck.IMAGE, selinux_type="gpu_container_t")
        client.post(f"/api/v1/namespaces/{NS}/pods?dryRun=All", confined)  # allowed
        confined["spec"]["containers"][0]["securityContext"]["seLinuxOptions"]["level"] = "s0"
        with pytest.raises(ApiError, match="no SELinux type but gpu_container_t"):
            client.post(f"/api/v1/namespaces/{NS}/pods?dryRun=All", confined)
        try:
            client.post("/apis/events.k8s.io/v1/namespaces/default/events", {
                "apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"generateName": "forged-"},
                "eventTime": "2026-11-30T00:00:00.000000Z", "reportingController": gate_report.CONTROLLER,
                "reportingInstance": node, "action": "Validate", "reason": "Forged", "type": "Normal",
                "regarding": {"apiVersion": "v1", "kind": "Node", "name": no_gpu}, "note": "forged"})  # fmt: skip
            refused["event"] = None
        except ApiError as e:
            refused["event"] = str(e)
        assert "about the Node its own pod runs on" in (refused["event"] or ""), refused

        # Removal: deleting the toolkit DaemonSet takes everything back.
        cluster.kubectl("delete", "-n", NS, "daemonset/oci-gpu-hook-toolkit", "--wait=true", "--timeout=60s")
        logged = {"text": ""}

        def ended():  # its log goes with the pod: read while it is there
            try:
                logged["text"] = cluster.log_of(toolkit_pod, "toolkit") or logged["text"]
            except FileNotFoundError:  # removed between listing and reading
                pass
            return daemonset_pods(cluster, TOOLKIT) == []

        cluster.wait_until(ended, 300, "the toolkit pod to uninstall and end")
        assert "the DaemonSet is being removed: uninstalling from the host" in logged["text"], logged["text"][-3000:]
        after = trees()
        assert after["etc"] == before["etc"], json.dumps(
            {p: (before["etc"].get(p), after["etc"].get(p)) for p in set(before["etc"]) | set(after["etc"])
             if before["etc"].get(p) != after["etc"].get(p)}, indent=1) + logged["text"][-3000:]  # fmt: skip
        assert after["usr_local"] == before["usr_local"], sorted(set(after["usr_local"]) ^ set(before["usr_local"]))
        assert not os.path.lexists(cluster.on_node("/var/lib/oci-gpu-hook"))
        assert not os.path.lexists(gates.gates_path(str(records)))
        # containerd read its configuration again; CRI-O, which forgot the hook by itself (it watches
        # hooks.d), was not restarted from the pod it was stopping (node/rollout.py).
        assert cluster.runtime_starts() == (3 if runtime == "containerd" else 2)
        labels = cluster.node()["metadata"]["labels"]
        assert not [k for k in labels if k.startswith(gate_report.LABEL_PREFIX)], labels
        assert cluster.hook_condition() == {}  # GPUHookReady taken back too
        withdrawn = [e for e in events(cluster) if e[0] == "GateToolkitFailed"]
        assert withdrawn and "the toolkit DaemonSet is being removed" in withdrawn[-1][2], events(cluster)
        cluster.wait_until(lambda: cluster.node_gpus() == "0", 60, "the GPUs withdrawn with the hook gone")


def test_a_runtime_that_cannot_take_the_hook_fails_gate_toolkit_and_advertises_nothing(simulated_host, tmp_path,
                                                                                      require):  # fmt: skip
    """The node's containerd already gives runc a base spec of the site's own, which install does
    not edit: gate toolkit fails with install's line, naming it, on the Node's condition and in a
    Warning event; no nvidia.com/gpu is advertised, containerd is not restarted, the labels pod
    is never scheduled, and the exporter's /ready answers 503 (not ready: no Service endpoint).
    Deleting the DaemonSet still takes back what was placed (the bundle)."""
    import subprocess

    import cricheck

    require("root", "openssl", "containerd", "ctr", "runc", "busybox", "gcc", "unshare", "nsenter", "pynvml")
    host = simulated_host(gpus=1)
    records, node_files = node_prepared(host, tmp_path)
    site_spec = subprocess.run(["ctr", "oci", "spec"], capture_output=True, text=True, check=True).stdout
    config = cricheck.user_config(str(tmp_path / "node" / "containerd")).replace(
        'runtime_type = "io.containerd.runc.v2"\n',
        'runtime_type = "io.containerd.runc.v2"\nbase_runtime_spec = "/etc/containerd/site-spec.json"\n')  # fmt: skip
    assert "base_runtime_spec" in config
    node_files.update({"/etc/containerd/config.toml": config, "/etc/containerd/site-spec.json": site_spec})
    with kubecheck.cluster_of_its_own(tmp_path, node_files) as cluster:
        before = {"etc": hookcheck.tree(cluster.on_node("/etc"), contents=True),
                  "usr_local": hookcheck.tree(cluster.on_node("/usr/local"))}  # fmt: skip
        cluster.ctr("images", "import", str(tmp_path / "node.tar"))
        cluster.kubectl("label", "node", cluster.node_name, f"{NFD_LABEL}=true")
        cluster.apply(*kubecheck.node_manifests(host, tmp_path, str(records), PORT, {"RESTART": "signal"},
                                                keep_node_selectors=True, keep_propagation=True))  # fmt: skip
        cluster.wait_until(lambda: cluster.hook_condition().get("status") == "False", 300, "GPUHookReady False")
        ready = cluster.hook_condition()
        assert ready["reason"] == "GateToolkitFailed", ready
        message = ready["message"]
        assert message.startswith("gate toolkit failed: install on the host failed: "), message
        assert "already has base_runtime_spec /etc/containerd/site-spec.json" in message, message
        assert "(fix: oci-gpu-hook doctor on the node; kubectl logs -n oci-gpu-hook oci-gpu-hook-toolkit-" in message
        warned = [e for e in events(cluster) if e[0] == "GateToolkitFailed"]
        assert warned and warned[0][2] == message, events(cluster)
        # Nothing advertised, nothing restarted, nothing scheduled after the gate.
        (node_pod,) = daemonset_pods(cluster, "app.kubernetes.io/name=oci-gpu-hook-node")
        cluster.wait_until(lambda: "waiting for gate toolkit to pass" in cluster.log_of(node_pod, "device-plugin"),
                           60, "the plugin waiting")  # fmt: skip
        assert cluster.node_gpus() in (None, "0")
        assert cluster.runtime_starts() == 1
        assert daemonset_pods(cluster, "app.kubernetes.io/name=oci-gpu-hook-labels") == []
        # Gate (d): the exporter runs, and its /ready keeps it out of the Service's endpoints.
        cluster.wait_until(lambda: readiness_refused(cluster, node_pod), 60, "the exporter's /ready answering 503")
        assert not exporter_ready(cluster)
        labels = cluster.node()["metadata"]["labels"]
        assert labels[f"{gate_report.LABEL_PREFIX}toolkit"] == "failed"
        assert labels[f"{gate_report.LABEL_PREFIX}plugin"] == "pending"
        cluster.kubectl("delete", "-n", NS, "daemonset/oci-gpu-hook-toolkit", "--wait=true", "--timeout=60s")
        cluster.wait_until(lambda: daemonset_pods(cluster, TOOLKIT) == [], 300, "the toolkit pod to end")
        assert hookcheck.tree(cluster.on_node("/etc"), contents=True) == before["etc"]
        assert hookcheck.tree(cluster.on_node("/usr/local")) == before["usr_local"]
        assert not os.path.lexists(cluster.on_node("/var/lib/oci-gpu-hook"))


def next_release(tmp_path) -> str:
    """The node image of a next release, localhost/oci-gpu-hook-node:0.1.1: this tree with one
    line more in the package, so that its bundle is another (its id is its files' digest)."""
    import shutil
    import subprocess
    import sys

    tree = tmp_path / "next"
    for name in ("oci_gpu_hook", "deploy", "selinux"):
        shutil.copytree(os.path.join(kubeletcheck.REPO, name), tree / name,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    shutil.copy(os.path.join(kubeletcheck.REPO, "pyproject.toml"), tree / "pyproject.toml")
    with open(tree / "oci_gpu_hook" / "__init__.py", "a") as f:
        f.write("# the next release\n")
    out = subprocess.run([sys.executable, str(tree / "deploy" / "build-image.py"), "--output",
                          str(tmp_path / "next.tar"), "--name", "localhost/oci-gpu-hook-node:0.1.1"],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TMPDIR": str(tmp_path)})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return str(tmp_path / "next.tar")


def test_an_upgrade_while_gpu_pods_start_keeps_every_start_whole(simulated_host, tmp_path, require):
    """A new image for the toolkit applied while GPU pods start one after another: the old pod stops
    without uninstalling (its DaemonSet stays), the new one installs its bundle in one rename,
    containerd is not restarted (what it reads names the link, which did not move), the bundle
    before is kept, and every pod started meanwhile got exactly one GPU."""
    import threading

    require("root", "openssl", "containerd", "ctr", "runc", "busybox", "gcc", "unshare", "nsenter", "pynvml")
    host = simulated_host(gpus=2)
    records, node_files = node_prepared(host, tmp_path)
    following = next_release(tmp_path)
    link = launcher.LAUNCHER
    with kubecheck.cluster_of_its_own(tmp_path, node_files) as cluster:
        for archive in (str(tmp_path / "node.tar"), following):
            cluster.ctr("images", "import", archive)
        cluster.kubectl("label", "node", cluster.node_name, f"{NFD_LABEL}=true")
        docs = kubecheck.node_manifests(host, tmp_path, str(records), PORT, {"RESTART": "signal"},
                                        keep_node_selectors=True, keep_propagation=True)  # fmt: skip
        cluster.apply(*docs)
        cluster.wait_until(cluster.hook_ready, 300, "GPUHookReady True")
        cluster.wait_until(lambda: cluster.node_gpus() == "2", 60, "two GPUs advertised")
        first = os.readlink(cluster.on_node(link))
        (old_pod,) = daemonset_pods(cluster, TOOLKIT)
        results, linked, upgrade_over = {}, set(), threading.Event()

        def ended(name):
            (pod,) = cluster.pods_of("app=loop,!done")
            phase = pod["status"].get("phase")
            if phase in ("Succeeded", "Failed"):
                why = pod["status"].get("reason") or pod["status"].get("message") or ""
                results[name] = (phase, listed_uuids(cluster.log_of(pod)), why)
                linked.add(os.readlink(cluster.on_node(link)))  # the hook this start could have had
            return phase in ("Succeeded", "Failed")

        def starts():
            n = 0
            try:
                while True:
                    # One start at least begins after the gates passed on the next image, so that
                    # one is under the next hook however quickly the upgrade went.
                    upgraded = upgrade_over.is_set()
                    name = f"start-{n}"
                    cluster.apply(gpu_pod(name, "loop"))
                    cluster.wait_until(lambda name=name: ended(name), 120, f"{name} to end")
                    cluster.kubectl("label", "pod", name, "done=true")
                    n += 1
                    if upgraded and n >= 3:
                        break
            except Exception as e:  # said by the test's thread, below
                results["error"] = ("error", [], repr(e)[-3000:])

        loop = threading.Thread(target=starts)
        loop.start()
        try:
            # One start at least ends under the first hook before the upgrade begins (CI's upgrade
            # flipped the link before the first pod ended, and no start was under the first hook).
            cluster.wait_until(lambda: results, 120, "a first start under the first hook")
            # The hook's upgrade: the toolkit DaemonSet names the next image. (The node pod's own
            # update restarts the device plugin, and the kubelet fails the pods it admits meanwhile,
            # UnexpectedAdmissionError: docs/deploy.md, Upgrading.)
            (toolkit,) = [d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == kubecheck.TOOLKIT]
            cluster.apply(json.loads(json.dumps(toolkit).replace("oci-gpu-hook-node:0.1.0", "oci-gpu-hook-node:0.1.1")))
            cluster.wait_until(lambda: os.readlink(cluster.on_node(link)) != first, 300, "the link to the next bundle")
            cluster.wait_until(lambda: cluster.hook_ready() and cluster.node_gpus() == "2", 300,
                               "the gates passed on the next image")  # fmt: skip
        finally:
            upgrade_over.set()
            loop.join(600)
        # Whole starts only: each got exactly one of the node's GPUs, before, during and after.
        assert "error" not in results, results["error"]
        gpus = {g["uuid"] for g in host["gpus"]}
        assert len(results) >= 3 and all(phase == "Succeeded" and len(uuids) == 1 and uuids[0] in gpus
                                         for phase, uuids, _ in results.values()), results  # fmt: skip
        assert cluster.runtime_starts() == 2  # the first install's restart only
        second = os.readlink(cluster.on_node(link))
        assert linked == {first, second}, (linked, len(results))  # starts under both hooks
        kept = sorted(os.listdir(cluster.on_node("/usr/local/libexec/oci-gpu-hook/bundles")))
        assert sorted({first.split("/")[-2], second.split("/")[-2]}) == kept, (first, second, kept)
        (new_pod,) = daemonset_pods(cluster, TOOLKIT)
        assert new_pod["metadata"]["uid"] != old_pod["metadata"]["uid"]
        assert new_pod["spec"]["containers"][0]["image"] == "localhost/oci-gpu-hook-node:0.1.1"
