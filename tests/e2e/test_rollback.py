"""All or nothing: make the Nth operation fail, for every N, and show nothing the hook did remains.

The container is a real process in its own mount namespace (unshare) with a rootfs, in a fresh
cgroup v1 devices group that denies everything: what a runtime gives the hook at prestart, but
kept alive after the failure so the namespace and the cgroup can be inspected.
"""

import json
import os
import subprocess

import hookcheck
import pytest

from oci_gpu_hook.toolkit.containers import hook_command


def host_files(tree):
    # The hook's own log and inventory cache are the host files it is meant to write.
    # (its container records among them: a failed start leaves one, as docs/monitoring.md says).
    return {path: kind for path, kind in tree.items()
            if path not in hookcheck.HOOK_OWN_FILES and not path.startswith("containers/")}  # fmt: skip


def hook(config, state, fault=None):
    env = {"PATH": "/usr/bin:/bin"}
    if fault is not None:
        env["OCI_GPU_HOOK_FAULT_AT"] = str(fault)
    return subprocess.run([*hook_command(config), "prestart"], input=state, capture_output=True, text=True,
                          env=env, timeout=60)  # fmt: skip


def mounts_of(pid):
    with open(f"/proc/{pid}/mountinfo") as f:
        return sorted(line.split()[4] for line in f)


def device_rules(cgroup):
    with open(os.path.join(cgroup, "devices.list")) as f:
        return f.read()


@pytest.fixture
def container(live_container):
    return live_container(env={"NVIDIA_VISIBLE_DEVICES": "0,1:0"})


def test_every_operation_failing_rolls_everything_back(container, tmp_path):
    state, bundle, pid, cgroup, host = container
    config = f"{host['root']}/config.yaml"
    planned = subprocess.run([*hook_command(config), "plan", "--bundle", bundle, "--json"], capture_output=True,
                             text=True, check=True)  # fmt: skip
    count = len(json.loads(planned.stdout)["operations"])
    assert count > 40
    before = (mounts_of(pid), hookcheck.tree(bundle), hookcheck.tree(host["root"]), device_rules(cgroup))
    for n in range(1, count + 1):
        out = hook(config, state, fault=n)
        assert out.returncode != 0, f"operation {n} did not fail"
        assert len(out.stderr.splitlines()) == 1 and f"operation {n} (" in out.stderr, out.stderr
        after = (mounts_of(pid), hookcheck.tree(bundle), hookcheck.tree(host["root"]), device_rules(cgroup))
        assert after[0] == before[0], f"mounts left after failing operation {n}"
        assert after[1] == before[1], f"files left in the bundle after failing operation {n}"
        assert host_files(after[2]) == host_files(before[2]), f"host tree changed after failing operation {n}"
        assert after[3] == before[3], f"device rules left after failing operation {n}"
    # and without a fault, the same container is configured: mounts and rules appear
    out = hook(config, state)
    assert out.returncode == 0, out.stderr
    assert len(mounts_of(pid)) > len(before[0])
    assert "c 195:255 rw" in device_rules(cgroup)
