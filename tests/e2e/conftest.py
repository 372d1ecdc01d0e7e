"""Fixtures for end-to-end tests: live 'containers' in real mount namespaces and cgroups."""

import json
import os
import subprocess
import time

import pytest

from oci_gpu_hook import demo

CGROUP_ROOT = "/sys/fs/cgroup/devices"


@pytest.fixture
def live_container(tmp_path, simulated_host, require):
    """Factory: a live 'container' (a process in its own mount namespace, in a fresh cgroup v1
    devices group that denies everything, with a bundle and rootfs), as a runtime hands it to the
    hook at prestart, but kept alive afterwards so it can be inspected. Returns
    (state JSON, bundle, pid, cgroup dir, simulated host)."""
    require("root", "unshare", "busybox", "gcc")
    if not os.path.isdir(CGROUP_ROOT):
        pytest.fail("the cgroup v1 devices hierarchy is not mounted at /sys/fs/cgroup/devices")
    started = []

    def make(env, mount_label=None, host_options=None, debian=False):
        host = simulated_host(**(host_options or {"gpus": 2, "mig": [1]}))
        bundle = demo.make_bundle(
            str(tmp_path / f"bundle{len(started)}"),
            rootfs_debian=debian,
            args=["true"],
            env=env,
            config_file=None,
            mount_label=mount_label,
        )
        cgroup = os.path.join(CGROUP_ROOT, f"ocigpu-test-{os.getpid()}-{time.monotonic_ns()}")
        os.mkdir(cgroup)
        proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "600"])
        started.append((proc, cgroup))
        time.sleep(0.2)
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(proc.pid))
        with open(os.path.join(cgroup, "devices.deny"), "w") as f:
            f.write("a")
        state = {
            "ociVersion": "1.0.2",
            "id": f"live{len(started)}",
            "status": "creating",
            "pid": proc.pid,
            "bundle": bundle,
        }
        return json.dumps(state), bundle, proc.pid, cgroup, host

    yield make
    for proc, cgroup in started:
        proc.kill()
        proc.wait()
        for _ in range(50):
            try:
                os.rmdir(cgroup)
                break
            except OSError:
                time.sleep(0.05)
