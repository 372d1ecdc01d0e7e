"""Refresh a container's ld.so.cache with the host's ldconfig, in a sandbox that holds even if
ldconfig itself is compromised (it parses image ELF files and configuration).

- What runs: the host's ldconfig, executed from a descriptor opened on the host, and only if it
  is static (no program interpreter, so no loader is ever looked up in the image) and owned by
  root. Never a binary from the image.
- What it sees: a private mount namespace whose root (pivot_root, the old root detached) is a
  clone of the container's rootfs with all its mounts, made read-only, nodev, nosuid and noexec,
  recursively. Nothing in the image can be written and no device node the image ships can be
  opened; nothing of the host is left to reach. /etc in that view is a fresh, private tmpfs that
  holds only the configuration the hook flattened from the image's ld.so.conf (read through
  descriptors, regular files only) and receives the new cache.
- Who it runs as: uid and gid 65534 with no supplementary groups, an empty capability bounding
  set and no capabilities, no_new_privs, its own PID, IPC, UTS and network namespaces, resource
  limits, an empty environment and no descriptors but stdio. Under SELinux, in the caller's own
  domain, asked for before the exec (no refused transition to ldconfig_t, no denial logged).
- The hook then reads the cache from its tmpfs (a regular file, bounded) and installs it into the
  rootfs by rename through the /etc descriptor, undoably: no existing file is ever opened or
  written there, so a device node, FIFO or hard link at /etc/ld.so.cache or beside it is replaced,
  never written through.
"""

from __future__ import annotations

import _signal as signal  # signal without its enum wrappers: 4.6 ms less per cold start (docs/performance.md)
import errno
import os
import resource
import stat
import sys
import time

from oci_gpu_hook.errors import Exit, HookError
from oci_gpu_hook.start.budget import no_deadline_between
from oci_gpu_hook.start.linux import _linux, userns
from oci_gpu_hook.start.linux.rootfs import ForeignMount
from oci_gpu_hook.start.linux.sources import HostSources, UntrustedSource

LDCONFIG_PATHS = ("/sbin/ldconfig", "/usr/sbin/ldconfig")
SANDBOX_ID = 65534  # nobody: owns nothing in the view but the output tmpfs
LIMITS = {
    resource.RLIMIT_CPU: 20,
    resource.RLIMIT_AS: 1 << 30,
    resource.RLIMIT_FSIZE: 64 << 20,
    resource.RLIMIT_NOFILE: 256,
    resource.RLIMIT_CORE: 0,
}
MAX_CACHE_BYTES = 64 << 20
MAX_ERROR_BYTES = 4096  # of ldconfig's stderr, its end: what a failure's line is taken from
MAX_CONF_BYTES = 64 << 10
MAX_CONF_FILES = 128
MAX_LISTED = 4096  # directory entries looked at per include pattern
CACHE_MAGICS = (b"glibc-ld.so.cache", b"ld.so-1.7.0")
_NAMESPACES = _linux.CLONE_NEWIPC | _linux.CLONE_NEWUTS | _linux.CLONE_NEWNET  # and a mount namespace, last
_VIEW_ATTRS = _linux.MOUNT_ATTR_RDONLY | _linux.MOUNT_ATTR_NOSUID | _linux.MOUNT_ATTR_NODEV | _linux.MOUNT_ATTR_NOEXEC


class LdconfigError(HookError):
    exit_code = Exit.LDCONFIG


# --- the host's ldconfig ---------------------------------------------------------------------


def host_ldconfig() -> str:
    for path in LDCONFIG_PATHS:
        if os.access(path, os.X_OK):
            return path
    raise LdconfigError("the host has no ldconfig (/sbin/ldconfig); it is needed to refresh the container's ld cache")


def _open_ldconfig(sources: HostSources | None = None) -> int:
    """O_PATH descriptor of the host's ldconfig, opened as mount sources are (root's, in
    directories only root can change, writable by nobody else), and static. sources: the
    caller's HostSources, whose directories are already checked (else a walk of its own)."""
    path = host_ldconfig()
    opener = sources or HostSources()
    try:
        fd = opener.open(path, "file")
    except UntrustedSource as e:
        raise LdconfigError(f"{e}: refusing to run it") from None
    finally:
        if sources is None:
            opener.close()
    try:
        with open(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC), "rb") as f:
            head = f.read(4096)
        if _has_interpreter(head):
            # A dynamic ldconfig would have its loader and libc looked up inside the image's root.
            raise LdconfigError(f"{path} is dynamically linked; the hook runs only a static ldconfig")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _has_interpreter(head: bytes) -> bool:
    """Whether an ELF file (its first bytes) has a PT_INTERP program header."""
    if head[:4] != b"\x7fELF" or len(head) < 64:
        return True  # not ELF as we know it: treat as unsafe
    wide, order = head[4] == 2, "little" if head[5] == 1 else "big"

    def number(offset: int, size: int) -> int:
        return int.from_bytes(head[offset : offset + size], order)

    phoff, phentsize, phnum = (number(32, 8), number(54, 2), number(56, 2)) if wide else (
        number(28, 4), number(42, 2), number(44, 2))  # fmt: skip
    if phoff + phentsize * phnum > len(head):
        return True
    return any(number(phoff + i * phentsize, 4) == 3 for i in range(phnum))  # PT_INTERP


# --- the image's configuration, flattened by the hook ------------------------------------------


def _char_class(pattern: str, at: int):
    """(members test, index after it) of a '[...]' at pattern[at], or None if it is not one."""
    start = at + 1
    negate = pattern[start : start + 1] in ("!", "^")
    start += negate
    end = pattern.find("]", start + 1)  # a ']' right after '[' or '[!' is a member, not the end
    if end < 0:
        return None
    body = pattern[start:end]
    ranges = [(body[i], body[i + 2]) for i in range(len(body) - 2) if body[i + 1] == "-"]

    def member(c: str) -> bool:
        return (c in body or any(low <= c <= high for low, high in ranges)) != negate

    return member, end + 1


def _matches(name: str, pattern: str) -> bool:
    """Shell-style match of one file name ('*', '?', '[...]'), as glob(3) does for includes.
    Iterative, remembering only the last '*': linear in practice and never deep, whatever
    pattern the image writes."""
    n = p = 0
    star = retry = -1
    while n < len(name):
        token = pattern[p : p + 1]
        if token == "*":
            star, retry, p = p + 1, n, p + 1
            continue
        step = None
        if token == "?":
            step = p + 1
        elif token == "[":
            parsed = _char_class(pattern, p)
            if parsed is not None:
                member, after = parsed
                step = after if member(name[n]) else None
            elif name[n] == "[":
                step = p + 1
        elif token and token == name[n]:
            step = p + 1
        if step is not None:
            n, p = n + 1, step
        elif star >= 0:
            retry += 1
            n, p = retry, star
        else:
            return False
    return pattern[p:].strip("*") == ""


class _ConfReader:
    """Reads /etc/ld.so.conf and its includes through the rootfs's descriptors: only regular
    files with one link are opened (no device, FIFO or planted hard link), and the lines that
    name directories are kept verbatim for ldconfig to parse as it always does."""

    def __init__(self, rootfs):
        self.rootfs = rootfs
        self.lines: list[str] = []
        self.notes: list[str] = []
        self.files = 0

    def _one_more(self) -> bool:
        """Count a file read or a directory listed; False past the limit (an include loop, or a
        flood), which is said once."""
        self.files += 1
        if self.files == MAX_CONF_FILES + 1:
            self.notes.append(f"the image's ld.so.conf includes over {MAX_CONF_FILES} files; the rest ignored")
        return self.files <= MAX_CONF_FILES

    def read(self, path: str) -> None:
        if not self._one_more():
            return
        text = self._text(path)
        for raw in text.split("\n"):  # as ldconfig reads it: splitlines() would also break at \x1c, \x85
            line = raw.split("#", 1)[0].strip()
            word = line.split(None, 1)[0] if line else ""
            if word == "include" and line[7:8] in (" ", "\t"):
                for pattern in line[8:].split():
                    self._include(pattern if pattern.startswith("/") else f"{os.path.dirname(path)}/{pattern}")
            elif line and not (word == "hwcap" and line[5:6] in (" ", "\t")):
                self.lines.append(line)

    def _text(self, path: str) -> str:
        try:
            fd = self.rootfs.open(path)
        except OSError:
            return ""  # absent (or a dangling link): ldconfig treats it the same way
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                self.notes.append(f"{path} in the image ignored: not a regular file with one link")
                return ""
            with open(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
                # Its lines are names of directories and files, bytes: decoded as the os module
                # decodes names, so that one that is not UTF-8 is opened (an include) and handed
                # to ldconfig (Sandbox: os.fsencode) as the very bytes the image wrote.
                return os.fsdecode(f.read(MAX_CONF_BYTES))
        finally:
            os.close(fd)

    def _include(self, pattern: str) -> None:
        directory, name = os.path.split(pattern)
        if not any(c in name for c in "*?["):
            self.read(pattern)
            return
        if not self._one_more():
            return
        try:
            fd = self.rootfs.open(directory or "/", os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        try:
            entries = os.listdir(fd)[:MAX_LISTED]
            names = sorted(n for n in entries if _matches(n, name) and not n.startswith("."))
        finally:
            os.close(fd)
        for found in names:
            self.read(f"{directory}/{found}")


def flatten_conf(rootfs) -> tuple[str, list[str]]:
    """(ld.so.conf text without includes, notes) for the image open as rootfs."""
    reader = _ConfReader(rootfs)
    reader.read("/etc/ld.so.conf")
    return "".join(line + "\n" for line in reader.lines), reader.notes


# --- the sandbox -------------------------------------------------------------------------------


class Sandbox:
    """The host's ldconfig running in the sandbox over the rootfs open at rootfs_fd, started at
    construction: the caller may do other work (mount what ldconfig does not read) and collect
    the cache with result(), or stop it with cancel() (idempotent; after result() too).

    fork and execve by hand rather than subprocess: the hook already runs in a single-threaded
    child, and subprocess (with locale and re) would cost a cold start 11 ms of imports
    (docs/performance.md)."""

    def __init__(self, rootfs_fd: int, conf: str, directories, timeout: float = 20.0, sources=None):
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.pid = None
        self.out = None
        self.errors = None
        self.via_helper = False
        self.exe = _open_ldconfig(sources)
        try:
            self.conf, self.rootfs_fd = conf, rootfs_fd  # the caller's, open until result(): for a retry
            self.argv = ["ldconfig", "-X", "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache", *directories]
            self._start(rootfs_fd, through_helper=True)
        except BaseException:
            self.cancel()  # ldconfig too, if it was started (the deadline, delivered as _start ends)
            raise

    def _start(self, rootfs_fd: int, through_helper: bool) -> None:
        """A fresh output tmpfs with the configuration in it, and ldconfig started over it by the
        Helper this process holds (through_helper) or, where there is none or it is not ready, by
        a fork of our own."""
        try:
            self.out = _linux.fsmount_new(
                "tmpfs",
                {"mode": "0700", "uid": str(SANDBOX_ID), "gid": str(SANDBOX_ID), "size": str(MAX_CACHE_BYTES * 2),
                 "nr_inodes": "16"},
                _linux.MOUNT_ATTR_NOSUID | _linux.MOUNT_ATTR_NODEV | _linux.MOUNT_ATTR_NOEXEC,
            )  # fmt: skip
        except OSError as e:
            needs = " (it needs Linux 5.12 or newer)" if e.errno == errno.ENOSYS else ""
            raise LdconfigError(f"cannot make the ldconfig sandbox{needs}: {e.strerror}") from None
        conf_fd = os.open("ld.so.conf", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644, dir_fd=self.out)
        with os.fdopen(conf_fd, "wb") as f:
            f.write(os.fsencode(self.conf))  # the image's bytes again (_ConfReader._text)
        with no_deadline_between():  # started and owned as one: cut between, ldconfig would be no one's
            started = _start_through_helper(self.exe, self.argv, rootfs_fd, self.out) if through_helper else None
            self.via_helper = started is not None
            self.pid, self.errors = started or _start_sandboxed(self.exe, self.argv, rootfs_fd, self.out)

    def result(self) -> bytes:
        """Wait for ldconfig (killing it past the timeout) and return the cache it wrote."""
        try:
            code, errors = self._wait()
            if self.via_helper and code == 127 and (errors.startswith(HELPER_FAILED) or not errors):
                # The helper could not start ldconfig: it said why, or it said nothing (a message
                # it did not understand: a helper of newer code, spawned from the disk just before
                # an upgrade's code watch retired its spare). Once more, as without a helper. (An
                # ldconfig that fakes this gains one more run in the same sandbox, nothing else.)
                self._release(keep_exe=True)
                self._start(self.rootfs_fd, through_helper=False)
                code, errors = self._wait()
            if code != 0:
                lines = errors.decode("utf-8", "replace").strip().splitlines()
                raise LdconfigError(f"ldconfig failed: {lines[-1] if lines else f'exit status {code}'}")
            return _read_cache(self.out)
        finally:
            self.cancel()

    def _wait(self):
        """(exit status, stderr) of ldconfig; LdconfigError past the deadline (result() then
        kills it). poll() on its stderr wakes us the moment it exits (the pipe closes), with no
        sleeping loop."""
        import select

        tail = b""  # only the end is kept: a compromised ldconfig may write without end
        poller = select.poll()
        poller.register(self.errors, select.POLLIN | select.POLLHUP)
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise LdconfigError(f"ldconfig did not finish within {self.timeout:.0f} s")
            if not poller.poll(left * 1000):
                continue
            chunk = os.read(self.errors, 1 << 16)
            if not chunk:  # the child's end closed: it has exited (or exec failed and it is exiting)
                break
            tail = (tail + chunk)[-MAX_ERROR_BYTES:]
        with no_deadline_between():  # reaped and forgotten as one: cancel() kills only ours
            _, status = os.waitpid(self.pid, 0)
            self.pid = None
        return os.waitstatus_to_exitcode(status), tail

    def cancel(self) -> None:
        if self.pid is not None:
            pid, self.pid = self.pid, None
            os.kill(pid, signal.SIGKILL)  # pid 1 of its namespace: whatever it started dies with it
            os.waitpid(pid, 0)
        self._release()

    def _release(self, keep_exe: bool = False) -> None:
        for name in ("out", "errors") if keep_exe else ("exe", "out", "errors"):
            fd = getattr(self, name, None)
            if fd is not None:
                setattr(self, name, None)
                os.close(fd)


def _start_sandboxed(exe: int, argv, rootfs_fd: int, out: int):
    """(pid, read end of its stderr) of the sandboxed ldconfig, started."""
    read_fd, write_fd = os.pipe()
    if userns.unprivileged():
        try:
            return _start_in_middle(exe, argv, rootfs_fd, out, write_fd), read_fd
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)

    def fork() -> int:
        pid = os.fork()
        if pid == 0:
            try:
                _sandbox_child(exe, argv, rootfs_fd, out, write_fd)
            except BaseException as e:
                os.write(write_fd, f"cannot start ldconfig: {e}\n".encode())
            finally:
                os._exit(127)
        return pid

    try:
        return _as_pid_one(fork), read_fd
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)


def _as_pid_one(start) -> int:
    """The pid of the child that start() makes (a fork or a spawn; it returns the pid), made pid 1
    of a new PID namespace: it can neither see nor signal anything else, and whatever it leaves
    running dies with it. Only the child goes there: our own PID namespace, for our later
    children, is restored right after; a child whose way back failed is killed and reaped."""
    own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _linux.unshare(_linux.CLONE_NEWPID)
        pid = None
        try:
            pid = start()
        finally:
            try:
                _linux.setns(own_pid_ns, _linux.CLONE_NEWPID)
            except BaseException:
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                raise
    finally:
        os.close(own_pid_ns)
    return pid


def _start_in_middle(exe: int, argv, rootfs_fd: int, out: int, write_fd: int) -> int:
    """The sandbox for a hook in a user namespace (rootless podman), which may unshare a PID
    namespace but not setns back into its own (the host's owns it): a middle process unshares
    and forks ldconfig as pid 1 there, then relays its exit status. Killing the middle (cancel())
    kills ldconfig too: its parent-death signal, set after its last change of credentials."""
    pid = os.fork()
    if pid != 0:
        return pid
    code = 127
    try:
        _linux.unshare(_linux.CLONE_NEWPID)
        child = os.fork()
        if child == 0:
            try:
                _sandbox_child(exe, argv, rootfs_fd, out, write_fd, orphan_signal=signal.SIGKILL)
            except BaseException as e:
                os.write(write_fd, f"cannot start ldconfig: {e}\n".encode())
            finally:
                os._exit(127)
        os.close(write_fd)  # the caller sees the end of ldconfig's stderr as its exit
        _, status = os.waitpid(child, 0)
        code = os.waitstatus_to_exitcode(status)
        code = code if code >= 0 else 128 - code
    except BaseException as e:
        try:
            os.write(write_fd, f"cannot start ldconfig: {e}\n".encode())
        except OSError:
            pass
    finally:
        os._exit(code)


def _stay_in_own_domain() -> None:
    """Under SELinux, have the coming exec keep the caller's own domain (setexeccon to it).

    The base policy has a default transition to ldconfig_t for ldconfig, and the sandbox runs it
    with no_new_privs: the kernel refuses that transition (process2 nnp_transition) and runs it in
    the caller's domain anyway, logging a denial and a SELINUX_ERR on every GPU container start.
    Asking for the caller's own domain is the same outcome, said up front: no transition is
    computed, nothing is refused, nothing is logged, and no policy module is needed (the runtimes'
    domains may setexec; ldconfig_t could not read the image's files anyway). Best effort: where
    the write is refused, the kernel falls back as before."""
    if not os.path.exists("/sys/fs/selinux/enforce"):  # SELinux is not the running LSM
        return
    try:
        with open("/proc/thread-self/attr/current", "rb", buffering=0) as f:
            own = f.read(4096).rstrip(b"\0\n")
        if own and own != b"kernel":
            # O_WRONLY alone, as libselinux's setexeccon: open()'s "wb" adds O_CREAT, which SELinux
            # checks as a file create in the domain's /proc entry, and denies.
            fd = os.open("/proc/thread-self/attr/exec", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, own)
            finally:
                os.close(fd)
    except OSError:
        pass


def _sandbox_child(exe: int, argv, rootfs_fd: int, out: int, err_fd: int, orphan_signal: int = 0) -> None:
    """In the forked child: build the view, enter it, drop everything, exec. Never returns.
    orphan_signal: sent to ldconfig when its parent exits (_start_in_middle)."""
    null = os.open("/dev/null", os.O_RDWR)  # before the host disappears from view
    _stay_in_own_domain()  # while the host's /proc and /sys are in view
    _linux.unshare(_NAMESPACES)
    if _empty is not None:
        view = None
        try:
            view = _linux.open_tree(rootfs_fd, "", _VIEW_CLONE)
            _linux.setns(_empty, _linux.CLONE_NEWNS)
        except OSError:
            # An unbindable rootfs (EINVAL; EPERM if also locked), or not a namespace we may join:
            # as without one, by the copy (which keeps unbindable mounts, made private below).
            if view is not None:
                os.close(view)
        else:
            _linux.unshare(_linux.CLONE_NEWNS)  # a copy of its one mount, this child's own to change
            _attach_view(view)
            _enter_view_and_exec(view, exe, argv, out, err_fd, null, orphan_signal)
    os.fchdir(rootfs_fd)  # unshare moves the cwd into the new namespace's copy: no path walked again
    _linux.unshare(_linux.CLONE_NEWNS)
    _linux.mount(None, "/", None, _linux.MS_REC | _linux.MS_PRIVATE)
    clone = _linux.OPEN_TREE_CLONE | _linux.OPEN_TREE_CLOEXEC | _linux.AT_RECURSIVE
    view = _linux.open_tree(_linux.AT_FDCWD, ".", clone)
    _linux.mount_setattr(view, _VIEW_ATTRS)
    _linux.move_mount(view, "", _linux.AT_FDCWD, ".", _linux.MOVE_MOUNT_F_EMPTY_PATH)
    _enter_view_and_exec(view, exe, argv, out, err_fd, null, orphan_signal)


def _enter_view_and_exec(view: int, exe: int, argv, out: int, err_fd: int, null: int, orphan_signal: int = 0):
    """With the view attached in this process's own private mount namespace: its /etc on the
    output tmpfs, the view made the root (the old one detached), everything dropped, ldconfig
    exec'd. The end of _sandbox_child and of a Helper's start alike. Never returns."""
    # /etc of the view, resolved inside it (never through a magic link), gets the private tmpfs.
    etc = _linux.openat2(view, "etc", os.O_PATH | os.O_DIRECTORY, _linux.RESOLVE_IN_ROOT | _linux.RESOLVE_NO_MAGICLINKS)
    _linux.move_mount(out, "", etc, "", _linux.MOVE_MOUNT_F_EMPTY_PATH | _linux.MOVE_MOUNT_T_EMPTY_PATH)
    os.fchdir(view)
    _linux.pivot_root(".", ".")
    _linux.umount2(".", _linux.MNT_DETACH)  # the old root (the host's, or an empty tmpfs) is gone
    os.chdir("/")
    for limit, value in LIMITS.items():
        resource.setrlimit(limit, (value, value))
    os.setgroups([])
    os.setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
    _linux.drop_bounding_set()
    _linux.set_no_new_privs()
    os.setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)  # clears every capability
    if orphan_signal:
        _linux.set_parent_death_signal(orphan_signal)  # after setresuid, which clears it
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.dup2(err_fd, 2)
    os.closerange(3, exe)
    os.closerange(exe + 1, 1 << 16)
    # What exec keeps: the mask (the deadline's SIGALRM is held back while the start is handed
    # over) and ignored signals (Python ignores SIGPIPE and SIGXFSZ). ldconfig gets neither.
    for ignored in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(ignored, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    os.execve(exe, argv, {})


# --- the sandbox made ahead: a helper -----------------------------------------------------------

HELPER_READY = b"ready"
HELPER_FAILED = b"the ldconfig helper could not start it: "  # what a helper writes that could not exec
HELPER_FDS = 5  # the mount namespace, the rootfs, the output tmpfs, ldconfig, the stderr pipe
MAX_HELPER_MESSAGE = 1 << 20
_held = None  # the Helper this process holds for its next Sandbox (a start server's spare)


class Helper:
    """A process that holds the first half of ldconfig's sandbox ready, made while a start
    server's spare worker is idle: a small interpreter exec'd as pid 1 of its own PID namespace,
    which makes its network, IPC and UTS namespaces, says it is ready and waits on a socket pair
    that only this process holds. A start hands it the mount namespace, rootfs, output tmpfs,
    ldconfig and a stderr pipe; it then does what the worker's own fork would (_enter_view_and_exec).

    Why: the worker is a large process; forking it on the start's path costs its page tables and
    then a copy of every page either side writes (docs/performance.md, "The ldconfig helper").
    The helper is one use, a child of the process that made it, and dies with it (its parent-death
    signal, and the end of its socket)."""

    def __init__(self, nice: int | None = None):
        import socket

        self.pid = self.channel = None
        self.killed = False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The package the helper imports is the one this process runs, found where it was found,
        # after the standard library (nothing beside the package shadows it). -I -S: no
        # environment, no user or site directories, no current directory in the path.
        top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        code = (f"import sys; sys.path[:] = [*(p for p in sys.path if p), {top!r}]; "
                f"from oci_gpu_hook.start.linux import ldconfig; ldconfig.helper_main(3, {nice!r})")  # fmt: skip
        try:
            self.pid = _as_pid_one(
                lambda: os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", "-c", code], {},
                                       file_actions=[(os.POSIX_SPAWN_DUP2, theirs.fileno(), 3)])
            )  # fmt: skip
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.channel = ours
        self.ready = self.killed = False

    def usable(self) -> bool:
        """Whether it has said it is ready, and nothing else since (a helper that died, or said
        anything more, is not used). Never waits."""
        import socket

        try:
            if not self.ready:
                self.ready = self.channel.recv(16, socket.MSG_DONTWAIT) == HELPER_READY
                if not self.ready:
                    return False
            self.channel.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK)
            return False  # anything to read now (its end closed: b"") means it is no longer waiting
        except BlockingIOError:
            return self.ready
        except OSError:
            return False

    def start(self, exe: int, argv, rootfs_fd: int, out: int):
        """(pid, read end of its stderr) of ldconfig started by the helper in this process's
        mount namespace; None if the helper could not be handed the start: it is then killed
        at once (a helper still starting takes no more CPU from the start) and reaped by stop(),
        once the start is over."""
        import array
        import socket

        if self.pid is None or self.killed or not self.usable():
            self._kill()
            return None
        read_fd, write_fd = os.pipe()
        try:
            mntns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            try:
                fds = array.array("i", [mntns, rootfs_fd, out, exe, write_fd])
                message = b"\0".join(os.fsencode(a) for a in argv)
                self.channel.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)], socket.MSG_DONTWAIT)
            finally:
                os.close(mntns)
        except OSError:
            os.close(read_fd)
            self._kill()
            return None
        finally:
            os.close(write_fd)
        pid, self.pid = self.pid, None  # the Sandbox's now: it reaps it
        self.channel.close()
        return pid, read_fd

    def _kill(self) -> None:
        if self.pid is not None and not self.killed:
            self.killed = True
            os.kill(self.pid, signal.SIGKILL)  # a zombie's kill succeeds too: it is ours until reaped

    def stop(self) -> None:
        """Kill and reap it, if not handed a start. Idempotent."""
        self._kill()
        if self.pid is not None:
            pid, self.pid = self.pid, None
            os.waitpid(pid, 0)
        if self.channel is not None:
            self.channel.close()


def hold_helper(nice: int | None = None) -> None:
    """In a start server's spare, at idle: make the Helper its Sandbox will use, if it has none.
    Nothing where the hook is in a user namespace (its fork then needs a middle process), and
    nothing if it cannot be made: the start forks its own sandbox, as it always could."""
    global _held
    if _held is not None or userns.unprivileged() or not sys.executable:
        return
    try:
        _held = Helper(nice)
    except OSError:
        pass


def drop_helper() -> None:
    """Stop the held Helper, if there is one: before the process that holds it exits, so that it
    is reaped here and left to no one."""
    global _held
    helper, _held = _held, None
    if helper is not None:
        helper.stop()


def _start_through_helper(exe: int, argv, rootfs_fd: int, out: int):
    """(pid, read end of its stderr) of ldconfig started by the held Helper, which is then the
    caller's to reap; None where none is held, where the sandbox runs in a user namespace (its
    fork then needs a middle process), or where the helper could not take the start (killed
    now, reaped by drop_helper as the process exits)."""
    global _held
    if _held is None or userns.unprivileged():
        return None
    started = _held.start(exe, argv, rootfs_fd, out)
    if started is not None:
        _held = None  # used once: the Sandbox reaps it as it reaps a fork
    return started


VIEW_MOUNT_POINT = "/view"  # in an empty mount namespace: a Helper's own, or a copy of the server's
# The rootfs and every mount below it, cloned where it is (open_tree clones only from the
# caller's own namespace) to be attached in an empty one: a start then copies the rootfs's
# mounts once, never the whole table of the container's namespace (the host's mounts with it).
_VIEW_CLONE = _linux.OPEN_TREE_CLONE | _linux.OPEN_TREE_CLOEXEC | _linux.AT_RECURSIVE | _linux.AT_EMPTY_PATH
_empty = None  # an empty mount namespace this process holds (a start server's, its workers inherit it)


def _attach_view(view: int) -> None:
    """In an empty mount namespace of the caller's own: the cloned view made read-only, nodev,
    nosuid, noexec and private, recursively, and attached at VIEW_MOUNT_POINT. A clone keeps its
    originals' propagation (a peer, a slave): made private first, so that nothing mounted on it
    below is seen anywhere else, nor anything from there seen here."""
    _linux.mount_setattr(view, _VIEW_ATTRS, propagation=_linux.MS_PRIVATE)
    _linux.move_mount(view, "", _linux.AT_FDCWD, VIEW_MOUNT_POINT, _linux.MOVE_MOUNT_F_EMPTY_PATH)


def hold_empty_namespace(timeout: float = 5.0) -> bool:
    """In a start server, once, before its first fork: an empty mount namespace (_empty) that
    every sandbox its workers fork copies instead of the container's (the copy, and the detach
    after pivot_root, cost about 1 µs a mount each: 2,000 mounts on a busy node are 4 ms a
    start). Made by a child, which sends it back and exits. Whether one is held: none where the
    hook is in a user namespace, and none if it cannot be made within timeout (the child is then
    killed): the sandbox then copies, as it always could."""
    global _empty
    if _empty is not None:
        return True
    if userns.unprivileged():
        return False
    import select
    import socket

    from oci_gpu_hook.start.linux import scm_rights

    fds, pid = [], None
    try:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except OSError:
        return False
    try:
        pid = os.fork()
        if pid == 0:
            try:
                _linux.set_parent_death_signal(signal.SIGKILL)
                socket.send_fds(theirs, [b"empty"], [_empty_mount_namespace()])
            finally:
                os._exit(0)
        theirs.close()
        if select.select([ours], [], [], timeout)[0]:
            _, fds, _ = scm_rights.receive(ours, 16, 1, socket.MSG_CMSG_CLOEXEC)
    except OSError:
        pass
    finally:
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)  # done already, or past its time
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
        ours.close()
        theirs.close()
    if fds:  # one at most (room for one)
        _empty = fds[0]
    return _empty is not None


def _empty_mount_namespace() -> int:
    """In a Helper at idle, or the child of hold_empty_namespace: a mount namespace of its own
    whose one mount, and root, is a small empty tmpfs with VIEW_MOUNT_POINT in it (the host's
    table, copied by unshare, detached now rather than on a start's path); a descriptor of it,
    for setns."""
    _linux.unshare(_linux.CLONE_NEWNS)
    _linux.mount(None, "/", None, _linux.MS_REC | _linux.MS_PRIVATE)
    namespace = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)  # while /proc is in view
    attrs = _linux.MOUNT_ATTR_NOSUID | _linux.MOUNT_ATTR_NODEV | _linux.MOUNT_ATTR_NOEXEC
    root = _linux.fsmount_new("tmpfs", {"mode": "0700", "size": "4k", "nr_inodes": "4"}, attrs)
    os.mkdir(VIEW_MOUNT_POINT.lstrip("/"), 0o700, dir_fd=root)
    _linux.move_mount(root, "", _linux.AT_FDCWD, "/", _linux.MOVE_MOUNT_F_EMPTY_PATH)  # over the host's root
    os.fchdir(root)
    _linux.pivot_root(".", ".")
    _linux.umount2(".", _linux.MNT_DETACH)
    os.chdir("/")
    os.close(root)
    return namespace


def helper_main(channel: int, nice: int | None = None) -> None:
    """The Helper's own process (python -I -S, pid 1 of its PID namespace). Never returns."""
    import _socket  # socket's C core, as scm_rights imports it and for the same reason

    from oci_gpu_hook.start.linux import scm_rights

    err_fd = None
    try:
        _linux.set_parent_death_signal(signal.SIGKILL)  # its parent gone before this: the socket's end says so
        if nice is not None and os.getpriority(os.PRIO_PROCESS, 0) < nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)  # ldconfig runs as the worker's own fork would
        os.closerange(channel + 1, 1 << 16)  # anything its holder let be inherited: not its to keep
        null = os.open("/dev/null", os.O_RDWR)  # before the host disappears from view
        os.dup2(null, 0)
        os.dup2(null, 1)
        _stay_in_own_domain()
        _linux.unshare(_NAMESPACES)
        empty = _empty_mount_namespace()
        pair = _socket.socket(fileno=channel)
        pair.send(HELPER_READY)
        # Close-on-exec, as the worker's own are: ldconfig is exec'd from one (the probe of
        # test_a_compromised_ldconfig_reaches_nothing counts its descriptors).
        message, fds, flags = scm_rights.receive(pair, MAX_HELPER_MESSAGE, HELPER_FDS, _socket.MSG_CMSG_CLOEXEC)
        if len(fds) != HELPER_FDS or flags & (_socket.MSG_TRUNC | _socket.MSG_CTRUNC):
            os._exit(127)  # the socket's end (its parent gone), or not a start: nothing to say it to
        mntns, rootfs_fd, out, exe, err_fd = fds
        argv = [os.fsdecode(a) for a in message.split(b"\0")]
        # Cloned in the worker's namespace, attached in the empty one (_VIEW_CLONE).
        _linux.setns(mntns, _linux.CLONE_NEWNS)
        os.close(mntns)
        view = _linux.open_tree(rootfs_fd, "", _VIEW_CLONE)
        _linux.setns(empty, _linux.CLONE_NEWNS)
        _attach_view(view)
        _enter_view_and_exec(view, exe, argv, out, err_fd, null, orphan_signal=signal.SIGKILL)
    except BaseException as e:
        if err_fd is not None:
            try:
                os.write(err_fd, HELPER_FAILED + str(e).encode(errors="replace") + b"\n")
            except OSError:
                pass
    finally:
        os._exit(127)


def _read_cache(out: int) -> bytes:
    """The cache ldconfig left in its tmpfs: a regular file (it could have been compromised and
    left anything there), bounded, with a cache's magic."""
    try:
        fd = os.open("ld.so.cache", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=out)
    except OSError as e:
        raise LdconfigError(f"ldconfig wrote no cache: {e.strerror}") from None
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        data = f.read(MAX_CACHE_BYTES + 1) if stat.S_ISREG(st.st_mode) else b""
    if not data.startswith(CACHE_MAGICS) or len(data) > MAX_CACHE_BYTES:
        raise LdconfigError("ldconfig wrote something that is not an ld.so.cache")
    return data


# --- the whole step --------------------------------------------------------------------------


class Refresh:
    """The whole step, started (ldconfig at work in its sandbox) and finished apart, so that the
    hook can mount what ldconfig does not index meanwhile. The undo log stops a started ldconfig
    whatever happens (undo.on_close)."""

    def __init__(self, rootfs, directories, undo, timeout: float = 20.0, sources=None):
        self.started = time.perf_counter()  # how long it took in all: the log record's timings
        self.rootfs, self.undo = rootfs, undo
        conf, self.notes = flatten_conf(rootfs)
        try:
            self.etc = undo.keep_fd(rootfs.ensure_dir("/etc", undo))
        except OSError as e:
            raise LdconfigError(f"/etc in the container: {e.strerror or e}") from None
        with no_deadline_between():  # made and registered as one: cut between, ldconfig would be no one's
            self.sandbox = Sandbox(rootfs.fd, conf, directories, timeout, sources)
            undo.on_close.append(self.sandbox.cancel)

    def finish(self) -> list[str]:
        """Install the new cache (recorded in the undo log); returns the notes (image
        configuration files that were ignored)."""
        data = self.sandbox.result()
        try:
            self.rootfs.replace_file("/etc", self.etc, "ld.so.cache", data, 0o644, self.undo)
        except ForeignMount as e:  # /etc is a volume from the host: the cache would outlive the container
            return [*self.notes, f"/etc/ld.so.cache not refreshed: {e.strerror}"]
        except OSError as e:
            raise LdconfigError(f"cannot install /etc/ld.so.cache in the container: {e.strerror or e}") from None
        return self.notes


def refresh(rootfs, directories, undo, timeout: float = 20.0, sources=None) -> list[str]:
    """Rebuild /etc/ld.so.cache of the rootfs (a rootfs.Rootfs) for directories; the change is
    recorded in undo. Returns notes (image configuration files that were ignored). sources: a
    HostSources to open the host's ldconfig with (the hook's, which has walked /usr already)."""
    return Refresh(rootfs, directories, undo, timeout, sources).finish()
