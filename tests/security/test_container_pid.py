"""Attack round 2, class 8: a state.pid that is not the container (a runtime bug, or a pid reused).

With `cgroups: off` nothing else stops the hook, and a host process's mount namespace is the
host's own: the hook must see that the pid is not the bundle's container and change nothing.
"""

import json
import os
import subprocess

import hookcheck
import pytest

from oci_gpu_hook.toolkit import containers


@pytest.fixture
def setup(tmp_path, simulated_host, require):
    require("root", "unshare", "busybox", "gcc")
    host = simulated_host(gpus=2)
    bundle = containers.make_bundle(str(tmp_path / "bundle"), args=["true"], env={"NVIDIA_VISIBLE_DEVICES": "0"},
                              config_file=None)  # fmt: skip
    config = hookcheck.config_with(host, tmp_path, "cgroups: off\n")
    started = []

    def start(argv):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        started.append(proc)
        assert proc.stdout.readline() == b"ready\n"
        return proc.pid

    yield bundle, str(config), start
    for proc in started:
        proc.kill()
        proc.wait()


def mount_table():
    with open("/proc/self/mountinfo") as f:
        return sorted(line.split()[4] for line in f)


def refused(bundle, config, pid, words):
    state = json.dumps({"ociVersion": "1.0.2", "id": "not-it", "status": "creating", "pid": pid, "bundle": bundle})
    rootfs_before = sorted(os.listdir(os.path.join(bundle, "rootfs", "dev")))
    before = mount_table()
    out = hookcheck.run_hook(config, state)
    assert mount_table() == before  # not one mount left in the host's own table
    assert sorted(os.listdir(os.path.join(bundle, "rootfs", "dev"))) == rootfs_before
    assert out.returncode != 0
    line = hookcheck.one_clear_line(out.stderr.decode())
    assert f"pid {pid} is not the container of this bundle" in line and words in line, line


def test_a_host_process(setup):
    bundle, config, start = setup
    pid = start(["sh", "-c", "echo ready; exec sleep 600"])
    refused(bundle, config, pid, "shares the hook's own mount namespace")


def test_a_process_in_a_copy_of_the_host_namespace(setup):
    """Another namespace, but no runtime made the rootfs a mount point there: not a container."""
    bundle, config, start = setup
    pid = start(["unshare", "--mount", "--propagation", "private", "sh", "-c", "echo ready; exec sleep 600"])
    refused(bundle, config, pid, "is not a mount point in its namespace")


def test_the_container_of_another_bundle(setup, tmp_path):
    bundle, config, start = setup
    other = containers.make_rootfs(str(tmp_path / "other-rootfs"))
    script = 'mount --bind "$1" "$2" && echo ready && exec sleep 600'
    rootfs = os.path.join(bundle, "rootfs")
    pid = start(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", other, rootfs])
    refused(bundle, config, pid, "is another directory")


def test_the_real_container_is_accepted(setup):
    bundle, config, start = setup
    proc_pid = hookcheck.hold_namespace(os.path.join(bundle, "rootfs"), 60)
    try:
        state = json.dumps({"ociVersion": "1.0.2", "id": "it", "status": "creating", "pid": proc_pid.pid,
                            "bundle": bundle})  # fmt: skip
        out = hookcheck.run_hook(config, state)
        assert out.returncode == 0, out.stderr
    finally:
        proc_pid.kill()
        proc_pid.wait()
