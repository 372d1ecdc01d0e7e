"""The only ctypes module: Linux system calls Python's os module lacks (on 3.9).

Syscall numbers are x86-64's. Each wrapper raises OSError with errno, like os functions do.
"""

import ctypes
import os

# By name, not ctypes.util.find_library: that runs ldconfig or gcc, far too slow for a hook.
_libc = ctypes.CDLL("libc.so.6", use_errno=True)

SYS_pidfd_open = 434
SYS_openat2 = 437

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000

RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10

MOUNT_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}


def _check(result: int, what: str, path: str = None) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}", path)
    return result


def _bytes(value):
    return value.encode() if isinstance(value, str) else value


def mount(source, target: str, fstype, flags: int, data=None) -> None:
    result = _libc.mount(_bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags), _bytes(data))
    _check(result, "mount", target)


def umount2(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(target.encode(), flags), "umount", target)


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def pidfd_open(pid: int) -> int:
    return _check(_libc.syscall(SYS_pidfd_open, pid, 0), "pidfd_open")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    how = _OpenHow(flags, mode, resolve)
    fd = _libc.syscall(SYS_openat2, dir_fd, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
    return _check(fd, "openat2", path)


def mount_flags(names) -> int:
    flags = 0
    for name in names:
        flags |= MOUNT_FLAGS[name]
    return flags


# libselinux, loaded on first use: only containers with a mount label on SELinux hosts pay for it.
_libselinux = None


def _selinux_lib():
    global _libselinux
    if _libselinux is None:
        _libselinux = ctypes.CDLL("libselinux.so.1", use_errno=True)
    return _libselinux


def is_selinux_enabled() -> bool:
    return _selinux_lib().is_selinux_enabled() == 1


def lsetfilecon(path: str, context: str) -> None:
    """Label path itself (a final symlink is not followed)."""
    _check(_selinux_lib().lsetfilecon(path.encode(), context.encode()), "lsetfilecon", path)


SYS_bpf = 321


def bpf(cmd: int, attr: bytearray, what: str = "bpf") -> int:
    """bpf(2): attr is the union bpf_attr, zero-padded; the kernel writes its outputs back into it."""
    view = (ctypes.c_char * len(attr)).from_buffer(attr)
    return _check(_libc.syscall(SYS_bpf, cmd, view, len(attr)), what)


def address_of(buf: bytearray) -> int:
    """Address of buf's bytes, for a pointer field in a bpf_attr; valid while buf lives and keeps its size."""
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
