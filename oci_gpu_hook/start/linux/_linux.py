"""The only ctypes module: Linux system calls Python's os module lacks (on 3.9).

Each wrapper raises OSError with errno, like os functions do. Calls through syscall(2) take their
numbers from _nr(), that is from arch.py's table (x86_64 and aarch64); on any other machine _nr()
raises arch.UnsupportedArchitecture, a one-line HookError, instead of calling a wrong number.
"""

import ctypes
import os

from oci_gpu_hook.start.linux import arch

# By name, not ctypes.util.find_library: that runs ldconfig or gcc, far too slow for a hook.
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _nr(name: str) -> int:
    """The number of system call `name` (one of arch.SYSCALL_NAMES) on this machine."""
    return arch.current().syscalls[name]


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
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOVE_MOUNT_T_EMPTY_PATH = 0x40
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
MOUNT_ATTR_NOSYMFOLLOW = 0x00200000
FSOPEN_CLOEXEC = 1
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6
FSMOUNT_CLOEXEC = 1
RENAME_EXCHANGE = 2
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_PDEATHSIG = 1
CAP_LAST_CAP_GUESS = 63  # drop up to here; numbers the kernel does not know give EINVAL

RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10

MOUNT_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
MOUNT_ATTRS = {"ro": MOUNT_ATTR_RDONLY, "nosuid": MOUNT_ATTR_NOSUID, "nodev": MOUNT_ATTR_NODEV,
               "noexec": MOUNT_ATTR_NOEXEC}  # fmt: skip


def _check(result: int, what: str, path: str = None) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}", path)
    return result


def _bytes(value):
    """A path (or option) for the kernel as the os module passes it (os.fsencode): a name read
    from a rootfs may hold bytes that are not UTF-8, kept as lone surrogates by os.fsdecode, and
    must reach the kernel as those bytes, never fail a strict encode (issue 46, item 7)."""
    return os.fsencode(value) if isinstance(value, str) else value


def mount(source, target: str, fstype, flags: int, data=None) -> None:
    result = _libc.mount(_bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags), _bytes(data))
    _check(result, "mount", target)


def umount2(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(_bytes(target), flags), "umount", target)


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def pidfd_open(pid: int) -> int:
    return _check(_libc.syscall(_nr("pidfd_open"), pid, 0), "pidfd_open")


# --- the new mount API (Linux 5.2; mount_setattr 5.12): detached trees and mounts by descriptor ---


def open_tree(dir_fd: int, path: str, flags: int) -> int:
    return _check(_libc.syscall(_nr("open_tree"), dir_fd, _bytes(path), flags), "open_tree", path)


def move_mount(from_fd: int, from_path: str, to_fd: int, to_path: str, flags: int) -> None:
    result = _libc.syscall(_nr("move_mount"), from_fd, _bytes(from_path), to_fd, _bytes(to_path), flags)
    _check(result, "move_mount", to_path)


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]  # fmt: skip


def mount_setattr(fd: int, attr_set: int, recursive: bool = True, attr_clr: int = 0, propagation: int = 0) -> None:
    """The mount open at fd (its root): attr_set set, attr_clr cleared, propagation (MS_PRIVATE...)
    made, in one call; with recursive, every mount below it too."""
    attr = _MountAttr(attr_set, attr_clr, propagation, 0)
    flags = AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0)
    _check(_libc.syscall(_nr("mount_setattr"), fd, b"", flags, ctypes.byref(attr), ctypes.sizeof(attr)),
           "mount_setattr")  # fmt: skip


def fsmount_new(fstype: str, options: dict, attrs: int) -> int:
    """A new, detached filesystem of fstype (fsopen, fsconfig, fsmount); returns the mount's fd."""
    fs = _check(_libc.syscall(_nr("fsopen"), _bytes(fstype), FSOPEN_CLOEXEC), "fsopen", fstype)
    try:
        for key, value in options.items():
            result = _libc.syscall(_nr("fsconfig"), fs, FSCONFIG_SET_STRING, _bytes(key), _bytes(value), 0)
            _check(result, f"fsconfig {key}={value}", fstype)
        _check(_libc.syscall(_nr("fsconfig"), fs, FSCONFIG_CMD_CREATE, None, None, 0), "fsconfig create", fstype)
        return _check(_libc.syscall(_nr("fsmount"), fs, FSMOUNT_CLOEXEC, attrs), "fsmount", fstype)
    finally:
        os.close(fs)


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(_nr("pivot_root"), _bytes(new_root), _bytes(put_old)), "pivot_root", new_root)


def renameat2(old_dir_fd: int, old: str, new_dir_fd: int, new: str, flags: int) -> None:
    _check(_libc.renameat2(old_dir_fd, _bytes(old), new_dir_fd, _bytes(new), flags), "renameat2", new)


def drop_bounding_set() -> None:
    """Empty the capability bounding set (needs CAP_SETPCAP): no later exec can gain any."""
    import errno

    for cap in range(CAP_LAST_CAP_GUESS + 1):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0:
            if ctypes.get_errno() == errno.EINVAL:  # past the kernel's last capability
                break
            _check(-1, "prctl(PR_CAPBSET_DROP)")


def set_no_new_privs() -> None:
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
# What changes a directory's files: written, made, removed, renamed in or out, their modes changed.
IN_CHANGES = 0x2 | 0x4 | 0x8 | 0x40 | 0x80 | 0x100 | 0x200 | 0x400 | 0x800


def inotify_init1(flags: int) -> int:
    return _check(_libc.inotify_init1(flags), "inotify_init1")


def inotify_add_watch(fd: int, path: str, mask: int) -> int:
    return _check(_libc.inotify_add_watch(fd, _bytes(path), ctypes.c_uint32(mask)), "inotify_add_watch", path)


def set_parent_death_signal(signum: int) -> None:
    """signum when the parent exits (kept across exec; cleared by a change of credentials)."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


class _SigEvent(ctypes.Structure):  # the kernel's struct sigevent: 64 bytes on every 64-bit machine
    _fields_ = [("value", ctypes.c_uint64), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("pad", ctypes.c_int * 12)]  # fmt: skip


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("interval_sec", ctypes.c_long), ("interval_nsec", ctypes.c_long), ("value_sec", ctypes.c_long),
                ("value_nsec", ctypes.c_long)]  # fmt: skip


CLOCK_MONOTONIC = 1
SIGEV_SIGNAL = 0


def kill_timer(seconds: float, signum: int) -> int:
    """A POSIX timer of this process that sends signum once, seconds from now; its id (timer_delete
    disarms it). Not inherited by fork, deleted by exec. With SIGKILL it ends the process even in
    a system call that no catchable signal interrupts but a fatal one does (FUSE, NFS)."""
    event = _SigEvent(0, signum, SIGEV_SIGNAL)
    timer = ctypes.c_int()
    _check(_libc.syscall(_nr("timer_create"), CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)),
           "timer_create")  # fmt: skip
    whole = int(seconds)
    spec = _ITimerSpec(0, 0, whole, max(1, int((seconds - whole) * 1e9)))
    if _libc.syscall(_nr("timer_settime"), timer, 0, ctypes.byref(spec), None) < 0:
        err = ctypes.get_errno()
        timer_delete(timer.value)
        raise OSError(err, f"timer_settime: {os.strerror(err)}")
    return timer.value


def timer_delete(timer: int) -> None:
    _check(_libc.syscall(_nr("timer_delete"), timer), "timer_delete")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    how = _OpenHow(flags, mode, resolve)
    fd = _libc.syscall(_nr("openat2"), dir_fd, _bytes(path), ctypes.byref(how), ctypes.sizeof(how))
    return _check(fd, "openat2", path)


def mount_flags(names) -> int:
    flags = 0
    for name in names:
        flags |= MOUNT_FLAGS[name]
    return flags


def mount_attrs(names) -> int:
    """mount_flags() as mount_setattr's MOUNT_ATTR_* bits."""
    attrs = 0
    for name in names:
        attrs |= MOUNT_ATTRS[name]
    return attrs


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
    _check(_selinux_lib().lsetfilecon(_bytes(path), _bytes(context)), "lsetfilecon", path)


def bpf(cmd: int, attr: bytearray, what: str = "bpf") -> int:
    """bpf(2): attr is the union bpf_attr, zero-padded; the kernel writes its outputs back into it."""
    view = (ctypes.c_char * len(attr)).from_buffer(attr)
    return _check(_libc.syscall(_nr("bpf"), cmd, view, len(attr)), what)


def address_of(buf: bytearray) -> int:
    """Address of buf's bytes, for a pointer field in a bpf_attr; valid while buf lives and keeps its size."""
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
