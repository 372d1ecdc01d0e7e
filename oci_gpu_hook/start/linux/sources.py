"""Mount sources on the host: opened once, by a walk that trusts only what root controls.

The plan names host paths (driver files, device nodes, IPC sockets, the MPS pipe directory,
/proc/driver/nvidia entries). Some sit where other local users can write (/tmp, a service
account's /run directory). A path string looked up at mount time could then be swapped for a
symlink to a root-only file, a file of the user's own, or a directory shared with every GPU
container. So each source is resolved here once, component by component with O_NOFOLLOW; a
symlink is followed only if root owns it, a directory is crossed only if root owns it and nobody
else can write it (a sticky directory such as /tmp counts: others cannot rename root's entries
in it), and the source itself must be root's, of the expected type, and, unless it is a device
node or socket, writable by nobody else. The caller mounts the descriptor (/proc/self/fd/N), so
what was checked is what gets mounted. In a user namespace (rootless podman) root is whom the
host's root shows as there (userns.root_uid()), as every user outside the namespace shows: so
there, nothing is taken from a directory others may write (a sticky one, such as /tmp), where
any user may have made the entry.
"""

from __future__ import annotations

import errno
import os
import stat

from oci_gpu_hook.start.linux import userns

MAX_SYMLINKS = 40
_O_PATH = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
KINDS = {"char": stat.S_ISCHR, "file": stat.S_ISREG, "dir": stat.S_ISDIR, "socket": stat.S_ISSOCK}
KIND_NAMES = {"char": "character device", "file": "regular file", "dir": "directory", "socket": "socket"}


_CANNOT_TELL = "in a directory others may write, whose entries' owners a user namespace cannot tell from root"


class UntrustedSource(Exception):
    """The source exists but is not something only root controls (or not of the expected kind)."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path}: {why}")
        self.path = path
        self.why = why


def _others_can_replace(st) -> bool:
    """Whether someone but root can rename or replace entries of directory st."""
    if st.st_uid != userns.root_uid():
        return True
    return bool(st.st_mode & 0o022) and not st.st_mode & stat.S_ISVTX


class HostSources:
    """Opens host sources for one apply; verified directories are kept open and reused, since
    most sources share a few directories."""

    def __init__(self):
        self._dirs: dict[str, int] = {}

    def close(self) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs = {}

    def open(self, path: str, kind: str) -> int:
        """O_PATH descriptor of path, checked. Raises FileNotFoundError when it is absent and
        UntrustedSource when it must not be used."""
        return self.open_stat(path, kind)[0]

    def open_stat(self, path: str, kind: str):
        """open(), and the os.stat_result of what it opened (the checks' own: an O_PATH descriptor
        names one inode for good, so its identity needs no second fstat)."""
        fd, st = self._resolve(path, 0)
        try:
            if st.st_uid != userns.root_uid():
                raise UntrustedSource(path, f"owned by uid {st.st_uid}, not root")
            if not KINDS[kind](st.st_mode):
                raise UntrustedSource(path, f"not a {KIND_NAMES[kind]}")
            if kind in ("file", "dir") and st.st_mode & 0o022:
                raise UntrustedSource(path, "writable by others than root")
            return fd, st
        except BaseException:
            os.close(fd)
            raise

    def open_place(self, path: str, kind: str) -> int:
        """open(path, kind) where path exists, else open() of its nearest existing directory: the
        place where something is, or would be made, can be changed by root alone (install's
        destinations, a configuration to come, an import path entry not made yet)."""
        existing = path
        while not os.path.lexists(existing):
            existing = os.path.dirname(existing)
        return self.open(existing, kind if existing == path else "dir")

    def directory(self, path: str) -> int:
        """Descriptor (O_PATH, kept: not to be closed by the caller) of the directory path, which
        root alone can change; UntrustedSource otherwise. What something root makes there (the
        device plugin's MPS directories) is made through it."""
        return self._directory("/" + os.path.normpath(path).lstrip("/"), 0)

    def _directory(self, path: str, links: int) -> int:
        """Descriptor of a directory that only root can change (not to be closed by the caller)."""
        if path in self._dirs:
            return self._dirs[path]
        if path == "/":
            fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            st = os.fstat(fd)
        else:
            fd, st = self._resolve(path, links)
        if not stat.S_ISDIR(st.st_mode):
            os.close(fd)
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        if _others_can_replace(st):
            os.close(fd)
            raise UntrustedSource(path, "a directory that others than root can change")
        self._dirs[path] = fd
        return fd

    def _resolve(self, path: str, links: int):
        """(O_PATH descriptor, its os.stat_result) of path's last component, in a directory only
        root can change; root-owned symlinks are followed (on the host, /lib -> usr/lib is common)."""
        if not path.startswith("/"):
            raise UntrustedSource(path, "not an absolute path")
        path = "/" + os.path.normpath(path).lstrip("/")  # normpath keeps a leading '//'
        parent, name = os.path.split(path)
        dir_fd = self._directory(parent, links)
        if not name:
            fd = os.dup(dir_fd)
            return fd, os.fstat(fd)
        if userns.unprivileged() and os.fstat(dir_fd).st_mode & 0o022:
            # A sticky directory others may write (/tmp): any user can make an entry there, and
            # in a user namespace theirs shows as the overflow uid, as root's do (rootless podman).
            raise UntrustedSource(path, _CANNOT_TELL)
        fd = os.open(name, _O_PATH, dir_fd=dir_fd)
        st = os.fstat(fd)
        if not stat.S_ISLNK(st.st_mode):
            return fd, st
        os.close(fd)
        if st.st_uid != userns.root_uid():
            raise UntrustedSource(path, f"a symlink owned by uid {st.st_uid}, not root")
        if links >= MAX_SYMLINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
        target = os.readlink(name, dir_fd=dir_fd)
        return self._resolve(target if target.startswith("/") else f"{parent}/{target}", links + 1)
