"""Refresh a container's ld.so.cache with the host's ldconfig, confined to the rootfs.

Never a binary from the image: the host's ldconfig (static on Debian and RHEL) runs with
`-r ROOTFS`, so it chroots into the rootfs before reading anything there. The child gets an empty
environment, no new privileges, only the capabilities chroot and file updates need, its own IPC
namespace, and resource limits; the image's LD_PRELOAD or ld.so.conf cannot reach the host.
"""

from __future__ import annotations

import _signal as signal  # the C core of signal: the same calls, without its enum wrappers (~5 ms)
import os
import resource
import time

from . import _linux
from .errors import HookError

LDCONFIG_PATHS = ("/sbin/ldconfig", "/usr/sbin/ldconfig")
# chroot, plus writing ld.so.cache and links in an image whose files root may not own.
KEPT_CAPABILITIES = ("sys_chroot", "dac_override", "dac_read_search", "fowner", "chown")
LIMITS = {
    resource.RLIMIT_CPU: 20,
    resource.RLIMIT_AS: 1 << 30,
    resource.RLIMIT_FSIZE: 256 << 20,
    resource.RLIMIT_NOFILE: 1024,
    resource.RLIMIT_CORE: 0,
}


class LdconfigError(HookError):
    exit_code = 10


def host_ldconfig() -> str:
    for path in LDCONFIG_PATHS:
        if os.access(path, os.X_OK):
            return path
    raise LdconfigError("the host has no ldconfig (/sbin/ldconfig); it is needed to refresh the container's ld cache")


def _confine() -> None:
    """Runs in the forked child before exec: drop everything ldconfig does not need."""
    import prctl

    _linux.unshare(_linux.CLONE_NEWIPC)
    for limit, value in LIMITS.items():
        resource.setrlimit(limit, (value, value))
    keep = {getattr(prctl, f"CAP_{name.upper()}") for name in KEPT_CAPABILITIES}
    for cap in prctl.ALL_CAPS:
        if cap not in keep:
            prctl.capbset_drop(cap)
    # Effective must stay a subset of permitted at every step: lower it first.
    prctl.cap_effective.limit(*keep)
    prctl.cap_inheritable.limit()
    prctl.cap_permitted.limit(*keep)
    prctl.set_no_new_privs(True)


def refresh(rootfs_fd: int, directories, timeout: float = 20.0) -> None:
    """Run ldconfig for the rootfs open at rootfs_fd (it chroots through /proc/self/fd/N, so the
    rootfs is the one the hook resolved, not a path looked up again).

    fork and execve by hand rather than subprocess: the hook already runs in a single-threaded
    child, and subprocess (with locale and re) would cost every GPU container ~5 ms of imports."""
    argv = [host_ldconfig(), "-r", f"/proc/self/fd/{rootfs_fd}", *directories]
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(write_fd, 2)
            null = os.open("/dev/null", os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            os.set_inheritable(rootfs_fd, True)
            os.closerange(3, rootfs_fd)
            os.closerange(rootfs_fd + 1, 1 << 16)
            os.chdir("/")
            _confine()
            os.execve(argv[0], argv, {})
        except BaseException as e:
            os.write(2, f"cannot start ldconfig: {e}\n".encode())
        finally:
            os._exit(127)
    os.close(write_fd)
    try:
        code, errors = _wait(pid, read_fd, timeout)
    finally:
        os.close(read_fd)
    if code != 0:
        lines = errors.decode("utf-8", "replace").strip().splitlines()
        raise LdconfigError(f"ldconfig failed: {lines[-1] if lines else f'exit status {code}'}")


def _wait(pid: int, read_fd: int, timeout: float):
    """(exit status, stderr) of the child, killing it past the timeout. poll() on its stderr wakes
    us the moment it exits (the pipe closes), with no sleeping loop."""
    import select

    deadline = time.monotonic() + timeout
    chunks = []
    poller = select.poll()
    poller.register(read_fd, select.POLLIN | select.POLLHUP)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LdconfigError(f"ldconfig did not finish within {timeout:.0f} s")
            if not poller.poll(left * 1000):
                continue
            chunk = os.read(read_fd, 1 << 16)
            if not chunk:  # the child's end closed: it has exited (or exec failed and it is exiting)
                break
            chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status), b"".join(chunks)[-4096:]
    except BaseException:
        os.kill(pid, signal.SIGKILL)  # on our timeout, or the hook's deadline firing meanwhile
        os.waitpid(pid, 0)
        raise
