"""What the suite compares of the host (tests/hostcheck.py): a harness's footprint takes in what it
owns and nothing of another user's, kills by pid, and names what holds a busy mount instead of
detaching it; the /dev check names a node made in /dev and leaves out what the kernel makes."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time

import hostcheck
import pytest

from oci_gpu_hook.start.linux import _linux


def _mount_tmpfs(path) -> None:
    os.makedirs(path, exist_ok=True)
    _linux.mount("tmpfs", str(path), "tmpfs", 0, "mode=755")


def _mount_points() -> list:
    return [m.mountpoint for m in hostcheck.mountinfo.read()]


def test_the_dev_check_names_what_a_program_made_and_not_what_the_kernel_did(tmp_path, require):
    """A directory standing for /dev: the host's own cannot be written by a test."""
    require("root")
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "null", 0o666 | 0o020000, os.makedev(1, 3))
    os.symlink("/proc/self/fd", dev / "fd")
    (dev / "char").mkdir()
    _mount_tmpfs(dev / "shm")  # another filesystem below it, as devpts and /dev/shm are
    try:
        (dev / "shm" / "sem.one").write_text("")
        before = hostcheck.dev_entries(str(dev))
        assert before == {"char": "directory", "fd": "link -> /proc/self/fd", "null": "char 1:3", "shm": "directory"}

        os.mknod(dev / "nvidiactl", 0o666 | 0o020000, os.makedev(195, 255))  # what NVML does
        os.symlink("../nvidiactl", dev / "char" / "195:255")
        os.mknod(dev / "null2", 0o666 | 0o020000, os.makedev(1, 3))  # a registered device, another name
        os.unlink(dev / "null")
        os.mknod(dev / "null", 0o666 | 0o020000, os.makedev(1, 5))
        os.unlink(dev / "fd")
        # What devtmpfs and udev do when a device comes (/dev/zero is char 1:5 on every Linux).
        os.mknod(dev / "zero", 0o666 | 0o020000, os.makedev(1, 5))
        os.symlink("../zero", dev / "char" / "1:5")
        # Programs' shared memory in the filesystem mounted below: not nodes.
        (dev / "shm" / "sem.one").unlink()
        (dev / "shm" / "sem.two").write_text("")

        assert hostcheck.dev_changes(before, hostcheck.dev_entries(str(dev))) == [
            "char/195:255: link -> ../nvidiactl appeared",
            "fd: link -> /proc/self/fd went",
            "null: char 1:3 became char 1:5",
            "null2: char 1:3 appeared",
            "nvidiactl: char 195:255 appeared",
        ]
    finally:
        _linux.umount2(str(dev / "shm"))


def test_the_dev_check_runs_around_every_module(request):
    assert "_host_dev_unchanged_by_module" in request.fixturenames


@contextlib.contextmanager
def _network_namespace_of_its_own():
    """This thread, and what it starts, in a network namespace made for the test (gone after): the
    chains a test makes leave the host's ruleset as it was, without even an empty table added."""
    new_net = 0x40000000  # CLONE_NEWNET
    with open("/proc/self/ns/net") as host:
        _linux.unshare(new_net)
        try:
            yield
        finally:
            _linux.setns(host.fileno(), new_net)


def _iptables(*args: str) -> None:
    subprocess.run(["iptables", *args], check=True, capture_output=True)


def test_a_harness_compares_what_it_owns_and_nothing_of_another_user(tmp_path, require):
    """Another user's processes named like a cluster's (kube-apiserver, containerd, conmon), their
    chain and their mount leave the comparison equal and are not killed; the harness's own
    process, the one it daemonized (out of its parent's reach, still in its cgroup), its mount and
    its chain are seen, and all but the chain undone by close(), which raises while the chain is
    there (compared, not removed: the harness cannot know whose rule it would remove)."""
    require("root", "iptables", "iptables-save")
    import kubeletcheck

    with _network_namespace_of_its_own():
        _compares_only_its_own(kubeletcheck, tmp_path)


def _compares_only_its_own(harness, tmp_path) -> None:
    before = harness.host_state()
    others, chains = [], []
    pid = os.getpid()
    try:
        for name in ("kube-apiserver", "containerd", "conmon"):  # the command name is the file's
            os.symlink("/bin/sleep", tmp_path / name)
            others.append(subprocess.Popen([str(tmp_path / name), "300"]))
        _iptables("-N", f"OTHER-{pid}")
        chains.append(f"OTHER-{pid}")
        _mount_tmpfs(tmp_path / "other")
        assert harness.host_state() == before

        own = tmp_path / "own"
        footprint = hostcheck.Footprint("test", directories=[own], chains=(f"OCIGPU-{pid}-",))
        started = footprint.popen(["sh", "-c", "setsid sleep 301 & exec sleep 302"])
        _mount_tmpfs(own / "m")
        _iptables("-N", f"OCIGPU-{pid}-X")
        chains.append(f"OCIGPU-{pid}-X")
        deadline = time.monotonic() + 10
        while len(footprint.pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        state = harness.host_state()
        assert sorted(footprint.pids().values()) == ["sleep", "sleep"]
        assert started.pid in footprint.pids()
        assert state["processes"] == sorted(f"sleep (pid {p})" for p in footprint.pids())
        assert state["mounts"] == [str(own / "m")] and state["cgroups"] == [footprint.cgroup]
        assert state["iptables"] == [f"added: iptables-save filter :OCIGPU-{pid}-X"]

        chain_left = re.escape(str({"iptables": [f"added: iptables-save filter :OCIGPU-{pid}-X"]}))
        with pytest.raises(AssertionError, match=f"still there: {chain_left}$"):
            footprint.close()
        assert started.wait(10) == -9
        _iptables("-X", f"OCIGPU-{pid}-X")
        chains.remove(f"OCIGPU-{pid}-X")
        footprint.close()
        assert harness.host_state() == before
        assert all(p.poll() is None for p in others)  # another user's, named like ours, live on
    finally:
        for proc in others:
            proc.kill()
            proc.wait()
        for chain in chains:
            _iptables("-X", chain)
        if str(tmp_path / "other") in _mount_points():
            _linux.umount2(str(tmp_path / "other"))


def test_a_busy_mount_is_not_detached_but_named_with_what_holds_it(tmp_path, require):
    require("root")
    footprint = hostcheck.Footprint("busy", directories=[tmp_path])
    _mount_tmpfs(tmp_path / "m")
    held = open(tmp_path / "m" / "open", "w")
    try:
        with pytest.raises(RuntimeError, match=rf"umount {tmp_path}/m: busy; held by {os.getpid()} \(\S+\): fd \d+$"):
            footprint.unmount(busy_for=0.2)
        assert str(tmp_path / "m") in _mount_points()  # still there: a lazy unmount would have hidden it
    finally:
        held.close()
    footprint.close()
    assert footprint.mounts() == [] and str(tmp_path / "m") not in _mount_points()
