"""Rollback never takes device access away that a cgroup had before the hook.

Found while testing attack round 2: a container whose devices cgroup (v1) allows everything (the
hierarchy's root, or a privileged container's cgroup) got the hook's allow rules (no-ops there)
and, on rollback, their undo: deny rules. In the root cgroup that denies the GPUs to the whole
host. A rule the cgroup already grants is now neither written nor undone.
"""

import json
import os

import hookcheck
import pytest

from oci_gpu_hook.start.apply import FAULT_ENV
from oci_gpu_hook.toolkit import containers

ROOT = "/sys/fs/cgroup/devices"
ENV = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "all"}


def probe_allows(rules) -> bool:
    """Whether a fresh deny-all child of the root may still be granted rules (it may only if the
    root does not deny them)."""
    child = os.path.join(ROOT, f"ocigpu-probe-{os.getpid()}")
    os.mkdir(child)
    try:
        with open(os.path.join(child, "devices.deny"), "w") as f:
            f.write("a")
        for rule in rules:
            try:
                with open(os.path.join(child, "devices.allow"), "w") as f:
                    f.write(rule)
            except PermissionError:
                return False
        return True
    finally:
        hookcheck.remove_cgroup(child)


@pytest.fixture
def setup(tmp_path, simulated_host, require):
    require("root", "unshare", "busybox", "gcc")
    if not os.path.isdir(ROOT):
        pytest.fail(f"the cgroup v1 devices hierarchy is not mounted at {ROOT}")
    host = simulated_host(gpus=2, mig=[1])
    bundle = containers.make_bundle(str(tmp_path / "bundle"), args=["true"], env=ENV, config_file=None)
    holder = hookcheck.hold_namespace(os.path.join(bundle, "rootfs"))
    with open(os.path.join(ROOT, "cgroup.procs"), "w") as f:
        f.write(str(holder.pid))  # the root devices cgroup, whichever cgroup pytest runs in
    state = json.dumps({"ociVersion": "1.0.2", "id": "rootcg", "status": "creating", "pid": holder.pid,
                        "bundle": bundle})  # fmt: skip
    yield host, state, holder.pid
    holder.kill()
    holder.wait()


def test_rollback_in_the_root_devices_cgroup_denies_nothing(setup):
    host, state, pid = setup
    with open(f"/proc/{pid}/cgroup") as f:
        assert any(line.split(":")[1] == "devices" and line.strip().endswith(":/") for line in f)
    with open(f"{host['root']}/proc/devices") as f:
        majors = {name: int(major) for major, name in (line.split() for line in f if "nvidia" in line)}
    rules = [f"c {majors['nvidia']}:255 rw", f"c {majors['nvidia-uvm']}:0 rw", f"c {majors['nvidia-uvm']}:1 rw"]
    assert probe_allows(rules)
    try:
        out = hookcheck.run_hook(f"{host['root']}/config.yaml", state, env={**hookcheck.HOOK_ENV, FAULT_ENV: "30"})
        assert out.returncode != 0 and "injected fault" in out.stderr.decode()
        assert probe_allows(rules), "the hook's rollback left deny rules in the host's root devices cgroup"
    finally:  # were the bug back, give the host its devices back (an allow lifts a root's deny)
        for rule in rules:
            with open(os.path.join(ROOT, "devices.allow"), "w") as f:
                f.write(rule)


def test_a_privileged_containers_cgroup_keeps_allowing_everything(setup):
    host, state, pid = setup
    cgroup = os.path.join(ROOT, f"ocigpu-privileged-{os.getpid()}")
    os.mkdir(cgroup)  # a new v1 devices cgroup inherits allow-all, as a privileged container's has
    try:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        out = hookcheck.run_hook(f"{host['root']}/config.yaml", state,
                                 env={**hookcheck.HOOK_ENV, FAULT_ENV: "30"})  # fmt: skip
        assert out.returncode != 0
        assert open(os.path.join(cgroup, "devices.list")).read().split() == ["a", "*:*", "rwm"]
    finally:
        with open(os.path.join(ROOT, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        hookcheck.remove_cgroup(cgroup)
