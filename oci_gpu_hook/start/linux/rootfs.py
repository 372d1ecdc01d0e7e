"""Paths inside a container's rootfs, resolved inside the rootfs, through file descriptors.

The rootfs belongs to whoever wrote the image. Every lookup starts from a descriptor of the rootfs
and resolves symlinks as if the rootfs were '/' (openat2 RESOLVE_IN_ROOT; on kernels without
openat2, a component-by-component O_NOFOLLOW walk that follows links itself, inside the root).
Magic links (/proc/self/root, /proc/<pid>/fd/N) are never followed by the kernel. Callers get
descriptors and act on them (mount onto /proc/self/fd/N, *at calls), never on a path string
walked again. Whatever is created is recorded in an UndoLog.
"""

from __future__ import annotations

import errno
import os
import stat

from oci_gpu_hook.start.linux import _linux

MAX_SYMLINKS = 40
OPENAT2_TRIES = 32
_O_PATH = os.O_PATH | os.O_CLOEXEC
_openat2_works = None  # unknown until tried; False on kernels before 5.6 or under seccomp


class UndoLog:
    """Undo actions in the order things were done; rollback() runs them in reverse."""

    def __init__(self):
        self._actions: list[tuple[str, object]] = []
        self.fds: list[int] = []
        self.on_close: list = []  # releases that keep a change (called by close(), after success or rollback)
        self.on_commit: list = []  # clean-ups that only success may run (commit(), before close())
        self.journal = None  # journal.Journal: what is about to be created, for a hook killed mid-way

    def intend(self, kind: str, path: str, value: str = "") -> None:
        if self.journal is not None:
            self.journal.intend(kind, path, value)

    def add(self, description: str, action: object) -> None:
        self._actions.append((description, action))

    def keep_fd(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def rollback(self) -> list[str]:
        """Undo everything; returns what could not be undone (for the log)."""
        failures = []
        while self._actions:
            description, action = self._actions.pop()
            try:
                action()
            except OSError as e:
                failures.append(f"{description}: {e.strerror or e}")
        return failures

    def commit(self) -> None:
        """Everything succeeded: nothing will be undone; run the clean-ups that wait for that."""
        self._actions = []
        for action in self.on_commit:
            try:
                action()
            except OSError:
                pass
        self.on_commit = []

    def close(self) -> None:
        for release in self.on_close:
            try:
                release()
            except OSError:
                pass
        self.on_close = []
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


class ForeignMount(OSError):
    """The directory the hook would create something in is on a mount the container does not own
    (a volume from the host): what is made there would outlive the container."""


def mount_id(fd: int) -> int:
    """The id of the mount the file open at fd is on (its line in mountinfo)."""
    with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
        for line in f:
            if line.startswith(b"mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.ENOSYS, "the kernel does not say which mount a file is on (no mnt_id in fdinfo)")


class MountGuard:
    """Says which directories the hook may create in: those of the mounts that die with the
    container. Nothing of a container's start may outlive it on the host, and a user's volume (a
    host directory bind-mounted into the container, a Kubernetes volume) outlives it: a mount
    point, an nvidia.icd or a firmware file made there stays in the user's directory after the
    container is removed, with that container's label.

    Owned: the rootfs's own mount, and a fresh tmpfs (the runtime's /dev, the hook's own tmpfs,
    `--tmpfs`): mountinfo root '/', and its filesystem mounted nowhere in the hook's own namespace.
    Anything else is foreign: a bind of a host directory (root other than '/'), a disk filesystem,
    a host tmpfs bound whole. Decided from the kernel's mount table, never from config.json's
    mounts or a path: an image's symlink may lead anywhere.

    host_mountinfo: /proc/self/mountinfo opened before the child joined the container's mount
    namespace (the file keeps the namespace it was opened in); read only for a tmpfs, at most once.

    The hook's own tmpfs is told (own()) as it is made, not judged: judging it reads both mount
    tables again, about 1 ms with the hook's hundred mounts of an 8-GPU start, for the verdict
    a fresh tmpfs always gets."""

    def __init__(self, rootfs_fd: int, rootfs_path: str, host_mountinfo: int):
        self.root = mount_id(rootfs_fd)
        st = os.fstat(rootfs_fd)
        self.root_device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        self.rootfs_path = rootfs_path.rstrip("/")
        self.host_mountinfo = host_mountinfo
        self._host_text = None
        self._mounts: dict = {}  # mount id -> mountinfo.Mount, the container's namespace
        self._verdicts: dict = {self.root: ""}  # mount id -> "" (owned) or why not
        self._dirs: dict = {}  # (st_dev, st_ino) of a directory -> verdict
        self._own_devices: set = set()  # st_dev of each tmpfs the hook made (own())

    def own(self, mount_fd: int) -> None:
        """The mount open at mount_fd is a tmpfs the hook has just made: its filesystem is new
        (its device number too) and dies with the container."""
        self._own_devices.add(os.fstat(mount_fd).st_dev)

    def check(self, dir_fd: int, path: str) -> None:
        """Raise ForeignMount unless the directory open at dir_fd may receive a new entry."""
        st = os.fstat(dir_fd)
        if st.st_dev in self._own_devices:
            return
        verdict = self._dirs.get((st.st_dev, st.st_ino))
        if verdict is None:
            mnt = mount_id(dir_fd)
            if mnt not in self._verdicts:
                self._verdicts[mnt] = self._judge(mnt, f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
            verdict = self._dirs[st.st_dev, st.st_ino] = self._verdicts[mnt]
        if verdict:
            raise ForeignMount(errno.EXDEV, verdict, path)

    def _judge(self, mnt: int, device: str) -> str:
        from oci_gpu_hook.start.linux import mountinfo

        if mnt not in self._mounts:  # read again: the hook's own mounts are newer than any copy
            self._mounts = {m.mount_id: m for m in mountinfo.read()}
        mount = self._mounts.get(mnt)
        if mount is None:
            return "on a mount the kernel does not list"
        where = mount.mountpoint
        if where.startswith(self.rootfs_path + "/"):
            where = where[len(self.rootfs_path) :]
        volume = f"{where} is a volume from the host ({mount.fstype} {mount.root})"
        rootfs = self._mounts.get(self.root)
        if rootfs is not None and device == self.root_device and _within(mount.root, rootfs.root):
            return ""  # a part of the rootfs bound elsewhere in it: still the container's own
        if mount.root != "/" or mount.fstype not in ("tmpfs", "ramfs"):
            return volume
        if self._host_text is None:
            self._host_text = _read_all(self.host_mountinfo)
        wanted = device.encode()
        for line in self._host_text.split(b"\n"):  # a name may hold a bare \r, which splitlines() breaks at
            fields = line.split(None, 3)
            if len(fields) > 2 and fields[2] == wanted:
                return f"{where} is a host tmpfs ({mount.source}) bound whole"
        return ""


def _within(path: str, top: str) -> bool:
    return top == "/" or path == top or path.startswith(top.rstrip("/") + "/")


def _read_all(fd: int) -> bytes:
    chunks, offset = [], 0
    while True:
        chunk = os.pread(fd, 1 << 16, offset)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        offset += len(chunk)


def _split(path: str) -> list[str]:
    return [part for part in path.split("/") if part and part != "."]


class Rootfs:
    def __init__(self, path: str, labeler=None):
        self.path = path
        self.fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.labeler = labeler  # labels.Labeler when SELinux wants what we create labelled
        self.guard = None  # MountGuard when what is created must die with the container (the hook)
        self._dirs: dict = {}  # directory path's components -> descriptor kept in self._dirs_undo
        self._dirs_undo = None
        self._may_create: set = set()  # those descriptors the guard has let create (see may_create)

    def may_create(self, dir_fd: int, path: str) -> None:
        """Raise ForeignMount (nothing done) if a new entry in dir_fd would outlive the container."""
        if self.guard is None:
            return
        # A descriptor directory() keeps: its verdict holds for good (the guard judges the mount
        # it is on, which stays its mount) while the undo log holds it open (no closed number
        # reused for another directory: close() empties the log's fds).
        if dir_fd in self._may_create and self._dirs_undo.fds:
            return
        self.guard.check(dir_fd, path)
        if dir_fd in self._dirs.values():
            self._may_create.add(dir_fd)

    def created(self, dir_fd: int, name: str) -> None:
        if self.labeler is not None:
            self.labeler.label(dir_fd, name)

    def close(self) -> None:
        os.close(self.fd)

    # --- lookups ------------------------------------------------------------------------------

    def open(self, path: str, flags: int = _O_PATH) -> int:
        """A descriptor of path, symlinks resolved inside the rootfs. Raises OSError."""
        global _openat2_works
        if _openat2_works is not False:
            for attempt in range(OPENAT2_TRIES):
                try:
                    fd = _linux.openat2(
                        self.fd,
                        path.lstrip("/") or ".",
                        flags | os.O_CLOEXEC,
                        _linux.RESOLVE_IN_ROOT | _linux.RESOLVE_NO_MAGICLINKS,
                    )
                    _openat2_works = True
                    return fd
                except OSError as e:
                    # EAGAIN: a rename somewhere in the filesystem raced the lookup (RESOLVE_IN_ROOT
                    # refuses to guess); a bounded retry, as runc does, then give up.
                    if e.errno == errno.EAGAIN and attempt + 1 < OPENAT2_TRIES:
                        continue
                    if e.errno not in (errno.ENOSYS, errno.EPERM) or _openat2_works:
                        raise
                    _openat2_works = False
                    break
        fd = self._walk(path)
        if not flags & os.O_PATH:  # O_RDONLY is 0: any open without O_PATH reads (or writes) the file
            try:
                return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)
            finally:
                os.close(fd)
        return fd

    def _walk(self, path: str) -> int:
        """Resolve without openat2: never let the kernel follow a link; follow it here, in root."""
        parts = _split(path)
        stack = [os.dup(self.fd)]  # descriptors of the directories walked, for '..'
        links = 0
        try:
            while parts:
                name = parts.pop(0)
                if name == "..":
                    if len(stack) > 1:
                        os.close(stack.pop())
                    continue
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=stack[-1])
                mode = os.fstat(fd).st_mode
                if stat.S_ISLNK(mode):
                    target = os.readlink("", dir_fd=fd)
                    os.close(fd)
                    links += 1
                    if links > MAX_SYMLINKS:
                        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                    if target.startswith("/"):
                        for d in stack[1:]:
                            os.close(d)
                        del stack[1:]
                    parts = _split(target) + parts
                    continue
                if parts and not stat.S_ISDIR(mode):
                    os.close(fd)
                    raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
                stack.append(fd)
            return os.dup(stack[-1])
        finally:
            for d in stack:
                os.close(d)

    # --- creating -----------------------------------------------------------------------------

    def ensure_dir(self, path: str, undo: UndoLog) -> int:
        """O_PATH descriptor of directory path, creating missing components (recorded in undo)."""
        return os.dup(self.directory(path, undo))

    def directory(self, path: str, undo: UndoLog) -> int:
        """ensure_dir()'s descriptor of directory path, kept in undo (the caller must not close
        it), and remembered: the same directory asked for again with the same undo log (the
        thirty libraries and fifty symlinks of an 8-GPU start share a few directories) is not
        resolved again. A descriptor stays the directory it was resolved to; what could make the
        path name another one since is the hook's own doing, and forget_directories() is called
        for it: a mount onto a directory (which may cover a remembered one) and a replaced entry.
        Making a missing entry cannot: nothing remembered was resolved through a missing one."""
        key = tuple(_split(path))
        if self._dirs_undo is not undo or not undo.fds:  # another log, or this one closed
            self._dirs, self._dirs_undo, self._may_create = {}, undo, set()
        fd = self._dirs.get(key)
        if fd is None:
            fd = self._dirs[key] = undo.keep_fd(self._ensure_dir(path, undo))
        return fd

    def forget_directories(self) -> None:
        """The rootfs's tree may have changed (see directory()): resolve every directory again."""
        self._dirs = {}

    def _ensure_dir(self, path: str, undo: UndoLog) -> int:
        try:
            fd = self.open(path)
        except FileNotFoundError:
            parent, name = os.path.split(path.rstrip("/"))
            parent_fd = self.directory(parent or "/", undo)
            self.may_create(parent_fd, path)
            undo.intend("dir", path)
            try:
                os.mkdir(name, 0o755, dir_fd=parent_fd)
            except FileExistsError:
                # A dangling symlink: it points nowhere inside the rootfs; never create its target.
                raise OSError(errno.EEXIST, "a dangling symlink or a race is in the way", path) from None
            undo.add(f"remove directory {path}", lambda: os.rmdir(name, dir_fd=parent_fd))
            self.created(parent_fd, name)
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent_fd)
            return fd
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.ENOTDIR, "not a directory", path)
        return fd

    def ensure_target(self, path: str, directory: bool, mode: int, undo: UndoLog, device=None) -> int:
        """O_PATH descriptor of a mount target: an existing file/dir of the right type, or a new
        empty one made with mode (recorded in undo). With device=(major, minor), a character
        device node of exactly those numbers is right too: the runtime made it (linux.devices,
        `podman --device`, a device plugin's device specs) and mounting over it is harmless."""
        if directory:
            return self.ensure_dir(path, undo)
        try:
            fd = self.open(path)
        except FileNotFoundError:
            parent, name = os.path.split(path)
            return self._new_file(self.directory(parent, undo), name, path, mode, undo)
        return self._existing_target(fd, os.fstat(fd), path, device)

    def ensure_target_in(self, path: str, mode: int, undo: UndoLog, device=None):
        """ensure_target() of a file target, and the directory it is in: (descriptor of the
        parent directory, kept in undo; the target's name; descriptor of the target). The parent
        is resolved once, inside the rootfs, and the target is its entry (O_NOFOLLOW): a mount
        needs both, and resolving the path again for the parent would walk every component
        twice. An entry that is a symlink is resolved as ensure_target() resolves it (the
        mount's check of the entry then refuses it)."""
        parent, name = os.path.split(path)
        parent_fd = self.directory(parent, undo)
        try:
            fd = os.open(name, _O_PATH | os.O_NOFOLLOW, dir_fd=parent_fd)
        except FileNotFoundError:
            return parent_fd, name, self._new_file(parent_fd, name, path, mode, undo)
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):
            os.close(fd)
            return parent_fd, name, self.ensure_target(path, False, mode, undo, device)
        return parent_fd, name, self._existing_target(fd, st, path, device)

    def _new_file(self, parent_fd: int, name: str, path: str, mode: int, undo: UndoLog) -> int:
        """An empty file made with mode at name in the directory open at parent_fd (a descriptor
        the undo log keeps: its removal goes through it); its O_PATH descriptor."""
        self.may_create(parent_fd, path)
        undo.intend("file", path)
        try:
            created = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent_fd
            )
        except FileExistsError:
            raise OSError(errno.EEXIST, "a dangling symlink or a race is in the way", path) from None
        os.fchmod(created, mode)  # the umask must not change what the source's mode says
        os.close(created)
        undo.add(f"remove file {path}", lambda: os.unlink(name, dir_fd=parent_fd))
        self.created(parent_fd, name)
        return os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)

    @staticmethod
    def _existing_target(fd: int, st, path: str, device) -> int:
        """fd (closed unless returned) if what it names may be mounted onto as a file target."""
        st_mode = st.st_mode
        if device is not None and stat.S_ISCHR(st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == device:
            return fd
        if not stat.S_ISREG(st_mode):
            os.close(fd)
            what = "a directory" if stat.S_ISDIR(st_mode) else "not a regular file"
            raise OSError(errno.EEXIST, f"is {what}, expected a file", path)
        return fd

    def ensure_symlink(self, path: str, value: str, undo: UndoLog) -> str:
        """Create symlink path -> value; returns 'created', 'present' or 'kept' (the image's own
        file stays: an image may ship its own library on purpose)."""
        parent, name = os.path.split(path)
        parent_fd = self.directory(parent, undo)
        try:
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            self.may_create(parent_fd, path)
            undo.intend("symlink", path, value)
            os.symlink(value, name, dir_fd=parent_fd)
            undo.add(f"remove symlink {path}", lambda: os.unlink(name, dir_fd=parent_fd))
            self.created(parent_fd, name)
            return "created"
        if stat.S_ISLNK(st.st_mode) and os.readlink(name, dir_fd=parent_fd) == value:
            return "present"
        return "kept"

    def replace_file(self, directory: str, dir_fd: int, name: str, data: bytes, mode: int, undo: UndoLog) -> None:
        """Put a new file with data at name in the directory open at dir_fd, by rename: whatever
        is there (a device node, FIFO, hard link or symlink the image planted) is replaced as a
        directory entry, never opened or written through. Undone by swapping the old entry back."""
        temporary = f".{name}.oci-gpu-hook-{os.getpid()}"
        self.forget_directories()  # the entry replaced may have been a symlink to a directory
        self.may_create(dir_fd, f"{directory.rstrip('/')}/{name}")
        undo.intend("temp", f"{directory.rstrip('/')}/{temporary}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temporary, flags, mode, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                os.fchmod(f.fileno(), mode)  # the umask must not decide who may read it
            self.created(dir_fd, temporary)
            try:
                old = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                old = None
            if old is None:
                os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            elif stat.S_ISDIR(old.st_mode):
                raise OSError(errno.EISDIR, "a directory is in the way", name)
            else:
                _linux.renameat2(dir_fd, temporary, dir_fd, name, _linux.RENAME_EXCHANGE)
        except BaseException:
            try:
                os.unlink(temporary, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        if old is None:
            undo.add(f"remove {name}", lambda: os.unlink(name, dir_fd=dir_fd))
            return

        def swap_back():
            _linux.renameat2(dir_fd, temporary, dir_fd, name, _linux.RENAME_EXCHANGE)
            os.unlink(temporary, dir_fd=dir_fd)

        undo.add(f"put the image's {name} back", swap_back)
        undo.on_commit.append(lambda: os.unlink(temporary, dir_fd=dir_fd))  # the image's old entry


def directories(rootfs: str, paths) -> dict:
    """{path: (st_dev, st_ino) of the directory the image resolves it to, or None} for each path,
    resolved inside the rootfs (an absent rootfs: all None)."""
    found = dict.fromkeys(paths)
    try:
        root = Rootfs(rootfs)
    except OSError:
        return found
    try:
        for path in paths:
            try:
                fd = root.open(path)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    found[path] = (st.st_dev, st.st_ino)
            finally:
                os.close(fd)
    finally:
        root.close()
    return found
