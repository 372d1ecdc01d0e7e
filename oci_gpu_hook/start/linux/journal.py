"""A write-ahead journal of what apply creates in a rootfs, so that a hook killed mid-apply
(SIGKILL by the runtime's timeout, the OOM killer) leaves nothing behind for long.

Mounts vanish with the container's mount namespace, but the empty files, directories and
symlinks made as mount targets in a plain-directory rootfs would stay. Before creating each one,
apply appends a line naming it to a journal of its own (one per apply, held under an exclusive
flock while it runs, in a root-only directory). The journal is removed when apply ends: after
success (what was made is in use) or after a complete rollback. The next GPU start of the same
rootfs finds a journal whose lock nobody holds, undoes what it names, conservatively (an empty
regular file, an empty directory, a symlink with the recorded value: never anything else), and
removes it.

A journal is a file of the hook's own uid (settings.new_trusted: settings.CACHE_UID's for root,
owned before it has a name), and its first line names the rootfs it is for: recovery takes no
other. A uid 0 without capabilities (a container's root given the host's /run) owns root's
directory, so it may put files of root's in it and rename what is there, but it can neither make
nor rewrite a file of that uid's: it cannot have the next start remove files from a rootfs, nor
send one rootfs's journal to another (the first line would not match).
Standard library only: this is on the start path.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from oci_gpu_hook.start import jsonio, settings

_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def journal_directory(inventory_cache: str) -> str:
    """pending/ in the run directory that holds the inventory cache (/run/oci-gpu-hook/pending)."""
    return os.path.join(os.path.dirname(inventory_cache), "pending")


def _prefix(rootfs_fd: int) -> str:
    st = os.fstat(rootfs_fd)
    return f"{st.st_dev:x}-{st.st_ino:x}."


def _header(prefix: str) -> list:
    """A journal's first line: the rootfs it is for (its name says so too, but a name can be
    changed by whoever owns the directory; the contents only by the hook)."""
    return ["rootfs", prefix[:-1]]


def _is_for(line: bytes, prefix: str) -> bool:
    try:
        return jsonio.loads(line) == _header(prefix)
    except (ValueError, RecursionError):
        return False


def _directory(path: str) -> int:
    """Descriptor of the journal directory (made 0700 if missing); None when it is not root's alone."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _FLAGS)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        return None
    return fd


class Journal:
    def __init__(self, dir_fd: int, name: str, fd: int):
        self.dir_fd, self.name, self.fd = dir_fd, name, fd

    @classmethod
    def start(cls, path: str, rootfs, tell=None) -> Journal | None:
        """Recover what killed applies left in this rootfs, then open this apply's journal.
        None (no journal) when the directory cannot be used; the start goes on without one.
        tell(line): for each file named for this rootfs that is not a journal the hook wrote for it
        (left alone)."""
        try:
            dir_fd = _directory(path)
        except OSError:
            return None
        if dir_fd is None:
            return None
        try:
            prefix = _prefix(rootfs.fd)
            _recover(dir_fd, prefix, rootfs, tell)
            name = f"{prefix}{os.getpid()}"
            fd = settings.new_trusted(dir_fd, (jsonio.dumps(_header(prefix)) + "\n").encode())
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # before it has a name: no start may take it as a killed one's
                settings.link_trusted(fd, dir_fd, name)
            except BaseException:
                os.close(fd)
                raise
            return cls(dir_fd, name, fd)
        except OSError:
            os.close(dir_fd)
            return None

    def intend(self, kind: str, path: str, value: str = "") -> None:
        """Say, before doing it, that apply is about to create path (kind: file, dir, symlink)."""
        os.write(self.fd, (jsonio.dumps([kind, path, value]) + "\n").encode())

    def close(self, keep: bool = False) -> None:
        """End the journal: removed unless keep (a rollback that could not undo everything)."""
        if not keep:
            try:
                os.unlink(self.name, dir_fd=self.dir_fd)
            except OSError:
                pass
        os.close(self.fd)  # releases the lock
        os.close(self.dir_fd)


def _recover(dir_fd: int, prefix: str, rootfs, tell=None) -> None:
    for name in os.listdir(dir_fd):
        if not name.startswith(prefix):
            continue
        try:  # O_NONBLOCK: a FIFO planted there cannot hold the start
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _FLAGS, dir_fd=dir_fd)
        except OSError as e:
            if e.errno == errno.ELOOP and tell is not None:
                tell(f"{name}: not a journal the hook wrote (a symlink); not acted on")
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not settings.trusted(st):
                if tell is not None:
                    what = f"owned by uid {st.st_uid} with mode {st.st_mode & 0o7777:04o}"
                    what = what if stat.S_ISREG(st.st_mode) else "not a regular file"
                    tell(f"{name}: not a journal the hook wrote ({what}); not acted on")
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its apply is still running
            with open(fd, "rb", closefd=False) as f:
                lines = f.read(1 << 20).splitlines()
            if not lines or not _is_for(lines[0], prefix):
                if tell is not None:
                    tell(f"{name}: a journal of another rootfs (renamed); not acted on")
                continue
            for line in reversed(lines[1:]):
                try:
                    kind, path, value = jsonio.loads(line)
                    _undo(rootfs, kind, path, value)
                except (ValueError, TypeError, OSError):
                    pass
            os.unlink(name, dir_fd=dir_fd)
        finally:
            os.close(fd)


def _undo(rootfs, kind: str, path: str, value: str) -> None:
    parent, name = os.path.split(path)
    parent_fd = rootfs.open(parent or "/")
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if kind == "file" and stat.S_ISREG(st.st_mode) and st.st_size == 0:
            os.unlink(name, dir_fd=parent_fd)
        elif kind == "temp" and stat.S_ISREG(st.st_mode):
            os.unlink(name, dir_fd=parent_fd)
        elif kind == "dir" and stat.S_ISDIR(st.st_mode):
            os.rmdir(name, dir_fd=parent_fd)  # only if empty
        elif kind == "symlink" and stat.S_ISLNK(st.st_mode) and os.readlink(name, dir_fd=parent_fd) == value:
            os.unlink(name, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)
