"""Attack round 2, class 3: host-side mount sources are trusted files, not what a local user left.

A local unprivileged user can write /tmp (the MPS pipe directory's default parent) and, as a
service account, may own /run/nvidia-persistenced. Each case plants what such a user could in the
simulated host, then starts a GPU container: an optional source that is not root's is skipped
(the container starts and the log says why), a required one stops the start with one line, and
nothing a symlink points at is ever mounted.
"""

import json
import os
import shutil
import socket
import subprocess

import hookcheck
import pytest

from oci_gpu_hook.toolkit.containers import hook_command

ENV = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}
HOST = {"gpus": 3}  # a host of its own: the cases change its files
MPS = "/tmp/nvidia-mps"
SOCKET = "/var/run/nvidia-persistenced/socket"


@pytest.fixture
def case(live_container, tmp_path):
    """(host root, start): start(craft) crafts the host, rebuilds the inventory cache, starts a
    container, runs the hook; returns (result, the container's mount points, log records)."""
    planted = []

    def start(craft):
        state, bundle, pid, cgroup, host = live_container(ENV, host_options=HOST)
        root = host["root"]
        for path in (MPS, os.path.dirname(SOCKET)):
            planted.append(root + path)
        craft(root)
        config = f"{root}/config.yaml"
        subprocess.run([*hook_command(config), "inventory", "refresh"], check=True, capture_output=True)
        log = f"{root}/hook.log"
        if os.path.exists(log):
            os.unlink(log)
        out = hookcheck.run_hook(config, state)
        records = [json.loads(line) for line in open(log)] if os.path.exists(log) else []
        rootfs = os.path.realpath(os.path.join(bundle, "rootfs"))
        mounts = {}  # mount point inside the rootfs -> its per-mount options
        with open(f"/proc/{pid}/mountinfo") as f:
            for line in f:
                fields = line.split()
                point = hookcheck.unescape(fields[4])
                if point.startswith(rootfs + "/"):
                    mounts[point[len(rootfs) :]] = set(fields[5].split(","))
        return out, mounts, records

    yield start
    for path in planted:
        if os.path.islink(path) or os.path.isfile(path):
            os.unlink(path)
        elif os.path.isdir(path):
            shutil.rmtree(path)


def world_writable_tmp(root):
    os.makedirs(f"{root}/tmp", exist_ok=True)
    os.chmod(f"{root}/tmp", 0o1777)  # as the real /tmp


def skipped(records, path):
    notes = [s for r in records for s in r.get("skipped", []) if path in s]
    assert notes, records
    return notes[0]


def test_mps_directory_of_root_is_mounted(case):
    def craft(root):
        world_writable_tmp(root)
        os.mkdir(root + MPS, 0o755)

    out, mounts, records = case(craft)
    assert out.returncode == 0, out.stderr
    assert {"rw", "nosuid", "nodev", "noexec"} <= mounts[MPS]  # clients make their pipes there


def test_mps_directory_made_by_a_local_user_is_skipped(case):
    def craft(root):
        world_writable_tmp(root)
        os.mkdir(root + MPS, 0o755)
        os.chown(root + MPS, 65534, 65534)

    out, mounts, records = case(craft)
    assert out.returncode == 0, out.stderr
    assert MPS not in mounts
    assert "owned by uid 65534" in skipped(records, MPS)


def test_mps_symlink_to_a_root_only_directory_is_not_followed(case, tmp_path):
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    (secret / "key").write_text("host secret\n")

    def craft(root):
        world_writable_tmp(root)
        os.symlink(str(secret), root + MPS)
        os.lchown(root + MPS, 65534, 65534)

    out, mounts, records = case(craft)
    assert out.returncode == 0, out.stderr
    assert MPS not in mounts
    assert "symlink owned by uid 65534" in skipped(records, MPS)


def test_mps_regular_file_does_not_stop_gpu_containers(case):
    def craft(root):
        world_writable_tmp(root)
        with open(root + MPS, "w") as f:
            f.write("not a directory\n")
        os.chown(root + MPS, 65534, 65534)

    out, mounts, records = case(craft)
    assert out.returncode == 0, out.stderr
    assert MPS not in mounts
    skipped(records, MPS)


def test_mps_directory_others_can_write_is_skipped(case):
    def craft(root):
        world_writable_tmp(root)
        os.mkdir(root + MPS)
        os.chmod(root + MPS, 0o777)  # root's, but shared with every local user

    out, mounts, records = case(craft)
    assert out.returncode == 0, out.stderr
    assert MPS not in mounts
    assert "writable by others than root" in skipped(records, MPS)


def make_socket(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()


def test_persistenced_socket_is_mounted_read_only(case):
    out, mounts, records = case(lambda root: make_socket(root + SOCKET))
    assert out.returncode == 0, out.stderr
    assert {"ro", "nosuid", "nodev", "noexec"} <= mounts[SOCKET]


def test_persistenced_directory_owned_by_its_service_user_is_skipped(case):
    def craft(root):
        make_socket(root + SOCKET)
        os.chown(os.path.dirname(root + SOCKET), 65534, 65534)

    out, mounts, records = case(craft)
    assert out.returncode == 0, out.stderr
    assert SOCKET not in mounts
    assert "others than root can change" in skipped(records, SOCKET)


def test_persistenced_socket_swapped_for_a_symlink_after_discovery(live_container):
    """The inventory saw a socket; by mount time it is a symlink to a root-only file."""
    state, bundle, pid, cgroup, host = live_container(ENV, host_options=HOST)
    root = host["root"]
    make_socket(root + SOCKET)
    config = f"{root}/config.yaml"
    try:
        subprocess.run([*hook_command(config), "inventory", "refresh"], check=True, capture_output=True)
        os.unlink(root + SOCKET)
        os.symlink("/etc/shadow", root + SOCKET)
        out = hookcheck.run_hook(config, state)
        mounts = {m[0] for m in hookcheck.mountinfo(pid)}
    finally:
        shutil.rmtree(os.path.dirname(root + SOCKET))
    assert out.returncode == 0, out.stderr
    assert not [m for m in mounts if m.endswith(SOCKET)]


def test_a_library_not_owned_by_root_stops_the_start(case, simulated_host):
    root = simulated_host(**HOST)["root"]
    library = next(f"{root}/usr/lib64/{n}" for n in os.listdir(f"{root}/usr/lib64") if n.startswith("libcuda.so."))
    try:
        out, mounts, records = case(lambda root: os.chown(library, 65534, 65534))
    finally:
        os.chown(library, 0, 0)
    assert out.returncode != 0
    line = hookcheck.one_clear_line(out.stderr.decode())
    assert "owned by uid 65534, not root: refusing to mount it into containers" in line, line
    assert not [m for m in mounts if "libcuda" in m]


def test_sticky_directory_rule(tmp_path):
    """The rule itself: a sticky, world-writable directory of root's is safe to cross; without the
    sticky bit, or owned by someone else, it is not."""
    from oci_gpu_hook.start.linux import sources

    def check(mode, uid):
        d = tmp_path / f"d{mode:o}-{uid}"
        d.mkdir()
        os.chmod(d, mode)
        os.chown(d, uid, uid)
        (d / "f").write_text("x")
        os.chmod(d / "f", 0o644)
        opener = sources.HostSources()
        try:
            os.close(opener.open(str(d / "f"), "file"))
            return "ok"
        except sources.UntrustedSource as e:
            return e.why
        finally:
            opener.close()

    assert check(0o1777, 0) == "ok"
    assert check(0o755, 0) == "ok"
    assert "others than root can change" in check(0o777, 0)
    assert "others than root can change" in check(0o755, 65534)
