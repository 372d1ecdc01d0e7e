"""start/linux/ldconfig.py's Helper, the sandbox made ahead by a start server's warm spare: what
it is while it waits, that it dies with whoever holds it, and that a start whose helper is not
ready, is gone or fails falls back to the hook's own fork and still gets its cache. What ldconfig
can reach once a helper has started it: tests/security/test_ldconfig_sandbox.py, run through
both paths. A served start that uses one: tests/start/test_server.py."""

from __future__ import annotations

import os
import shutil
import signal
import socket

import pytest
import startservercheck

from oci_gpu_hook.start import ldcache
from oci_gpu_hook.start.linux import ldconfig, scm_rights
from oci_gpu_hook.start.linux.rootfs import Rootfs
from oci_gpu_hook.toolkit import containers


@pytest.fixture
def image(tmp_path, require):
    """A rootfs (Rootfs) with one library, in a directory its ld.so.conf names; root is needed."""
    require("root")
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "opt/lib").mkdir(parents=True)
    shutil.copy(os.path.realpath(containers._host_libc()), root / "opt/lib/libc.so.6")  # for ldconfig to index
    rootfs = Rootfs(str(root))
    try:
        yield rootfs
    finally:
        ldconfig.drop_helper()
        rootfs.close()


def held_helper() -> ldconfig.Helper:
    ldconfig.hold_helper()
    helper = ldconfig._held
    assert helper is not None and helper.pid is not None
    return helper


def ready_helper() -> ldconfig.Helper:
    helper = held_helper()
    startservercheck.wait_until("the helper ready", helper.usable, timeout=30)
    return helper


def indexed(data: bytes) -> list:
    return [entry.path for entry in ldcache.parse(data, "the new cache")]


def status_of(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)


def test_a_waiting_helper_is_alone_and_holds_nothing_of_its_holders(image, tmp_path):
    """pid 1 of its own PID namespace, with network, IPC and UTS namespaces of its own, a mount
    namespace of its own whose one mount is an empty tmpfs (the host's tree detached at idle), an
    empty environment, an isolated interpreter, and of its holder's descriptors only its socket:
    not even one its holder let be inherited."""
    careless = os.open(tmp_path / "inheritable", os.O_WRONLY | os.O_CREAT)
    os.set_inheritable(careless, True)
    try:
        helper = ready_helper()
    finally:
        os.close(careless)
    assert status_of(helper.pid)["NSpid"].split() == [str(helper.pid), "1"]
    with open(f"/proc/{helper.pid}/mountinfo") as f:
        (mount,) = f.read().splitlines()
    assert mount.split()[4] == "/" and " - tmpfs " in mount, mount
    for kind in ("pid_for_children", "net", "ipc", "uts", "mnt"):
        assert os.readlink(f"/proc/{helper.pid}/ns/{kind}") != os.readlink(f"/proc/self/ns/{kind}"), kind
    with open(f"/proc/{helper.pid}/environ", "rb") as f:
        assert f.read() == b""
    with open(f"/proc/{helper.pid}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[1:3] == [b"-I", b"-S"]
    held = {os.readlink(f"/proc/{helper.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{helper.pid}/fd")}
    assert str(tmp_path / "inheritable") not in held, held
    assert sum(target.startswith("socket:") for target in held) == 1, held


def test_a_helper_starts_ldconfig_once_and_is_reaped_by_the_sandbox(image):
    helper = ready_helper()
    pid = helper.pid
    sandbox = ldconfig.Sandbox(image.fd, "/opt/lib\n", [], timeout=20)
    assert sandbox.via_helper and sandbox.pid == pid and ldconfig._held is None
    assert "/opt/lib/libc.so.6" in indexed(sandbox.result())
    assert startservercheck.process_state(pid) == ""  # reaped by result(): no zombie
    again = ldconfig.Sandbox(image.fd, "/opt/lib\n", [], timeout=20)  # none held now: a fork of our own
    assert not again.via_helper
    assert "/opt/lib/libc.so.6" in indexed(again.result())


@pytest.mark.parametrize("fault", ["not-ready", "killed"])
def test_a_helper_not_ready_or_gone_is_killed_and_the_start_forks_its_own(image, fault):
    """Stopped before it could say it is ready (a spare taken at once), or killed while it
    waited: the Sandbox starts ldconfig itself and kills the helper at once (one still starting
    takes no more CPU from the start); it is reaped as its holder exits (drop_helper)."""
    helper = held_helper() if fault == "not-ready" else ready_helper()
    pid = helper.pid
    if fault == "not-ready":
        os.kill(pid, signal.SIGSTOP)
        helper.ready = False  # whatever it managed to say before the stop is not read
        helper.channel.setblocking(False)
        try:
            helper.channel.recv(16)
        except BlockingIOError:
            pass
    else:
        os.kill(pid, signal.SIGKILL)
        startservercheck.wait_until("the helper dead", lambda: startservercheck.process_state(pid) == "Z")
    sandbox = ldconfig.Sandbox(image.fd, "/opt/lib\n", [], timeout=20)
    assert not sandbox.via_helper
    assert "/opt/lib/libc.so.6" in indexed(sandbox.result())
    assert ldconfig._held is helper and helper.killed  # not used, and not waited for on the start's path
    startservercheck.wait_until("the helper dead", lambda: startservercheck.process_state(pid) == "Z")
    ldconfig.drop_helper()
    assert startservercheck.process_state(pid) == ""


class _HelperThatFails:
    """Stands in for a Helper whose process could not build the view (a refused setns, say: no
    real fault here makes one fail where the fork would not): it says so, as helper_main does."""

    def start(self, exe, argv, rootfs_fd, out):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write_fd, ldconfig.HELPER_FAILED + b"setns: Operation not permitted\n")
            os._exit(127)
        os.close(write_fd)
        return pid, read_fd


def test_a_helper_that_cannot_start_ldconfig_leaves_it_to_a_fork(image, monkeypatch):
    monkeypatch.setattr(ldconfig, "_held", _HelperThatFails())
    sandbox = ldconfig.Sandbox(image.fd, "/opt/lib\n", [], timeout=20)
    assert sandbox.via_helper
    data = sandbox.result()
    assert not sandbox.via_helper  # the retry's: what the record then says
    assert "/opt/lib/libc.so.6" in indexed(data)
    assert sandbox.out is None and sandbox.exe is None  # nothing of either attempt kept


@pytest.mark.parametrize("how", ["its-socket-closed", "its-holder-killed"])
def test_a_helper_dies_with_its_holder(image, how):
    """Its holder closes its end (a spare that exits): the helper exits on its own. Its holder is
    killed while this test keeps a copy of the holder's end open, so that the socket never ends:
    the parent-death signal alone must kill it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    holder = os.fork()
    if holder == 0:
        try:
            ours.close()
            helper = ready_helper()
            socket.send_fds(theirs, [helper.pid.to_bytes(4, "little")], [helper.channel.fileno()])
            if how == "its-socket-closed":
                helper.channel.close()
                _, status = os.waitpid(helper.pid, 0)
                os._exit(os.waitstatus_to_exitcode(status))
            signal.pause()
        finally:
            os._exit(1)
    theirs.close()
    message, fds, _ = scm_rights.receive(ours, 4, 1)
    ours.close()
    pid = int.from_bytes(message, "little")
    assert len(fds) == 1 and pid > 0
    holders_end = fds[0]  # a copy of the holder's end of the helper's socket
    try:
        if how == "its-socket-closed":
            os.close(holders_end)  # ours would keep the socket open
            holders_end = None
        else:
            os.kill(holder, signal.SIGKILL)
        _, status = os.waitpid(holder, 0)
        if how == "its-socket-closed":
            assert os.waitstatus_to_exitcode(status) == 127  # the helper's own exit, seen by its holder
        else:
            # Reparented to this namespace's init: gone, or a zombie there if that init never reaps.
            # Its socket is still open (holders_end): only the signal can have ended it.
            state = startservercheck.process_state
            startservercheck.wait_until("the orphaned helper dead", lambda: state(pid) in ("", "Z"))
    finally:
        if holders_end is not None:
            os.close(holders_end)


def test_a_child_whose_way_back_to_our_pid_namespace_fails_is_killed_and_reaped(image, monkeypatch):
    """The sandbox's and the helper's one way to be pid 1 of a namespace (_as_pid_one): if the
    setns back to our own PID namespace fails after the child is made, the child is not left
    running, nor as a zombie, and the failure is raised. No real fault makes that setns fail
    here: it alone is made to."""
    real_setns, made = ldconfig._linux.setns, []

    def refused(fd, nstype):
        if nstype == ldconfig._linux.CLONE_NEWPID and made:
            real_setns(fd, nstype)  # back for real (this test's later children), then said to fail
            raise PermissionError(1, "Operation not permitted")
        return real_setns(fd, nstype)

    def start():
        made.append(os.posix_spawn("/bin/sleep", ["sleep", "60"], {}))
        return made[-1]

    monkeypatch.setattr(ldconfig._linux, "setns", refused)
    with pytest.raises(PermissionError):
        ldconfig._as_pid_one(start)
    assert startservercheck.process_state(made[0]) == ""
    assert os.readlink("/proc/self/ns/pid_for_children") == os.readlink("/proc/self/ns/pid")
