"""Attack round 2, class 4: the /proc/driver/nvidia mask is read-only, and making it so changes
that one mount only (MS_BIND|MS_REMOUNT through its descriptor), never the filesystem under it.
"""

import os

import hookcheck

ENV = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "all"}


def options(pid):
    """mount point -> (per-mount options, superblock options) as pid sees them."""
    table = {}
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            fields = line.split()
            table[hookcheck.unescape(fields[4])] = (fields[5], line.split(" - ", 1)[1].split()[2])
    return table


def test_mask_is_read_only_and_nothing_else_is_remounted(live_container):
    state, bundle, pid, cgroup, host = live_container(ENV)
    rootfs = os.path.realpath(os.path.join(bundle, "rootfs"))
    os.makedirs(os.path.join(rootfs, "proc/driver/nvidia"))  # where a loaded driver's procfs has it
    host_before, container_before = options("self"), options(pid)
    out = hookcheck.run_hook(f"{host['root']}/config.yaml", state)
    assert out.returncode == 0, out.stderr
    container_after = options(pid)
    mask = f"{rootfs}/proc/driver/nvidia"
    assert container_after[mask][0].split(",")[0] == "ro", container_after[mask]
    touched = hookcheck.in_container(pid, "touch", f"{mask}/written-by-the-container", check=False)
    assert touched.returncode != 0 and "Read-only file system" in touched.stderr
    # Every mount that was there before keeps its options, in the container and on the host.
    assert {k: container_after[k] for k in container_before} == container_before
    assert options("self") == host_before
