"""SELinux: what the hook creates carries the container's mountLabel; host files keep theirs.

This kernel has no SELinux, so the one query 'is SELinux enabled?' is stood in for; the labels
themselves are really written (libselinux sets the security.selinux xattr) and read back.
"""

import io
import os

from oci_gpu_hook.start import prestart

LABEL = "system_u:object_r:container_file_t:s0:c17,c42"


def xattr(path):
    try:
        return os.getxattr(path, "security.selinux", follow_symlinks=False).rstrip(b"\0").decode()
    except OSError:
        return None


def tree(root):
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            found[os.path.relpath(path, root)] = xattr(path)
    return found


def test_created_files_get_the_mount_label_and_host_files_keep_theirs(live_container, mocker):
    state, bundle, pid, cgroup, host = live_container({"NVIDIA_VISIBLE_DEVICES": "1:0"}, mount_label=LABEL)
    mocker.patch("oci_gpu_hook.start.linux.labels.selinux_enabled", return_value=True)
    rootfs = os.path.join(bundle, "rootfs")
    before, host_before = tree(rootfs), tree(host["root"])
    assert prestart.run(f"{host['root']}/config.yaml", stdin=io.BytesIO(state.encode())) == 0
    after, host_after = tree(rootfs), tree(host["root"])
    created = set(after) - set(before)
    assert {"usr/bin/nvidia-smi", "dev/nvidiactl", "usr/lib64/libnvidia-ml.so.1", "etc/ld.so.cache",
            f"lib/firmware/nvidia/{host['driver_version']}"} <= created  # fmt: skip
    assert {path: after[path] for path in created} == {path: LABEL for path in created}
    # what existed before keeps its label, and nothing on the host was relabelled
    assert {p: after[p] for p in before if p != "etc/ld.so.cache"} == {p: before[p] for p in before}
    assert {p: host_after[p] for p in host_before} == host_before


def test_nothing_is_labelled_when_selinux_is_disabled(live_container):
    state, bundle, pid, cgroup, host = live_container({"NVIDIA_VISIBLE_DEVICES": "0"}, mount_label=LABEL)
    assert prestart.run(f"{host['root']}/config.yaml", stdin=io.BytesIO(state.encode())) == 0
    labels = set(tree(os.path.join(bundle, "rootfs")).values())
    assert LABEL not in labels
