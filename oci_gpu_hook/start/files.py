"""The hook's own files on the host: the one bounded read and the one atomic write.

(Files inside a container's rootfs are another matter: rootfs.py reaches them by descriptors.)
Standard library only, and neither tempfile nor json: both run on the start path.
"""

from __future__ import annotations

import errno
import os
import stat


def read_bounded(path: str, limit: int, nofollow: bool = False, regular: bool = False, check=None) -> bytes:
    """At most limit + 1 bytes of the file at path: one more than allowed, so that the caller can
    tell a file that is too large (and say so) from one that fits, without reading all of it. The
    one bounded read of the hook's own files.

    Opened O_NONBLOCK, so a FIFO put where a file belongs cannot hang the hook; nofollow refuses a
    symlink at the last component (ELOOP); regular refuses anything but a regular file (EINVAL,
    "not a regular file"); check(stat) runs on the descriptor that is read (an owner or mode
    check: nothing can be swapped in between) and raises what the caller wants said."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if nofollow else 0)
    fd = os.open(path, flags)
    try:
        if regular or check is not None:
            st = os.fstat(fd)
            if regular and not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            if check is not None:
                check(st)
        return read_up_to(fd, limit)
    finally:
        os.close(fd)


def read_up_to(fd: int, limit: int) -> bytes:
    """What fd has to read, up to limit + 1 bytes (one more than allowed tells a file too large)."""
    chunks, left = [], limit + 1
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def write_atomically(path: str, data: bytes, mode: int = 0o644, durable: bool = True) -> None:
    """Replace path with data so that a reader sees the old file or the new one, never a torn one.

    The temporary file is new (O_EXCL, a random name, in path's directory), so nothing that
    already exists there (a planted symlink, a file of someone else's) is written through; its
    mode is set on the descriptor, never by name; durable fsyncs it before the rename. Whatever
    fails, the temporary file is removed and the OSError raised."""
    directory, name = os.path.split(path)
    for _ in range(16):
        temporary = os.path.join(directory, f".{name}.{os.urandom(6).hex()}.tmp")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            break
        except FileExistsError:
            continue
    else:
        raise OSError(errno.EEXIST, "no free temporary name", directory)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
