"""The tree install and uninstall act in (`--root DIR`, or / itself): its paths, resolved as the
tree resolves them.

An image tree is its author's: a layer unpacked by root can hold root-owned links such as
`etc/systemd -> /etc/systemd` or `etc/containers -> /etc/containers`. Joined to DIR as a string,
such a path is resolved by the kernel from the build host's `/`, and install wrote the build host's
units while uninstall removed its files. So every path here is resolved as the booted image
resolves it, as systemd's `--root` does, and as the hook resolves a container's rootfs
(rootfs.py, whose lookup this reuses): links are followed inside DIR, an absolute target starting
at DIR and `..` stopping there (openat2 RESOLVE_IN_ROOT, or rootfs.py's walk on older kernels).

Resolved, not refused: an image's links mean paths in the image, absolute ones included
(Debian's `var/run -> /run`, `usr/local -> /opt/local`), so each keeps working and writes where
the image will look, while none can lead out of DIR. A link that leads nowhere inside the tree
(`etc/systemd -> /srv/host/etc/systemd`, a host path that is not in the image) is refused with one
line, never followed to make its target; one that loops (`etc/systemd -> /etc/systemd` is its own
path, inside DIR) is refused too.

What callers get is a host path with no link left in it: the kernel's own name of the directory
reached (/proc/self/fd/N), then the names still to be made. install then requires every directory
on that path, and every one above, to be root's alone (install._check_destinations); from then on
only root can put a link into any of them, so the path strings install acts on reach exactly the
directories that were resolved and checked.
"""

from __future__ import annotations

import errno
import os
import stat

from oci_gpu_hook.start import files
from oci_gpu_hook.start.inventory import host_path
from oci_gpu_hook.start.linux.rootfs import Rootfs

# The most install reads of one of the tree's configuration files (crio.conf, containers.conf,
# containerd's config.toml): real ones are a few KiB.
MAX_READ = 4 << 20


class TreeError(Exception):
    """A path of the tree that does not resolve inside it (one line)."""


class Tree:
    """A directory tree; root: as the user named it (messages show paths under it)."""

    def __init__(self, root: str):
        self.root = root
        self._rootfs = Rootfs(root)  # OSError when root is not a directory
        self._resolved: dict = {}

    def close(self) -> None:
        self._rootfs.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def shown(self, path: str) -> str:
        """path (of the tree) as the user would write it: under the root as they named it."""
        return host_path(self.root, path)

    def open(self, path: str, flags: int) -> int:
        """A descriptor of path, every link (the last one too) followed inside the tree: what a
        program in the image opens. Raises OSError."""
        return self._rootfs.open(path, flags)

    def read(self, path: str, limit: int = MAX_READ) -> bytes:
        """The tree's file at path, every link followed inside the tree, as a program in the image
        reads it. Only a regular file is opened to be read: the image's author chose what is
        there, and a layer unpacked by root can hold a device node (/dev/zero's numbers, which
        never end, or a watchdog's, whose open alone arms it) or a FIFO (whose open waits). So the
        place is opened O_PATH, which opens no device, its type checked on that descriptor, and
        only then is the file read, at most limit bytes. OSError: FileNotFoundError and
        NotADirectoryError where there is none, EINVAL "not a regular file", EFBIG "too large"."""
        fd = self.open(path, os.O_PATH)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", self.shown(path))
            data = files.read_bounded(f"/proc/self/fd/{fd}", limit)  # the very file checked
        finally:
            os.close(fd)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", self.shown(path))
        return data

    def resolve(self, path: str) -> str:
        """The host path of path, every component (the last one too) resolved inside the tree;
        components that do not exist yet are appended as they are (a place to make them)."""
        path = "/" + os.path.normpath(path).lstrip("/")
        if path not in self._resolved:
            self._resolved[path] = self._resolve(path)
        return self._resolved[path]

    def directory(self, path: str) -> str:
        """resolve(path), which must be a directory or not exist yet."""
        resolved = self.resolve(path)
        if os.path.lexists(resolved) and not os.path.isdir(resolved):  # no link left in resolved
            raise TreeError(f"{self.shown(path)}: not a directory")
        return resolved

    def entry(self, path: str) -> str:
        """The host path of path itself: its directory resolved inside the tree, its last
        component not followed (install replaces, removes or makes the file or link there, never
        what a link there points to)."""
        parent, name = os.path.split("/" + os.path.normpath(path).lstrip("/"))
        return os.path.join(self.directory(parent), name)

    def _resolve(self, path: str) -> str:
        existing, missing = path, []
        while True:
            try:
                fd = self._rootfs.open(existing)
                break
            except FileNotFoundError:
                if existing == "/":
                    raise TreeError(f"{self.root}: no such directory") from None
                existing, name = os.path.split(existing)
                missing.insert(0, name)
            except OSError as e:
                why = os.strerror(e.errno).lower() if e.errno else str(e)
                raise TreeError(f"{self.shown(path)}: {why}, resolved inside {self.root} (a tree's links are "
                                "followed inside it, as the image sees them)") from None  # fmt: skip
        try:
            is_directory = stat.S_ISDIR(os.fstat(fd).st_mode)
            found = os.readlink(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        if not missing:
            return found
        if not is_directory:
            raise TreeError(f"{self.shown(existing)}: not a directory")
        first = os.path.join(found, missing[0])
        if os.path.islink(first):
            # It exists, yet did not resolve: its target is not in the tree. On this host it may
            # well exist (the build host's own /etc): never made or followed from here.
            raise TreeError(f"{self.shown(os.path.join(existing, missing[0]))}: a symlink to {os.readlink(first)}, "
                            f"which leads nowhere inside {self.root} (a tree's links are followed inside it, as "
                            "the image sees them): make its target inside the tree, or remove the link")  # fmt: skip
        if os.path.lexists(first):  # appeared since the lookup: only root can do that here
            raise TreeError(f"{self.shown(os.path.join(existing, missing[0]))}: changed while being resolved")
        return os.path.join(found, *missing)
