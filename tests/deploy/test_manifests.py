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

from oci_gpu_hook.start import settings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Each privileged container, and why (30-daemonset.yaml): NVML opens the device nodes; the
# exporter reads /proc/<pid>/cgroup in the host's cgroup namespace; the watchdog kills; the
# toolkit writes the host's runtime configuration (25-toolkit.yaml).
PRIVILEGED = {"device-plugin", "exporter", "watchdog", "toolkit"}
SERVING = {"device-plugin", "exporter"}  # the only ones with a readiness probe


# The three DaemonSets (30-daemonset.yaml, 31-labels.yaml, 25-toolkit.yaml).
NODE, LABELS, TOOLKIT = "oci-gpu-hook-node", "oci-gpu-hook-labels", "oci-gpu-hook-toolkit"
FEATURES_D = "/etc/kubernetes/node-feature-discovery/features.d"


def documents() -> list:
    docs = []
    for path in sorted(glob.glob(os.path.join(REPO, "deploy", "kubernetes", "*.yaml"))):
        with open(path) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    return docs


def one(kind: str) -> dict:
    (doc,) = [d for d in documents() if d["kind"] == kind]
    return doc


def pod_specs() -> dict:
    """{DaemonSet name: its pod's spec}."""
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in documents() if d["kind"] == "DaemonSet"}


def pod_spec(name: str = NODE) -> dict:
    return pod_specs()[name]


def containers(init: bool = False) -> dict:
    """{name: container} of every pod (the names are unique across them), with init: the init
    containers too."""
    kinds = ("containers", "initContainers") if init else ("containers",)
    return {c["name"]: c for spec in pod_specs().values() for kind in kinds for c in spec.get(kind, [])}


def pod_of(container: str) -> str:
    """The name of the DaemonSet whose pod runs container."""
    (name,) = [n for n, s in pod_specs().items() if container in {c["name"] for c in s["containers"]
                                                                  + s.get("initContainers", [])}]  # fmt: skip
    return name


def host_mounts(container: dict, spec: dict) -> dict:
    """{mountPath: (the host path it shows, the mount)} of a container's hostPath volumes (a
    subPath's, the path below the volume's)."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    found = {}
    for mount in container["volumeMounts"]:
        host = volumes[mount["name"]].get("hostPath", {}).get("path")
        if host is not None:
            found[mount["mountPath"]] = (os.path.join(host, mount.get("subPath", "")).rstrip("/") or "/", mount)
    return found


def test_only_the_containers_that_need_it_are_privileged():
    privileged = {name for name, c in containers(init=True).items()
                  if (c.get("securityContext") or {}).get("privileged")}  # fmt: skip
    assert privileged == PRIVILEGED
    # And only their pod has the host's namespaces: labels has a pod of its own for that.
    namespaces = ("hostPID", "hostNetwork", "hostIPC")
    shared = {name: [k for k in namespaces if spec.get(k)] for name, spec in pod_specs().items()}
    assert shared == {NODE: ["hostPID", "hostNetwork"], LABELS: [], TOOLKIT: ["hostPID", "hostNetwork"]}
    assert {c["name"] for c in pod_spec(NODE)["containers"]} == PRIVILEGED - {"toolkit"}
    assert {c["name"] for c in pod_spec(TOOLKIT)["containers"]} == {"toolkit"}


def test_no_container_leaves_its_termination_log_in_a_host_directory():
    """The kubelet makes the file at terminationMessagePath (default /dev/termination-log) as a
    mount point in the container's tree; where that path is inside a hostPath volume (/dev is the
    host's), the file is made in the host's directory, and stays there after the pod is gone."""
    for name, container in containers(init=True).items():
        path = container.get("terminationMessagePath", "/dev/termination-log")
        for mount_path in host_mounts(container, pod_spec(pod_of(name))):
            inside = path == mount_path or path.startswith(mount_path.rstrip("/") + "/")
            assert not inside, f"{name}: {path} is in the host's {mount_path}"


def test_labels_runs_with_nothing_it_does_not_need():
    """Round 4, class 9: all four containers were privileged. labels reads the inventory the
    others cache and writes one file (tests/node/test_features.py runs it so)."""
    labels = containers()["labels"]
    context = labels["securityContext"]
    assert context["privileged"] is False and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["readOnlyRootFilesystem"] is True
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    writable = {m["mountPath"] for m in labels["volumeMounts"] if not m.get("readOnly")}
    assert writable == {f"{FEATURES_D}/.oci-gpu-hook", "/run/oci-gpu-hook-node"}
    volumes = {v["name"]: v for v in pod_spec(LABELS)["volumes"]}
    (beats,) = [m["name"] for m in labels["volumeMounts"] if m["mountPath"] == "/run/oci-gpu-hook-node"]
    assert "emptyDir" in volumes[beats] and "hostPath" not in volumes[beats]
    assert labels["terminationMessagePath"].startswith("/run/oci-gpu-hook-node/")


def test_labels_is_no_one_on_the_host():
    """Issue 46, item 2: labels was uid 0 in the host's user and PID namespaces, with the host's
    / mounted read-only, which is read-only only at its top (the host's /run under it was
    writable); as root it rewrote the hook's compiled settings there, signalled root's processes
    and connected to root's sockets. Now: a pod of its own with none of the host's namespaces, a
    uid and gid that are not root's, and of the host's paths only the node pod's inventory cache
    (read-only) and its own directory in features.d. Its init container is uid 0 only to make that
    directory in root's features.d: no capability, nothing else of the host's, and it gives the
    directory to the labels' group."""
    spec = pod_spec(LABELS)
    assert not any(spec.get(k) for k in ("hostPID", "hostNetwork", "hostIPC"))
    (labels,) = spec["containers"]
    (init,) = spec["initContainers"]
    context = labels["securityContext"]
    assert context["runAsUser"] != 0 and context["runAsGroup"] != 0 and context["runAsNonRoot"] is True
    # Nor the uid no process may run as, whose files the hook and the services trust as their own.
    assert settings.CACHE_UID not in (context["runAsUser"], context["runAsGroup"])
    config = yaml.safe_load(one("ConfigMap")["data"]["config.yaml"])
    features_file = config["node"]["features_file"]
    own = os.path.dirname(features_file)
    assert os.path.dirname(own) == FEATURES_D and os.path.basename(own).startswith(".")  # NFD skips it
    mounts = host_mounts(labels, spec)
    assert {path: (host, m.get("readOnly", False)) for path, (host, m) in mounts.items()} == {
        "/var/cache/oci-gpu-hook": ("/var/cache/oci-gpu-hook-node", True),
        own: (own, False),
    }  # fmt: skip
    (cache,) = [m for path, (_, m) in mounts.items() if path == "/var/cache/oci-gpu-hook"]
    assert cache["recursiveReadOnly"] == "IfPossible"  # recursive where the runtime can (containerd 2)
    assert os.path.dirname(config["inventory_cache"]) == "/var/cache/oci-gpu-hook"
    # The node pod's cache is that same host directory.
    (node_cache,) = {h for c in pod_spec(NODE)["containers"] for p, (h, _) in host_mounts(c, pod_spec(NODE)).items()
                     if p == "/var/cache/oci-gpu-hook"}  # fmt: skip
    assert node_cache == "/var/cache/oci-gpu-hook-node"
    command = labels["command"]
    assert command[command.index("labels") + 1 :][:1] == ["--cached-inventory"]  # it sees no driver to check it by
    init_context = init["securityContext"]
    assert init_context["runAsUser"] == 0 and init_context["runAsGroup"] == context["runAsGroup"]
    assert init_context["capabilities"] == {"drop": ["ALL"]} and init_context["allowPrivilegeEscalation"] is False
    assert init_context["privileged"] is False and init_context["readOnlyRootFilesystem"] is True
    # SELinux: unconfined (spc_t) to make and label its directory in NFD's kubernetes_file_t
    # features.d; the labels container stays in the runtime's default domain (container_t).
    assert init_context["seLinuxOptions"] == {"type": "spc_t"} and "seLinuxOptions" not in context
    assert init["command"][-2:] == ["--prepare-for", str(context["runAsGroup"])]
    assert {path: host for path, (host, _) in host_mounts(init, spec).items()} == {FEATURES_D: FEATURES_D}


def test_the_node_pods_init_container_only_labels_the_cache_for_the_labels_pod():
    """Under RHEL's policy the cache directory the kubelet makes is var_t, which the labels
    container may not read: the node pod's init container labels it (`inventory share`), before
    its services write there, with what it takes and nothing more: spc_t to relabel, uid 0 with
    CAP_FOWNER alone (the cache file is not root's), and of the host's paths only that directory,
    the same one the labels pod reads."""
    spec = pod_spec(NODE)
    (init,) = spec["initContainers"]
    assert init["command"][-2:] == ["inventory", "share"]
    context = init["securityContext"]
    assert context["privileged"] is False and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["FOWNER"]}
    assert context["runAsUser"] == 0 and context["readOnlyRootFilesystem"] is True
    assert context["seLinuxOptions"] == {"type": "spc_t"} and context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {path: host for path, (host, _) in host_mounts(init, spec).items()} == {
        "/var/cache/oci-gpu-hook": "/var/cache/oci-gpu-hook-node"
    }  # fmt: skip
    labels_reads = {h for p, (h, _) in host_mounts(containers()["labels"], pod_spec(LABELS)).items()
                    if p == "/var/cache/oci-gpu-hook"}  # fmt: skip
    assert labels_reads == {"/var/cache/oci-gpu-hook-node"}
    config = yaml.safe_load(one("ConfigMap")["data"]["config.yaml"])
    assert os.path.dirname(config["inventory_cache"]) == "/var/cache/oci-gpu-hook"  # the directory it labels


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
            if other != name and pod_of(other) == pod_of(name):
                shared = writable & {m["name"] for m in o["volumeMounts"]}
                assert not shared, f"{name} may write {sorted(shared)}, which {other} mounts too"
        # Across pods, by the host's paths: what it may write, no other container sees. (Its init
        # container has finished before it starts, and opens nothing in its directory.)
        mine = [host for host, m in host_mounts(c, pod_spec(pod_of(name))).values() if not m.get("readOnly")]
        for other, o in containers().items():
            if other != name:
                for host, _ in host_mounts(o, pod_spec(pod_of(other))).values():
                    for path in mine:
                        assert not (host + "/").startswith(path + "/") and not (path + "/").startswith(host + "/"), (
                            f"{name} may write the host's {path}, which {other} mounts ({host})")  # fmt: skip


def test_host_paths_must_exist_but_the_records_directory():
    """features.d was DirectoryOrCreate: the kubelet made the directory that labels itself will
    not make (NFD makes it). Only /run/oci-gpu-hook may be made (the hook's records; the hook
    checks the mode of what it writes into)."""
    types = {v["hostPath"]["path"]: v["hostPath"]["type"] for spec in pod_specs().values() for v in spec["volumes"]
             if "hostPath" in v}  # fmt: skip
    assert types[FEATURES_D] == "Directory"
    # And the MPS root, in /run (emptied at boot): the plugin checks that what it makes there is
    # root's alone (mps.make_directories). The inventory cache, in root's /var/cache: the node
    # pod writes it; the labels pod reads only what its services can have written (read_trusted).
    assert {path for path, kind in types.items() if kind != "Directory"} == {
        "/run/oci-gpu-hook", "/run/nvidia/mps", "/var/cache/oci-gpu-hook-node"}  # fmt: skip


def test_every_container_has_requests_a_memory_limit_and_a_liveness_probe():
    for name, c in containers(init=True).items():
        resources = c["resources"]
        assert set(resources["requests"]) == {"cpu", "memory"}, name
        assert set(resources["limits"]) == {"memory"}, name  # no CPU limit: throttling delays kills and scrapes
        if name in containers():  # an init container runs to its end: no probe
            assert "livenessProbe" in c, name
            assert ("readinessProbe" in c) == (name in SERVING), name


def test_the_exporters_probes_use_its_port_its_index_and_the_gates():
    """Liveness asks its index; readiness asks /ready, which waits on the gates' file the device
    plugin reads (gate (d)). Neither reads NVML."""
    exporter, plugin = containers()["exporter"], containers()["device-plugin"]
    (port,) = exporter["ports"]
    assert exporter["livenessProbe"]["httpGet"] == {"path": "/", "port": port["name"]}
    assert exporter["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port["name"]}
    gate = exporter["command"][exporter["command"].index("--gate") + 1]
    assert gate == plugin["command"][plugin["command"].index("--gate") + 1]
    assert any(gate.startswith(m["mountPath"] + "/") for m in exporter["volumeMounts"])


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
    not with none, nor with a socket file that nothing listens on (a plugin that lost it). Alive
    with none too while gate toolkit has not passed (not restarted while it waits)."""
    from oci_gpu_hook.node import gates
    from oci_gpu_hook.node.plugin.server import SOCKET_PREFIX

    plugin = containers()["device-plugin"]
    directory = "/var/lib/kubelet/device-plugins"
    assert any(m["mountPath"] == directory for m in plugin["volumeMounts"])
    gates_file = plugin["command"][plugin["command"].index("--gate") + 1]
    moved = {directory: str(tmp_path), gates_file: str(tmp_path / "gates.json")}
    for probe in ("readinessProbe", "livenessProbe"):
        command = plugin[probe]["exec"]["command"]
        assert f"{directory}/{SOCKET_PREFIX}*.sock" in command[-1]
        if probe == "livenessProbe":
            # Alive with none while gate toolkit has not passed: the plugin serves nothing until then.
            assert _run(command, moved) == 0
            gates.write(str(tmp_path / "gates.json"), {"toolkit": gates.verdict("failed", "no GPU seen")})
            assert _run(command, moved) == 0
            gates.write(str(tmp_path / "gates.json"), {"toolkit": gates.verdict("passed")})
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
            if path.name != "gates.json":
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
    from oci_gpu_hook.node.plugin import config as plugin_config
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
    from oci_gpu_hook.node.plugin import config as plugin_config
    from oci_gpu_hook.node.plugin import mps

    doc = yaml.safe_load(one("ConfigMap")["data"]["device-plugin.yaml"])
    doc["sharing"] = {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}
    config = plugin_config.parse(doc, "device-plugin.yaml")
    root = config.mps_root
    assert root == plugin_config.DEFAULT_MPS_ROOT  # the ConfigMap keeps NVIDIA's default
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    plugin = containers()["device-plugin"]
    made = [where(root, "nvidia.com/gpu") for where in (mps.pipe_dir, mps.log_dir, mps.shm_dir)]
    for path in made:
        mounts = [m for m in plugin["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert len(mounts) == 1, f"{path}: in no volume of the device plugin's: its container's own"
        (mount,) = mounts
        host = volumes[mount["name"]].get("hostPath", {}).get("path")
        assert host == mount["mountPath"], f"{path}: {mount['mountPath']} is not the host's {mount['mountPath']}"
        assert not mount.get("readOnly"), mount
    (mount,) = [m for m in plugin["volumeMounts"] if m["mountPath"] == root]
    assert mount.get("mountPropagation") == "Bidirectional", mount  # the daemons' tmpfs, mounted under it
    others = {n for n, c in containers().items() if n != "device-plugin" for m in c["volumeMounts"]
              if m["name"] == mount["name"]}  # fmt: skip
    assert not others, others


def test_the_device_plugin_follows_the_gates_the_toolkit_writes():
    """The plugin's --gate is the file the rollout writes its verdicts into: gates.json beside the
    records directory of the pods' configuration, a host path both pods mount at the same place."""
    from oci_gpu_hook.node import gates

    plugin, toolkit = containers()["device-plugin"], containers()["toolkit"]
    config = yaml.safe_load(one("ConfigMap")["data"]["config.yaml"])
    written = gates.gates_path(config["records_directory"])
    assert plugin["command"][plugin["command"].index("--gate") + 1] == written
    directory = os.path.dirname(written)
    assert host_mounts(plugin, pod_spec(NODE))[directory][0] == host_mounts(toolkit, pod_spec(TOOLKIT))[directory][0]
    assert toolkit["command"][toolkit["command"].index("toolkit") :][:2] == ["toolkit", "rollout"]


def test_the_labels_follow_gate_plugin():
    """Gate (d): the labels pod is scheduled only on nodes whose gate plugin passed."""
    from oci_gpu_hook.node import gate_report

    assert pod_spec(LABELS)["nodeSelector"][gate_report.LABEL_PREFIX + "plugin"] == "passed"


def test_only_the_toolkit_holds_a_token():
    """The toolkit's service account token is in its container only, projected; no pod mounts
    one by default, and the node services' account has no rights (10-serviceaccount.yaml)."""
    for name, spec in pod_specs().items():
        assert spec["automountServiceAccountToken"] is False, name
        projected = {v["name"] for v in spec["volumes"] if any("serviceAccountToken" in source for source in
                                                               v.get("projected", {}).get("sources", []))}  # fmt: skip
        holders = {c["name"] for c in spec["containers"] + spec.get("initContainers", [])
                   if projected & {m["name"] for m in c["volumeMounts"]}}  # fmt: skip
        assert holders == ({"toolkit"} if name == TOOLKIT else set()), name
    assert pod_spec(TOOLKIT)["serviceAccountName"] == "oci-gpu-hook-toolkit"
    bound = {d["subjects"][0]["name"] for d in documents() if d["kind"] in ("RoleBinding", "ClusterRoleBinding")}
    assert bound == {"oci-gpu-hook-toolkit"}


def test_the_toolkits_probe_reads_the_verdicts_it_writes(tmp_path):
    """Alive while a round wrote the gates' file recently; not with none, nor with a stale one."""
    toolkit = containers()["toolkit"]
    command = toolkit["livenessProbe"]["exec"]["command"]
    written = "/run/oci-gpu-hook/gates.json"
    assert written in command[-1]
    (age,) = [int(n) for n in re.findall(r"> (\d+)\)", command[-1])]
    moved = str(tmp_path / "gates.json")
    assert _run(command, {written: moved}) != 0
    open(moved, "w").close()
    assert _run(command, {written: moved}) == 0
    os.utime(moved, (time.time() - age - 60, time.time() - age - 60))
    assert _run(command, {written: moved}) != 0
