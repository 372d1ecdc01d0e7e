"""start/linux/ldconfig.py's Helper, the sandbox made ahead by a start server's warm spare: what
it is while it waits, that it dies with whoever holds it, and that a start whose helper is not
ready, is gone or fails falls back to the hook's own fork and still gets its cache. What ldconfig
can reach once a helper has started it: tests/security/test_ldconfig_sandbox.py, run through
both paths. A served start that uses one: tests/start/test_server.py."""

from __future__ import annotations

import ast
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


@pytest.fixture
def empty_namespace(image):
    """The empty mount namespace a start server holds (ldconfig._empty), held by this process."""
    try:
        assert ldconfig.hold_empty_namespace() and ldconfig._empty is not None
        yield ldconfig._empty
    finally:
        if ldconfig._empty is not None:
            os.close(ldconfig._empty)
            ldconfig._empty = None


def root_listing_in(namespace: int) -> dict:
    """{directory: its entries} for / and VIEW_MOUNT_POINT, as seen from inside the namespace
    (a child joins it: /proc is not there to read its mount table from)."""
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            ldconfig._linux.setns(namespace, ldconfig._linux.CLONE_NEWNS)
            seen = {d: sorted(os.listdir(d)) for d in ("/", ldconfig.VIEW_MOUNT_POINT)}
            os.write(writer, repr(seen).encode())
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as f:
        said = f.read()
    os.waitpid(child, 0)
    return ast.literal_eval(said)


def test_a_servers_empty_namespace_is_empty_and_stays_so(empty_namespace, image):
    """What hold_empty_namespace makes: a mount namespace other than ours, close-on-exec, with
    nothing in it but VIEW_MOUNT_POINT; and after sandboxes have been made from it, still nothing
    there (each sandbox mounts its view in a copy of its own, never in the shared one)."""
    assert os.readlink(f"/proc/self/fd/{empty_namespace}") != os.readlink("/proc/self/ns/mnt")
    assert os.readlink(f"/proc/self/fd/{empty_namespace}").startswith("mnt:")
    assert not os.get_inheritable(empty_namespace)
    empty = {"/": ["view"], ldconfig.VIEW_MOUNT_POINT: []}
    assert root_listing_in(empty_namespace) == empty
    for _ in range(2):
        sandbox = ldconfig.Sandbox(image.fd, "/opt/lib\n", [], timeout=20)
        assert not sandbox.via_helper
        assert "/opt/lib/libc.so.6" in indexed(sandbox.result())
    assert root_listing_in(empty_namespace) == empty
    held = ldconfig._empty
    assert ldconfig.hold_empty_namespace() and ldconfig._empty == held  # once


def test_a_fork_builds_its_view_in_the_held_namespace(image, monkeypatch):
    """The route is taken whenever a namespace is held: given one that is not empty (ours, which
    has no VIEW_MOUNT_POINT), the start fails where only that route looks for it."""
    ours = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    assert not os.path.exists(ldconfig.VIEW_MOUNT_POINT)  # this host's root has none
    monkeypatch.setattr(ldconfig, "_empty", ours)
    with open("/proc/self/mountinfo") as f:
        before = f.read()
    try:
        with pytest.raises(ldconfig.LdconfigError, match="No such file or directory"):
            ldconfig.Sandbox(image.fd, "/opt/lib\n", [], timeout=20).result()
    finally:
        os.close(ours)
    with open("/proc/self/mountinfo") as f:
        assert f.read() == before  # it failed in a copy of its own: the namespace it joined is as it was


def test_a_held_namespace_that_cannot_be_joined_leaves_the_fork_as_it_was(image, monkeypatch):
    """Not a namespace at all (setns refuses it): the fork copies the container's table, as
    without one, and the start gets its cache."""
    null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    monkeypatch.setattr(ldconfig, "_empty", null)
    try:
        assert "/opt/lib/libc.so.6" in indexed(ldconfig.Sandbox(image.fd, "/opt/lib\n", [], timeout=20).result())
    finally:
        os.close(null)


@pytest.mark.parametrize("fault", ["hangs", "fails"])
def test_a_server_whose_empty_namespace_cannot_be_made_holds_none(image, monkeypatch, fault):
    """The child that makes it hangs (killed after the timeout) or fails: none is held, the
    server goes on (its sandboxes copy), and the child is reaped. Only the child's work is
    replaced, in the child: no real fault here makes a mount namespace hang or fail."""
    import time

    def hang():
        time.sleep(600)

    def fail():
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(ldconfig, "_empty_mount_namespace", hang if fault == "hangs" else fail)
    children = startservercheck.children(os.getpid())
    began = time.monotonic()
    assert ldconfig.hold_empty_namespace(timeout=0.5) is False
    assert ldconfig._empty is None
    # Not a measure of speed: the wait ended at its timeout, not at the hanging child's end (600 s).
    assert time.monotonic() - began < 300
    assert startservercheck.children(os.getpid()) == children  # the child killed and reaped
