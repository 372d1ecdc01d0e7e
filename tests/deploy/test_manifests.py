"""The manifests in deploy/kubernetes/, read as kubectl reads them, without a cluster: what the
DaemonSet grants each container, its probes (run here, against real files and sockets), its
requests, its hostPath types, and the device plugin's answers that the host's hook must accept
(round 4, class 9). tests/e2e/test_deploy.py runs the same manifests on a real cluster."""

import glob
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Each privileged container, and why (30-daemonset.yaml): NVML opens the device nodes; the
# exporter reads /proc/<pid>/cgroup in the host's cgroup namespace; the watchdog kills.
PRIVILEGED = {"device-plugin", "exporter", "watchdog"}
SERVING = {"device-plugin", "exporter"}  # the only ones with a readiness probe


def documents() -> list:
    docs = []
    for path in sorted(glob.glob(os.path.join(REPO, "deploy", "kubernetes", "*.yaml"))):
        with open(path) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    return docs


def one(kind: str) -> dict:
    (doc,) = [d for d in documents() if d["kind"] == kind]
    return doc


def pod_spec() -> dict:
    return one("DaemonSet")["spec"]["template"]["spec"]


def containers() -> dict:
    return {c["name"]: c for c in pod_spec()["containers"]}


def test_only_the_containers_that_need_it_are_privileged():
    privileged = {name for name, c in containers().items() if (c.get("securityContext") or {}).get("privileged")}
    assert privileged == PRIVILEGED


def test_no_container_leaves_its_termination_log_in_a_host_directory():
    """The kubelet makes the file at terminationMessagePath (default /dev/termination-log) as a
    mount point in the container's tree; where that path is inside a hostPath volume (/dev is the
    host's), the file is made in the host's directory, and stays there after the pod is gone."""
    host_paths = {v["name"] for v in pod_spec()["volumes"] if "hostPath" in v}
    for name, container in containers().items():
        path = container.get("terminationMessagePath", "/dev/termination-log")
        for mount in container["volumeMounts"]:
            if mount["name"] in host_paths:
                inside = path == mount["mountPath"] or path.startswith(mount["mountPath"].rstrip("/") + "/")
                assert not inside, f"{name}: {path} is in the host's {mount['mountPath']}"


def test_labels_runs_with_nothing_it_does_not_need():
    """Round 4, class 9: all four containers were privileged. labels reads the inventory the
    others cache and writes one file into features.d (tests/node/test_features.py runs it so)."""
    labels = containers()["labels"]
    context = labels["securityContext"]
    assert context["privileged"] is False and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["readOnlyRootFilesystem"] is True
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    writable = {m["mountPath"] for m in labels["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"/etc/kubernetes/node-feature-discovery/features.d", "/run/oci-gpu-hook-node"}
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    mounted = {m["name"] for m in labels["volumeMounts"]}
    assert "run" not in mounted and "device-plugins" not in mounted  # the records, the kubelet's sockets
    (beats,) = [m["name"] for m in labels["volumeMounts"] if m["mountPath"] == "/run/oci-gpu-hook-node"]
    assert "emptyDir" in volumes[beats] and "hostPath" not in volumes[beats]
    # The kubelet's default /dev/termination-log cannot be made in a read-only /dev.
    assert labels["terminationMessagePath"].startswith("/run/oci-gpu-hook-node/")


def test_what_an_unprivileged_container_may_write_is_its_own():
    """Round 4, class 9, again: labels was made unprivileged so that whoever took it over could
    change nothing of the privileged containers'. But its heartbeat volume, which it writes, was
    the watchdog's too: it could keep the watchdog's heartbeat fresh while the watchdog hung, or
    make it a directory so that the kubelet restarted the watchdog forever, and plant a link where
    the runtime makes the watchdog's termination log (in that volume) at its next start. A volume
    an unprivileged container may write is mounted by no other container, read-only or not."""
    privileged = {name for name, c in containers().items() if (c.get("securityContext") or {}).get("privileged")}
    for name, c in containers().items():
        if name in privileged:
            continue
        writable = {m["name"] for m in c["volumeMounts"] if not m.get("readOnly")}
        for other, o in containers().items():
            if other != name:
                shared = writable & {m["name"] for m in o["volumeMounts"]}
                assert not shared, f"{name} may write {sorted(shared)}, which {other} mounts too"


def test_host_paths_must_exist_but_the_records_directory():
    """features.d was DirectoryOrCreate: the kubelet made the directory that labels itself will
    not make (NFD makes it). Only /run/oci-gpu-hook may be made (the hook's records; the hook
    checks the mode of what it writes into)."""
    types = {v["hostPath"]["path"]: v["hostPath"]["type"] for v in pod_spec()["volumes"] if "hostPath" in v}
    assert types["/etc/kubernetes/node-feature-discovery/features.d"] == "Directory"
    # And the MPS root, in /run (emptied at boot): the plugin checks that what it makes there is
    # root's alone (mps.make_directories).
    assert {path for path, kind in types.items() if kind != "Directory"} == {"/run/oci-gpu-hook", "/run/nvidia/mps"}


def test_every_container_has_requests_a_memory_limit_and_a_liveness_probe():
    for name, c in containers().items():
        resources = c["resources"]
        assert set(resources["requests"]) == {"cpu", "memory"}, name
        assert set(resources["limits"]) == {"memory"}, name  # no CPU limit: throttling delays kills and scrapes
        assert "livenessProbe" in c, name
        assert ("readinessProbe" in c) == (name in SERVING), name


def test_the_exporters_probes_use_its_port_and_its_index():
    exporter = containers()["exporter"]
    (port,) = exporter["ports"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert exporter[probe]["httpGet"] == {"path": "/", "port": port["name"]}  # / reads no NVML


def _run(command: list, replace: dict) -> int:
    """A probe's exec command, here: the image's python3 is this one; paths moved into the test's."""
    args = [sys.executable if a == "/usr/bin/python3" else a for a in command]
    for old, new in replace.items():
        args = [a.replace(old, new) for a in args]
    return subprocess.run(args, capture_output=True, timeout=60).returncode


@pytest.mark.parametrize("name", ["labels", "watchdog"])
def test_the_heartbeat_probes_read_the_file_the_service_beats(name, tmp_path):
    """The probe reads the file the command's --heartbeat names, and fails when it is stale or
    missing. Rounds: labels --watch 60, the watchdog every second."""
    c = containers()[name]
    heartbeat = c["command"][c["command"].index("--heartbeat") + 1]
    command = c["livenessProbe"]["exec"]["command"]
    assert [a for a in command if heartbeat in a], command
    assert any(m["mountPath"] == os.path.dirname(heartbeat) for m in c["volumeMounts"])
    (age,) = [int(n) for n in re.findall(r"> (\d+)\)", command[-1])]
    moved = str(tmp_path / "beat")
    assert _run(command, {heartbeat: moved}) != 0  # no beat yet
    open(moved, "w").close()
    assert _run(command, {heartbeat: moved}) == 0
    os.utime(moved, (time.time() - age - 60, time.time() - age - 60))
    assert _run(command, {heartbeat: moved}) != 0


def test_the_device_plugin_probes_connect_to_its_sockets(tmp_path):
    """Ready and alive while every socket of ours in the kubelet's directory accepts a connection;
    not with none, nor with a socket file that nothing listens on (a plugin that lost it)."""
    from oci_gpu_hook.node.device_plugin import SOCKET_PREFIX

    plugin = containers()["device-plugin"]
    directory = "/var/lib/kubelet/device-plugins"
    assert any(m["mountPath"] == directory for m in plugin["volumeMounts"])
    moved = {directory: str(tmp_path)}
    for probe in ("readinessProbe", "livenessProbe"):
        command = plugin[probe]["exec"]["command"]
        assert f"{directory}/{SOCKET_PREFIX}*.sock" in command[-1]
        assert _run(command, moved) != 0  # none
        with socket.socket(socket.AF_UNIX) as served:
            served.bind(str(tmp_path / f"{SOCKET_PREFIX}nvidia.com_gpu.sock"))
            served.listen()
            with socket.socket(socket.AF_UNIX) as other:  # another plugin's is not looked at
                other.bind(str(tmp_path / "other.sock"))
                assert _run(command, moved) == 0
                with socket.socket(socket.AF_UNIX) as dead:
                    dead.bind(str(tmp_path / f"{SOCKET_PREFIX}nvidia.com_gpu.shared.sock"))  # never listens
                    assert _run(command, moved) != 0
        for path in tmp_path.iterdir():
            path.unlink()


def test_the_exporter_listens_on_every_address():
    config = yaml.safe_load(one("ConfigMap")["data"]["config.yaml"])
    host, _, port = config["node"]["exporter_listen"].rpartition(":")
    assert (host, port) == ("", "9400")  # IPv6 and IPv4 (tests/node/test_exporter.py)


def test_the_device_plugin_answers_what_pods_cannot_forge(tmp_path):
    """Round 4, class 9: the shipped configuration answered with envvar, which a pod can set
    itself (docs/kubernetes.md advises against it for untrusted pods). Read by the plugin's own
    loader: volume-mounts alone, which the hook reads with accept_volume_mounts (the e2e test's
    hook has it, with accept_envvar_when_unprivileged off, and its GPU pod gets its GPU)."""
    from oci_gpu_hook.node import plugin_config
    from oci_gpu_hook.start import settings

    data = one("ConfigMap")["data"]
    (tmp_path / "config.yaml").write_text(data["config.yaml"])
    node = settings.load(str(tmp_path / "config.yaml")).node  # the pod's configuration is valid too
    (tmp_path / "device-plugin.yaml").write_text(data["device-plugin.yaml"])
    config = plugin_config.load(str(tmp_path / "device-plugin.yaml"), node)
    assert config.list_strategies == ("volume-mounts",)


def test_only_a_privileged_container_has_a_bidirectional_mount():
    """The kubelet refuses the pod otherwise; and such a mount changes the host's mounts."""
    for name, c in containers().items():
        for mount in c["volumeMounts"]:
            if mount.get("mountPropagation") == "Bidirectional":
                assert name in PRIVILEGED and c["securityContext"]["privileged"] is True, (name, mount)


def test_the_mps_directories_the_plugin_answers_with_are_the_hosts():
    """flags.mpsRoot was not mounted: with sharing.mps, the plugin made the MPS daemon's pipe and
    log directories and its shm tmpfs in its own container's /run, while its Allocate answers
    mount those paths of the host into the client pods, where there was nothing (CUDA found no
    daemon). Every host path of an answer, for the ConfigMap's configuration with MPS on, must be
    that same path of the host in the plugin's container; the shm the plugin mounts there must
    reach the host (Bidirectional); no other container mounts it."""
    from oci_gpu_hook.node import mps, plugin_config

    doc = yaml.safe_load(one("ConfigMap")["data"]["device-plugin.yaml"])
    doc["sharing"] = {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}
    config = plugin_config.parse(doc, "device-plugin.yaml")
    root = config.mps_root
    assert root == plugin_config.DEFAULT_MPS_ROOT  # the ConfigMap keeps NVIDIA's default
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    plugin = containers()["device-plugin"]
    made = [mps.pipe_dir(root, "nvidia.com/gpu"), mps.log_dir(root, "nvidia.com/gpu"), mps.shm_dir(root)]
    for path in made:
        mounts = [m for m in plugin["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert len(mounts) == 1, f"{path}: in no volume of the device plugin's: its container's own"
        (mount,) = mounts
        host = volumes[mount["name"]].get("hostPath", {}).get("path")
        assert host == mount["mountPath"], f"{path}: {mount['mountPath']} is not the host's {mount['mountPath']}"
        assert not mount.get("readOnly"), mount
    (mount,) = [m for m in plugin["volumeMounts"] if m["mountPath"] == root]
    assert mount.get("mountPropagation") == "Bidirectional", mount  # the shm tmpfs, mounted under it
    others = {n for n, c in containers().items() if n != "device-plugin" for m in c["volumeMounts"]
              if m["name"] == mount["name"]}  # fmt: skip
    assert not others, others
