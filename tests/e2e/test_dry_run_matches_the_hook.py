"""`plan` promises what the hook would do: both call start/plan.decide. On the same bundles, good
and bad, the dry run refuses what the hook refuses (same exit status, same line) and, for what the
hook accepts, names the devices and GPU memory limits the hook records (issue 32). Before, a
GPU_MEMORY_LIMIT of "banana" got a full plan and exit 0 while the hook refused the container."""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("case", list(CASES))
def test_plan_decides_as_the_hook_does(live_container, case):
    state, bundle, pid, cgroup, host = live_container(CASES[case])
    config = f"{host['root']}/config.yaml"
    dry = subprocess.run([*hook_command(config), "plan", "--json", "--bundle", bundle], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    hook = hookcheck.run_hook(config, state)
    assert dry.returncode == hook.returncode, (dry.stderr, hook.stderr)
    if hook.returncode != 0:
        assert dry.stderr == hook.stderr.decode(), "the dry run refuses with the hook's own line"
        return
    planned = json.loads(dry.stdout)
    # By pid: the ids of these test containers repeat between tests sharing the simulated host.
    records = container_record.read_all(f"{host['root']}/containers").values()
    record = next((r for r in records if r and r["pid"] == pid), None)
    if not planned["gpu_container"]:
        assert record is None
        return
    assert record["devices"] == planned["devices"]
    assert record["gpu_memory_limit"] == planned["gpu_memory_limit"]
