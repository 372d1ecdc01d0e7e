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
MAX_CONF_BYTES = 64 << 10
MAX_CONF_FILES = 128
MAX_LISTED = 4096  # directory entries looked at per include pattern
CACHE_MAGICS = (b"glibc-ld.so.cache", b"ld.so-1.7.0")
_NAMESPACES = _linux.CLONE_NEWNS | _linux.CLONE_NEWIPC | _linux.CLONE_NEWUTS | _linux.CLONE_NEWNET
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
        self.exe = _open_ldconfig(sources)
        try:
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
                f.write(os.fsencode(conf))  # the image's bytes again (_ConfReader._text)
            argv = ["ldconfig", "-X", "-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache", *directories]
            self.pid, self.errors = _start_sandboxed(self.exe, argv, rootfs_fd, self.out)
        except BaseException:
            self._release()
            raise

    def result(self) -> bytes:
        """Wait for ldconfig (killing it past the timeout) and return the cache it wrote."""
        try:
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

        chunks = []
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
            chunks.append(chunk)
        with no_deadline_between():  # reaped and forgotten as one: cancel() kills only ours
            _, status = os.waitpid(self.pid, 0)
            self.pid = None
        return os.waitstatus_to_exitcode(status), b"".join(chunks)[-4096:]

    def cancel(self) -> None:
        if self.pid is not None:
            pid, self.pid = self.pid, None
            os.kill(pid, signal.SIGKILL)  # pid 1 of its namespace: whatever it started dies with it
            os.waitpid(pid, 0)
        self._release()

    def _release(self) -> None:
        for name in ("exe", "out", "errors"):
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
    # The child is pid 1 of a new PID namespace: it can neither see nor signal anything else, and
    # whatever it leaves running dies with it. Only the child goes there: our own PID namespace
    # for later children is restored right after the fork.
    try:
        own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _linux.unshare(_linux.CLONE_NEWPID)
            try:
                pid = os.fork()
                if pid == 0:
                    try:
                        _sandbox_child(exe, argv, rootfs_fd, out, write_fd)
                    except BaseException as e:
                        os.write(write_fd, f"cannot start ldconfig: {e}\n".encode())
                    finally:
                        os._exit(127)
            finally:
                _linux.setns(own_pid_ns, _linux.CLONE_NEWPID)
        finally:
            os.close(own_pid_ns)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return pid, read_fd


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
    os.fchdir(rootfs_fd)  # unshare moves the cwd into the new namespace's copy: no path walked again
    _linux.unshare(_NAMESPACES)
    _linux.mount(None, "/", None, _linux.MS_REC | _linux.MS_PRIVATE)
    clone = _linux.OPEN_TREE_CLONE | _linux.OPEN_TREE_CLOEXEC | _linux.AT_RECURSIVE
    view = _linux.open_tree(_linux.AT_FDCWD, ".", clone)
    _linux.mount_setattr(view, _VIEW_ATTRS)
    _linux.move_mount(view, "", _linux.AT_FDCWD, ".", _linux.MOVE_MOUNT_F_EMPTY_PATH)
    # /etc of the view, resolved inside it (never through a magic link), gets the private tmpfs.
    etc = _linux.openat2(view, "etc", os.O_PATH | os.O_DIRECTORY, _linux.RESOLVE_IN_ROOT | _linux.RESOLVE_NO_MAGICLINKS)
    _linux.move_mount(out, "", etc, "", _linux.MOVE_MOUNT_F_EMPTY_PATH | _linux.MOVE_MOUNT_T_EMPTY_PATH)
    os.fchdir(view)
    _linux.pivot_root(".", ".")
    _linux.umount2(".", _linux.MNT_DETACH)  # the old root (the host) is gone from this namespace
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
    os.execve(exe, argv, {})


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
