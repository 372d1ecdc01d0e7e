"""The OpenShift node's path, first part (issue 27): a real CRI-O, driven by crictl, runs the
hook from the hooks.d file `install` writes, through runc. Each GPU container gets exactly its
GPUs; none, void or no variable get nothing; the pod's infra container gets nothing; two GPU
containers in one pod each get theirs; a failing hook reaches the client as its one line and
leaves nothing; the records carry the pod's names from CRI-O's annotations; and CRI-O, its pods
and the hook leave no process, mount or cgroup of theirs (criocheck.CrioDaemon.stop)."""

from __future__ import annotations

import os
import re
import tempfile

import criocheck
import hookcheck
import pytest
from hookcheck import listed_uuids

from oci_gpu_hook.start import container_record
from oci_gpu_hook.toolkit import containers

pytestmark = pytest.mark.host(gpus=2, mig=[], needs=("runc", "busybox", "podman", "conmon"))


@pytest.fixture(scope="module")
def node(host):
    """CRI-O with the hooks.d file install writes (pointed at the simulated host's configuration)."""
    criocheck.programs()
    base = tempfile.mkdtemp(prefix="oci-gpu-hook-crio-", dir="/var/tmp")
    hooks = containers.write_hooks_dir(os.path.join(base, "hooks.d"), f"{host['root']}/config.yaml")
    crio = criocheck.CrioDaemon(base, hooks)
    yield crio
    crio.stop()  # raises for a process, a mount (a busy one named with its holder) or a cgroup left


def mounts_of(node) -> list:
    """The mounts under CRI-O's private base: its storage's, and its pods' while they run."""
    return node.footprint.mounts()


@pytest.mark.parametrize(
    "env, expected",
    [({"NVIDIA_VISIBLE_DEVICES": "0"}, [0]), ({"NVIDIA_VISIBLE_DEVICES": "all"}, [0, 1]),
     ({"NVIDIA_VISIBLE_DEVICES": "none"}, []), ({"NVIDIA_VISIBLE_DEVICES": "void"}, []), ({}, [])],
    ids=["0", "all", "none", "void", "no-variable"],
)  # fmt: skip
def test_each_container_gets_exactly_its_gpus(node, host, env, expected):
    out = node.run_pod({"c": (env, ["sh", "-c", "ls /dev; nvidia-smi -L 2>&1; true"])})
    text, _ = out["c"]
    nodes = {n for n in text.split() if re.fullmatch(r"nvidia\d+", n)}
    assert nodes == {f"nvidia{host['gpus'][i]['minor']}" for i in expected}, text
    if expected:
        assert listed_uuids(text) == [host["gpus"][i]["uuid"] for i in expected], text
    node.remove_pods()


def test_two_gpu_containers_in_one_pod_and_the_infra_container(node, host):
    out = node.run_pod({"first": ({"NVIDIA_VISIBLE_DEVICES": "0"}, ["nvidia-smi", "-L"]),
                        "second": ({"NVIDIA_VISIBLE_DEVICES": "1"}, ["nvidia-smi", "-L"])},
                       pod_name="two-gpus", namespace="ml")  # fmt: skip
    assert listed_uuids(out["first"][0]) == [host["gpus"][0]["uuid"]]
    assert listed_uuids(out["second"][0]) == [host["gpus"][1]["uuid"]]
    # The pause container: CRI-O applies hooks.d files to app containers only.
    pid = node.crictl("inspectp", "-o", "go-template", "--template", "{{.info.pid}}", node.pod_id).stdout.strip()
    with open(f"/proc/{pid}/mountinfo") as f:
        assert "nvidia" not in f.read()
    # CRI-O passes the pod's names in its own annotations: the records carry them.
    records = container_record.read_all(f"{host['root']}/containers").values()
    names = {r["id"]: r["kubernetes"] for r in records if r}
    assert names[out["first"][1]] == {"pod": "two-gpus", "namespace": "ml", "container": "first"}
    assert names[out["second"][1]] == {"pod": "two-gpus", "namespace": "ml", "container": "second"}
    node.remove_pods()


def test_a_failing_hook_reaches_the_client_as_its_line(node, host):
    """CRI-O runs the hook at createRuntime: its one line comes back to the client, and nothing
    is left (no mount, no container)."""
    before = mounts_of(node)
    out = node.run_pod({"bad": ({"NVIDIA_VISIBLE_DEVICES": "7"}, ["true"])})
    error, _ = out["bad"]
    assert "oci-gpu-hook: NVIDIA_VISIBLE_DEVICES=7: no GPU 7 (this host has GPUs 0-1)" in error, error
    node.remove_pods()
    assert mounts_of(node) == before


def test_a_container_restarted_in_its_pod_gets_its_gpu_again(node, host):
    """The kubelet restarts a container as a new one of the same name (attempt + 1) in the same
    pod: the hook runs for it again, and each attempt has its own record."""
    node.start_pod("restarts", "ml")
    gpu0 = host["gpus"][0]["uuid"]
    ids = []
    for attempt in (0, 1):
        cid, error = node.start_container("cuda", {"NVIDIA_VISIBLE_DEVICES": "0"}, ["nvidia-smi", "-L"], attempt)
        assert error is None, error
        assert listed_uuids(node.wait_log("cuda", cid, attempt)) == [gpu0]
        ids.append(cid)
    records = {r["id"]: r for r in container_record.read_all(f"{host['root']}/containers").values() if r}
    assert all(records[i]["kubernetes"]["pod"] == "restarts" for i in ids)
    node.remove_pods()


def test_a_container_removed_while_running_leaves_nothing(node, host):
    before = mounts_of(node)
    node.start_pod("removed", "ml")
    cid, error = node.start_container("long", {"NVIDIA_VISIBLE_DEVICES": "all"}, ["sleep", "1000"])
    assert error is None, error
    assert node.state(cid) == "CONTAINER_RUNNING"
    removed = node.crictl("rm", "-f", cid)
    assert removed.returncode == 0, removed.stderr
    node.remove_pods()
    assert mounts_of(node) == before
    assert node.crictl("ps", "-a", "-q").stdout.split() == []


def test_an_unmet_requirement_is_refused_with_its_line(node):
    out = node.run_pod({"old": ({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=99.0"}, ["true"])})
    error, _ = out["old"]
    assert "oci-gpu-hook: " in error and "cuda>=99.0" in error, error
    node.remove_pods()


def test_the_exporter_names_the_pod_from_crio(node, host, tmp_path, require):
    """The exporter's attribution through CRI-O: the GPU process of a CRI-O container is shown
    with the pod, namespace and container names CRI-O passed in its annotations."""
    require("pynvml", "prometheus_client")
    from servicecheck import Exporter

    from oci_gpu_hook.toolkit.simulate import control

    node.start_pod("metrics", "ml")
    cid, error = node.start_container("cuda", {"NVIDIA_VISIBLE_DEVICES": "0"}, ["sleep", "1000"])
    assert error is None, error
    pid = int(node.crictl("inspect", "-o", "go-template", "--template", "{{.info.pid}}", cid).stdout.strip())
    gpu0 = host["gpus"][0]["uuid"]
    control.write(host["root"], processes=[(gpu0, pid, 700 << 20)])
    exporter = Exporter(f"{host['root']}/config.yaml", tmp_path)
    try:
        samples = exporter.scrape()
    finally:
        exporter.stop()
        control.clear(host["root"])
        node.remove_pods()
    used = [(ls.get("pod"), ls.get("namespace"), ls.get("container"), v) for n, ls, v in samples
            if n == "oci_gpu_hook_container_gpu_memory_used_bytes"]  # fmt: skip
    assert used == [("metrics", "ml", "cuda", 700 << 20)], used


def test_crio_reads_what_install_writes_and_uninstall_puts_it_back(host, tmp_path):
    """`install --runtime crio` under a root of the test's own, then CRI-O with that root's
    drop-in directory and its /etc/containers (seen over the host's, in CRI-O's own mount
    namespace) and no --hooks-dir: the drop-in alone makes CRI-O read the directory where the
    hooks.d file is, and GPU containers get their GPU. After uninstall CRI-O's configuration is
    what it was, and the same CRI-O runs no hook."""
    from oci_gpu_hook.toolkit import install

    root = str(tmp_path / "root")
    os.makedirs(root)
    before = criocheck.config(root)
    prefix = containers.hook_command(f"{host['root']}/config.yaml")
    assert install.install(root, ("crio",), prefix)
    assert criocheck.hooks_dirs(root)[-1] == install.HOOKS_D_DIR
    mounts, etc_before = etc_containers_mounts(), list(os.walk("/etc/containers"))

    def run(name):
        base = tempfile.mkdtemp(prefix="oci-gpu-hook-crio-", dir="/var/tmp")
        etc = os.path.join(root, "etc/containers")
        crio = criocheck.CrioDaemon(base, config_dir=root + install.CRIO_DROPIN.rsplit("/", 1)[0],
                              etc_containers=etc if os.path.isdir(etc) else None)  # fmt: skip
        try:
            return crio.run_pod({name: ({"NVIDIA_VISIBLE_DEVICES": "0"}, ["sh", "-c", "ls /dev; nvidia-smi -L"])})
        finally:
            crio.stop()

    (text, _) = run("installed")["installed"]
    assert listed_uuids(text) == [host["gpus"][0]["uuid"]], text
    assert install.uninstall(root)
    assert criocheck.config(root) == before
    (text, _) = run("uninstalled")["uninstalled"]
    assert "nvidia0" not in text.split() and "nvidia-smi: not found" in text, text
    # The overlay lived in CRI-O's namespace only: the host's /etc/containers, and what is mounted
    # there, are as they were.
    assert etc_containers_mounts() == mounts and list(os.walk("/etc/containers")) == etc_before


def etc_containers_mounts() -> list:
    return [m for m in hookcheck.mountinfo() if m[0] == "/etc/containers" or m[0].startswith("/etc/containers/")]
