"""`plan` promises what the hook would do: both call start/plan.decide. On the same bundles, good
and bad, the dry run refuses what the hook refuses (same exit status, same line) and, for what the
hook accepts, names the devices and GPU memory limits the hook records (issue 32). Before, a
GPU_MEMORY_LIMIT of "banana" got a full plan and exit 0 while the hook refused the container."""

from __future__ import annotations

import json
import os
import subprocess

import hookcheck
import pytest

from oci_gpu_hook.start import container_record
from oci_gpu_hook.start.memory_limit import ENV
from oci_gpu_hook.toolkit.containers import hook_command

CASES = {
    "one-gpu": {"NVIDIA_VISIBLE_DEVICES": "0"},
    "mig": {"NVIDIA_VISIBLE_DEVICES": "1:0", "NVIDIA_DRIVER_CAPABILITIES": "utility"},
    "with-a-limit": {"NVIDIA_VISIBLE_DEVICES": "0", ENV: "1GiB"},
    "banana-limit": {"NVIDIA_VISIBLE_DEVICES": "0", ENV: "banana"},
    "limit-too-large": {"NVIDIA_VISIBLE_DEVICES": "0", ENV: "4096GiB"},
    "unknown-device": {"NVIDIA_VISIBLE_DEVICES": "7"},
    "unknown-capability": {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,warp-drive"},
    "requirement-unmet": {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=99.0"},
    "void": {"NVIDIA_VISIBLE_DEVICES": "void"},
}


def decided_alike(config: str, state: str, bundle: str, pid: int, host: dict):
    """The dry run, then the hook, on one bundle: the same exit status, a refusal in the same line.
    (the plan's JSON, the container's record or None) where the hook accepted it, else None."""
    dry = subprocess.run([*hook_command(config), "plan", "--json", "--bundle", bundle], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    hook = hookcheck.run_hook(config, state)
    assert dry.returncode == hook.returncode, (dry.stderr, hook.stderr)
    if hook.returncode != 0:
        assert dry.stderr == hook.stderr.decode(), "the dry run refuses with the hook's own line"
        return None
    # By pid: the ids of these test containers repeat between tests sharing the simulated host.
    records = container_record.read_all(f"{host['root']}/containers").values()
    return json.loads(dry.stdout), next((r for r in records if r and r["pid"] == pid), None)


@pytest.mark.parametrize("case", list(CASES))
def test_plan_decides_as_the_hook_does(live_container, case):
    state, bundle, pid, cgroup, host = live_container(CASES[case])
    accepted = decided_alike(f"{host['root']}/config.yaml", state, bundle, pid, host)
    if accepted is None:
        return
    planned, record = accepted
    if not planned["gpu_container"]:
        assert record is None
        return
    assert record["devices"] == planned["devices"]
    assert record["gpu_memory_limit"] == planned["gpu_memory_limit"]


def _as_the_runtime_mounts(pid: int, rootfs: str, mounts) -> None:
    """Bind each mount into the container's mount namespace, as a runtime does before it runs the
    prestart hooks (targets made as runc makes them: a directory for a directory, else a file)."""
    lines = ["set -e"]
    for m in mounts:
        target = rootfs + m["destination"]
        make = (
            f'mkdir -p "{target}"'
            if os.path.isdir(m["source"])
            else f'mkdir -p "$(dirname "{target}")"; [ -e "{target}" ] || touch "{target}"'
        )
        lines += [make, f'mount --bind "{m["source"]}" "{target}"']
    subprocess.run(["nsenter", "--target", str(pid), "--mount", "sh", "-c", "\n".join(lines)], check=True, timeout=60)


def test_plan_decides_as_the_hook_does_where_the_runtime_applied_a_cdi_devices_mounts_but_not_its_nodes(
    live_container, tmp_path
):
    """A runtime that applied the mounts of a CDI device (cdi.k8s.io annotation, accepted) but not
    its nodes (no linux.devices): the hook finds the runtime's mounts at its own targets, the
    persistenced socket among them. The dry run and the hook decide alike (issue 52, item 8d)."""
    from oci_gpu_hook.start import inventory_cache
    from oci_gpu_hook.start import settings as settings_module
    from oci_gpu_hook.toolkit import cdi

    state, bundle, pid, cgroup, host = live_container({"NVIDIA_VISIBLE_DEVICES": "void"})
    config = hookcheck.config_with(host, tmp_path, "accept_cdi_annotations: true\n")
    settings = settings_module.load(config)
    spec = cdi.build_spec(inventory_cache.load(settings), settings)
    mounts = [{"destination": m["containerPath"], "source": m["hostPath"], "type": "bind", "options": m["options"]}
              for m in spec["containerEdits"]["mounts"]]  # fmt: skip
    assert any(m["destination"].endswith("/nvidia-persistenced/socket") for m in mounts)
    gpu = host["gpus"][0]
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        doc = json.load(f)
    doc["mounts"] += mounts
    doc.setdefault("annotations", {})["cdi.k8s.io/oci-gpu-hook_nvidia.com_gpu"] = f"nvidia.com/gpu={gpu['uuid']}"
    with open(path, "w") as f:
        json.dump(doc, f)
    _as_the_runtime_mounts(pid, os.path.join(bundle, "rootfs"), mounts)

    accepted = decided_alike(config, state, bundle, pid, host)
    assert accepted is not None, "the hook gives what is missing (issue 52, item 8d)"
    planned, record = accepted
    assert record["devices"] == planned["devices"] and [d["gpu_uuid"] for d in record["devices"]] == [gpu["uuid"]]
    # What was missing is given (the GPU's node), what the runtime mounted is left to it.
    assert {(m["source"], m["target"]) for m in planned["mounted_by_runtime"]} == {
        (m["source"], m["destination"]) for m in mounts
    }
    node = os.path.join(bundle, "rootfs", "dev", f"nvidia{gpu['minor']}")
    seen = subprocess.run(["nsenter", "--target", str(pid), "--mount", "stat", "-c", "%F %t:%T", node],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert seen.stdout == f"character special file c3:{gpu['minor']:x}\n", seen.stderr
