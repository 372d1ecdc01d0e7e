"""Paths inside a container's rootfs, resolved inside the rootfs.

The rootfs belongs to whoever wrote the image: every lookup walks it one component at a time
from a directory descriptor with O_NOFOLLOW, so no symlink, `..` or magic link in the image can
lead a lookup to the host.
"""

import os
import stat

_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def _walk(root_fd: int, path: str):
    """fd of path under root_fd, or None when a component is missing or a symlink."""
    fd = os.dup(root_fd)
    try:
        for part in [p for p in path.split("/") if p and p != "."]:
            if part == "..":
                return None
            try:
                next_fd = os.open(part, _FLAGS, dir_fd=fd)
            except OSError:
                return None
            os.close(fd)
            fd = next_fd
        result, fd = fd, -1
        return result
    finally:
        if fd >= 0:
            os.close(fd)


def has_debian_layout(rootfs: str) -> bool:
    """Whether the image is Debian-like (/etc/debian_version is a regular file inside it)."""
    try:
        root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fd = _walk(root_fd, "/etc/debian_version")
        if fd is None:
            return False
        try:
            return stat.S_ISREG(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
    finally:
        os.close(root_fd)
