"""The OpenShift node's path with GPUs (issue 27): the kubelet on a real CRI-O (tests/criocheck.py),
CRI-O running the hook from the hooks.d file install writes, and the project's `device-plugin`,
on a simulated host with 3 GPUs. Pods ask for `nvidia.com/gpu`:
- each pod sees exactly its GPUs, no two pods share one, one GPU too many is refused, and a freed
  GPU goes to the next pod;
- with time-slicing, pods share a GPU, as its configuration says;
- each Allocate answer (envvar, volume-mounts, cdi-annotations, cdi-cri) reaches the container
  through CRI-O. For the CDI ones CRI-O applies the spec `cdi generate` wrote, and the hook, which
  CRI-O runs too, gives nothing (NVIDIA_VISIBLE_DEVICES=void): one of them configures the
  container, never both. The hook still records it, marked as applied by the runtime;
- so a time-sliced CDI pod's memory limit is enforced: the real watchdog kills the replica over
  its share, and the real exporter names its pod (issue 39, item 7).
"""

import os
import re
import subprocess

import criocheck
import kubeletcheck
import pytest
from hookcheck import config_with, listed_uuids

from oci_gpu_hook.start import container_record
from oci_gpu_hook.toolkit.containers import hook_command

SHOW = "nvidia-smi -L; ls /dev; cat /proc/self/mountinfo; sleep 3600"
# The volume-mounts answer is read only with this; the other answers do not need it.
SETTINGS = "accept_volume_mounts: true\n"


@pytest.fixture(scope="module")
def node(simulated_host, require, tmp_path_factory):
    """(node, host, hook config, records directory, tmp dir); the host is checked afterwards."""
    require("root", "runc", "busybox", "gcc", "podman", "conmon")
    kubeletcheck.kubelet_binary()
    criocheck.programs()
    host = simulated_host(gpus=3)
    tmp = tmp_path_factory.mktemp("k8s-crio")
    records = tmp / "records"
    hook_config = config_with(host, tmp, f"records_directory: {records}\n{SETTINGS}")
    with kubeletcheck.running(criocheck.CrioKubelet(tmp / "node", hook_config)) as node:
        yield node, host, hook_config, str(records), tmp


def nodes(text: str) -> set:
    return set(re.findall(r"^nvidia(\d+)$", text, re.M))


def plugin_config(strategy: str, replicas: int = 1) -> dict:
    doc = {"flags": {"plugin": {"deviceListStrategy": strategy}}}
    if replicas > 1:
        doc["sharing"] = {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": replicas}]}}
    return doc


def seen(node, name: str) -> list:
    node.wait_for_phase(name, "Running")
    return listed_uuids(node.wait_for_log(name, "UUID"))


def record_of(records: str, container_id: str):
    return next((r for r in container_record.read_all(records).values() if r and r["id"] == container_id), None)


def test_exact_gpus_no_sharing_refusal_and_reuse(node):
    node, host, hook_config, records, tmp = node
    plugin = kubeletcheck.DevicePlugin(hook_config, node, tmp, plugin_config("envvar"), "plugin-exclusive")
    try:
        node.wait_for_resource("nvidia.com/gpu", 3)
        node.add_pod("one", SHOW, limits={"nvidia.com/gpu": 1})
        node.add_pod("two", SHOW, limits={"nvidia.com/gpu": 2})
        got = {name: seen(node, name) for name in ("one", "two")}
        assert (len(got["one"]), len(got["two"])) == (1, 2), got
        assert set(got["one"]) | set(got["two"]) == {g["uuid"] for g in host["gpus"]}  # none shared
        for name in got:  # only its GPUs' nodes, and the record from CRI-O's annotations
            minors = {str(g["minor"]) for g in host["gpus"] if g["uuid"] in got[name]}
            assert nodes(node.logs(name)) == minors
            record = record_of(records, node.container_id(name))
            assert record["kubernetes"] == {"pod": node.full_name(name), "namespace": "default",
                                            "container": kubeletcheck.CONTAINER}  # fmt: skip

        node.add_pod("three", SHOW, limits={"nvidia.com/gpu": 1})
        refused = node.wait_for_phase("three", "Failed")["status"]
        assert "nvidia.com/gpu" in refused.get("reason", "") + refused.get("message", ""), refused
        node.remove_pod("three")

        node.remove_pod("one")
        node.add_pod("four", SHOW, limits={"nvidia.com/gpu": 1})
        assert seen(node, "four") == got["one"]  # the freed GPU, the only free one
        node.remove_pod("two")
        node.remove_pod("four")
    finally:
        assert plugin.stop() == 0, plugin.output()


def test_time_sliced_pods_share_a_gpu(node):
    node, host, hook_config, _, tmp = node
    plugin = kubeletcheck.DevicePlugin(hook_config, node, tmp, plugin_config("envvar", replicas=2), "plugin-shared")
    names = [f"sliced-{i}" for i in range(4)]
    try:
        node.wait_for_resource("nvidia.com/gpu", 6)
        for name in names:
            node.add_pod(name, SHOW, limits={"nvidia.com/gpu": 1})
        holders = [seen(node, name) for name in names]
        assert all(len(h) == 1 for h in holders), holders
        held = [h[0] for h in holders]
        assert set(held) == {g["uuid"] for g in host["gpus"]}  # spread first
        assert max(held.count(u) for u in held) == 2  # then shared, as two replicas allow
    finally:
        for name in names:
            if node.pod(name) is not None:
                node.remove_pod(name)
        assert plugin.stop() == 0, plugin.output()


def generate_cdi_spec(node, hook_config) -> None:
    out = subprocess.run([*hook_command(hook_config), "cdi", "generate", "--output",
                          os.path.join(node.cdi_dir, "oci-gpu-hook.yaml")], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr


ANSWERS = [("envvar", False), ("volume-mounts", False), ("cdi-annotations", False), ("cdi-cri", False),
           ("cdi-annotations", True)]  # fmt: skip


@pytest.mark.parametrize("strategy, hook_reads_annotations", ANSWERS,
                         ids=[f"{s}{'-and-the-hook' if h else ''}" for s, h in ANSWERS])  # fmt: skip
def test_each_allocate_answer_reaches_the_container_through_crio(node, strategy, hook_reads_annotations):
    """hook_reads_annotations: the hook's accept_cdi_annotations on too (meant for runtimes that do
    not apply CDI): it sees that CRI-O applied the devices, and stands down."""
    node, host, hook_config, records, tmp = node
    if strategy.startswith("cdi"):
        generate_cdi_spec(node, hook_config)
    if hook_reads_annotations:  # the same file, rewritten: the hooks.d entry names it
        assert config_with(host, tmp, f"records_directory: {records}\n{SETTINGS}accept_cdi_annotations: true\n") == (
            hook_config
        )
    plugin = kubeletcheck.DevicePlugin(hook_config, node, tmp, plugin_config(strategy), f"plugin-{strategy}")
    name = f"answer-{strategy}{'-hook' if hook_reads_annotations else ''}"
    try:
        node.wait_for_resource("nvidia.com/gpu", 3)
        node.add_pod(name, SHOW, limits={"nvidia.com/gpu": 2})
        uuids = seen(node, name)
        # Exactly the two the kubelet allocated (the plugin's ids are the GPUs' UUIDs).
        assert uuids == sorted(node.allocated_devices(name)["nvidia.com/gpu"], key=uuids.index), uuids
        assert len(uuids) == 2
        text = node.logs(name)
        assert nodes(text) == {str(g["minor"]) for g in host["gpus"] if g["uuid"] in uuids}
        points = [line.split()[4] for line in text.splitlines() if re.match(r"\d+ \d+ \d+:\d+ ", line)]
        driver = [p for p in points if "nvidia" in p or "libcuda" in p]
        assert driver and len(driver) == len(set(driver)), driver  # nothing mounted twice
        record = record_of(records, node.container_id(name))
        stages = node.oci_spec(name)["hooks"]
        assert [h["args"][-1] for h in stages["createRuntime"]] == ["prestart"]  # CRI-O ran the hook
        if strategy.startswith("cdi"):
            # CRI-O applied the spec (its ldcache hook is there); the hook gave nothing, and recorded
            # the container for the node services, marked so.
            assert any("ldcache-refresh" in h["args"] for h in stages.get("createContainer", []))
            assert record["applied_by"] == "runtime", record
        else:
            assert record["applied_by"] == "hook", record
        assert sorted(d["gpu_uuid"] for d in record["devices"]) == sorted(uuids), record
        assert record["kubernetes"]["pod"] == node.full_name(name), record
    finally:
        if node.pod(name) is not None:
            node.remove_pod(name)
        assert plugin.stop() == 0, plugin.output()
        if strategy.startswith("cdi"):
            os.unlink(os.path.join(node.cdi_dir, "oci-gpu-hook.yaml"))
        config_with(host, tmp, f"records_directory: {records}\n{SETTINGS}")


CDI_SHARED = {
    "flags": {"plugin": {"deviceListStrategy": "cdi-cri"}},
    "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2,
                                               "memoryLimit": "per-replica"}]}},
}  # fmt: skip


def test_a_cdi_replica_over_its_share_is_killed_and_its_pod_named(node):
    """cdi-cri, the answer where CRI-O alone gives the GPUs: the hook records each replica with
    its share (issue 39, item 7), so the real watchdog kills the one over it, and the real
    exporter names the pods. Before, the hook stood down and wrote no record: neither saw them."""

    from oci_gpu_hook.toolkit.simulate import control

    node, host, hook_config, records, tmp = node
    generate_cdi_spec(node, hook_config)
    plugin = kubeletcheck.DevicePlugin(hook_config, node, tmp, CDI_SHARED, "plugin-cdi-shared")
    names = ("cdi-over", "cdi-under")
    try:
        node.wait_for_resource("nvidia.com/gpu", 6)
        for name in names:
            node.add_pod(name, SHOW, limits={"nvidia.com/gpu": 1})
        held = {name: seen(node, name) for name in names}
        assert all(len(u) == 1 for u in held.values()), held
        pids = {name: node.container_pid(name) for name in names}
        found = {name: record_of(records, node.container_id(name)) for name in names}
        totals = {g["uuid"]: g["model"]["memory_total"] for g in host["gpus"]}
        for name, record in found.items():
            (uuid,) = held[name]
            assert (record["applied_by"], record["pid"]) == ("runtime", pids[name]), record
            assert record["gpu_memory_limit"] == {uuid: totals[uuid] // 2}, record  # its replica's share
        kubeletcheck.over_share_is_named_and_killed(
            node, host, hook_config, tmp, pids, held, totals, "cdi-over", "cdi-under"
        )
    finally:
        control.clear(host["root"])
        for name in names:
            if node.pod(name) is not None:
                node.remove_pod(name)
        assert plugin.stop() == 0, plugin.output()
        os.unlink(os.path.join(node.cdi_dir, "oci-gpu-hook.yaml"))
