"""apply carries the plan out in the hook's own process (issue 41): it joins the container's mount
namespace and gives the process back as it found it, after a success as after a rollback: its
own mount namespace, working directory, descriptors and SIGALRM handler. Everything after apply
(the container record, the log) depends on it seeing the host again."""

import errno
import os
import signal

import hookcheck
import pytest

from oci_gpu_hook.errors import Exit
from oci_gpu_hook.start import apply
from oci_gpu_hook.start.apply import FAULT_ENV
from oci_gpu_hook.start.linux import _linux

ENV = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "utility,compute"}


def own_place():
    return (
        os.readlink("/proc/self/ns/mnt"),
        os.stat("/").st_ino,
        os.getcwd(),
        sorted(os.listdir("/proc/self/fd")),
        signal.getsignal(signal.SIGALRM),
        signal.getitimer(signal.ITIMER_REAL),
    )


def mounted_in(pid: int, path: str) -> bool:
    with open(f"/proc/{pid}/mountinfo") as f:
        return any(line.split()[4].endswith(path) for line in f)


def test_the_process_is_given_back_after_a_success(live_container, capsys, tmp_path, monkeypatch):
    state, bundle, pid, cgroup, host = live_container(ENV)
    monkeypatch.chdir(tmp_path)
    before = own_place()
    result = hookcheck.run_hook_in_process(f"{host['root']}/config.yaml", state, capsys)
    assert result.returncode == 0, result.stderr
    assert own_place() == before
    assert mounted_in(pid, "/dev/nvidia0"), "the GPU was not mounted in the container's namespace"
    assert not mounted_in(os.getpid(), "/dev/nvidia0"), "a mount was made in the hook's own namespace"


def test_the_process_is_given_back_after_a_rollback(live_container, capsys, tmp_path, monkeypatch):
    container = live_container(ENV)
    state, bundle, pid, cgroup, host = container
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(FAULT_ENV, "20")  # the hook reads it from its own environment
    before, observed = own_place(), hookcheck.observe(container)
    result = hookcheck.run_hook_in_process(f"{host['root']}/config.yaml", state, capsys)
    assert result.returncode == Exit.APPLY
    assert "injected fault" in hookcheck.one_clear_line(result.stderr)
    assert own_place() == before
    hookcheck.assert_rolled_back(observed, hookcheck.observe(container))


@pytest.mark.parametrize("fault", ["\u00b9", "\u0663", "\uff12"], ids=["superscript-1", "arabic-indic-3", "full-2"])
def test_a_fault_in_other_digits_is_no_fault(live_container, capsys, tmp_path, monkeypatch, fault):
    """The fault's number is ASCII digits or nothing (start/digits.py): '¹' made int() raise, an
    internal error of the start, and '٣' failed operation 3."""
    state, bundle, pid, cgroup, host = live_container(ENV)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(FAULT_ENV, fault)
    result = hookcheck.run_hook_in_process(f"{host['root']}/config.yaml", state, capsys)
    assert result.returncode == 0, result.stderr
    assert mounted_in(pid, "/dev/nvidia0")


def mounts_under(pid: int, rootfs: str) -> dict:
    """{path in the container: (its mount's own options, its propagation tags)} under rootfs."""
    found = {}
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            fields = line.partition(" - ")[0].split()
            if fields[4].startswith(rootfs + "/"):
                found[fields[4][len(rootfs) :]] = (set(fields[5].split(",")), fields[6:])
    return found


@pytest.mark.parametrize("kernel", ["mount_setattr", "before 5.12"])
def test_each_bind_has_exactly_its_flags_and_is_private(live_container, capsys, monkeypatch, kernel):
    """A bind's flags are set and the others of ro, nosuid, nodev and noexec cleared, as a bind
    remount does, through mount_setattr where the kernel has it and by the remount where not
    (ENOSYS: Linux before 5.12)."""
    state, bundle, pid, cgroup, host = live_container(ENV)
    monkeypatch.setattr(apply, "_setattr_works", None)
    if kernel == "before 5.12":
        real = _linux.mount_setattr

        def missing(fd, attr_set, recursive=True, *args):
            if recursive:  # the ldconfig sandbox's view (which needs 5.12 anyway): left as it is
                return real(fd, attr_set, recursive, *args)
            raise OSError(errno.ENOSYS, "mount_setattr: Function not implemented")

        monkeypatch.setattr(_linux, "mount_setattr", missing)
    result = hookcheck.run_hook_in_process(f"{host['root']}/config.yaml", state, capsys)
    assert result.returncode == 0, result.stderr
    assert apply._setattr_works is (kernel == "mount_setattr")
    mounts = mounts_under(pid, os.path.realpath(os.path.join(bundle, "rootfs")))
    options, tags = mounts["/dev/nvidia0"]
    assert {"ro", "nosuid", "noexec"} <= options and "nodev" not in options and tags == [], mounts["/dev/nvidia0"]
    library = next(path for path in mounts if os.path.basename(path).startswith("libnvidia-ml.so"))
    options, tags = mounts[library]
    assert {"ro", "nosuid", "nodev"} <= options and "noexec" not in options and tags == [], mounts[library]
