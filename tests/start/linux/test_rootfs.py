"""rootfs.py's lookups of mount targets and its MountGuard, on real directories and mounts (a
private mount namespace of a forked child for the mounts)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from oci_gpu_hook.start.linux import _linux
from oci_gpu_hook.start.linux.rootfs import ForeignMount, MountGuard, Rootfs, UndoLog


def identity(fd_or_path) -> tuple:
    st = os.fstat(fd_or_path) if isinstance(fd_or_path, int) else os.stat(fd_or_path, follow_symlinks=False)
    return st.st_dev, st.st_ino


@pytest.fixture
def image(tmp_path):
    root = tmp_path / "rootfs"
    (root / "usr/lib").mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")  # a directory reached through the image's own link
    (root / "usr/lib/present.so").write_bytes(b"")
    (root / "usr/lib/elsewhere.so").write_bytes(b"")
    (root / "usr/lib/link.so").symlink_to("/usr/lib/elsewhere.so")
    rootfs, undo = Rootfs(str(root)), UndoLog()
    yield root, rootfs, undo
    undo.close()
    rootfs.close()


def test_a_file_target_is_found_in_its_directory_resolved_once(image):
    """ensure_target_in: the target's directory resolved inside the rootfs (through the image's
    /lib link), the existing file its entry there; the parent descriptor is the undo log's."""
    root, rootfs, undo = image
    parent, name, fd = rootfs.ensure_target_in("/lib/present.so", 0o644, undo)
    try:
        assert name == "present.so" and parent in undo.fds
        assert identity(parent) == identity(str(root / "usr/lib"))
        assert identity(fd) == identity(str(root / "usr/lib/present.so"))
    finally:
        os.close(fd)


def test_a_missing_file_target_is_made_with_the_mode_and_undone(image):
    root, rootfs, undo = image
    parent, name, fd = rootfs.ensure_target_in("/usr/lib/new.so", 0o751, undo)
    os.close(fd)
    made = root / "usr/lib/new.so"
    assert stat.S_IMODE(made.stat().st_mode) == 0o751 and made.stat().st_size == 0
    assert undo.rollback() == [] and not made.exists()


def test_a_symlink_entry_is_resolved_as_ensure_target_resolves_it(image):
    """The image's link at the target: the same file ensure_target gives (inside the rootfs),
    which the mount's own check then refuses as not the entry (nothing is created)."""
    root, rootfs, undo = image
    parent, name, fd = rootfs.ensure_target_in("/usr/lib/link.so", 0o644, undo)
    old = rootfs.ensure_target("/usr/lib/link.so", False, 0o644, undo)
    try:
        assert identity(fd) == identity(old) == identity(str(root / "usr/lib/elsewhere.so"))
        assert identity(fd) != os.stat(name, dir_fd=parent, follow_symlinks=False)[1:3][::-1]
    finally:
        os.close(fd)
        os.close(old)
    assert undo.rollback() == []


@pytest.mark.parametrize("what", ["a directory", "a fifo"])
def test_a_target_of_the_wrong_type_is_refused(image, what):
    root, rootfs, undo = image
    path = root / "usr/lib/wrong.so"
    path.mkdir() if what == "a directory" else os.mkfifo(path)
    with pytest.raises(OSError, match="expected a file"):
        rootfs.ensure_target_in("/usr/lib/wrong.so", 0o644, undo)


def _in_a_private_namespace(body) -> dict:
    """body(result, host_mountinfo) run in a forked child with a mount namespace of its own (the
    host's mount table opened first, in the test's namespace, as apply opens the hook's before
    joining the container's); the dict it fills, or {"error": ...} with what it raised."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        result = {}
        try:
            os.close(read_end)
            host_mountinfo = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
            _linux.unshare(_linux.CLONE_NEWNS)
            _linux.mount(None, "/", None, _linux.MS_REC | _linux.MS_PRIVATE)
            body(result, host_mountinfo)
        except BaseException as e:  # reported to the test, which fails with it
            result["error"] = repr(e)
        finally:
            os.write(write_end, json.dumps(result).encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def _guard_in_a_private_namespace(directory: str, own: bool) -> dict:
    """A fresh tmpfs on directory, which the guard is told of (own) or not; whether a file may be
    made in it, and which mount tables the guard read."""

    def body(result, host_mountinfo):
        os.makedirs(f"{directory}/rootfs/tmp", exist_ok=True)
        rootfs = Rootfs(f"{directory}/rootfs")
        _linux.mount(directory, directory, None, _linux.MS_BIND)  # the rootfs's own mount
        rootfs.close()
        rootfs = Rootfs(f"{directory}/rootfs")
        guard = MountGuard(rootfs.fd, rootfs.path, host_mountinfo)
        target = rootfs.open("/tmp")
        _linux.mount("tmpfs", f"/proc/self/fd/{target}", "tmpfs", 0, "mode=0755")
        mounted = rootfs.open("/tmp")
        if own:
            guard.own(mounted)
        try:
            guard.check(mounted, "/tmp")
            result["verdict"] = "owned"
        except ForeignMount as e:
            result["verdict"] = e.strerror
        result["read_container_table"] = bool(guard._mounts)
        result["read_host_table"] = guard._host_text is not None

    return _in_a_private_namespace(body)


@pytest.mark.parametrize("own", [True, False])
def test_the_hooks_own_tmpfs_is_owned_without_reading_the_mount_tables(tmp_path, require, own):
    """A tmpfs the hook made is the container's own either way; told of it (apply does, as it
    mounts one), the guard reads neither mount table (about 1 ms with an 8-GPU start's mounts)."""
    require("root")
    result = _guard_in_a_private_namespace(str(tmp_path), own)
    assert "error" not in result, result["error"] if "error" in result else ""
    assert result["verdict"] == "owned"
    assert result["read_container_table"] == result["read_host_table"] == (not own)


def test_entries_in_one_directory_share_its_descriptor_resolved_once(image):
    """An 8-GPU start makes some ninety targets and symlinks in a few directories: each directory
    is resolved once per undo log (its descriptor kept there), not once per entry; what is made
    through it is undone through it."""
    root, rootfs, undo = image
    first, _, a = rootfs.ensure_target_in("/usr/lib/a.so", 0o644, undo)
    kept = len(undo.fds)
    second, _, b = rootfs.ensure_target_in("/usr/lib/b.so", 0o644, undo)
    assert rootfs.ensure_symlink("/usr/lib/a.so.1", "a.so", undo) == "created"
    os.close(a)
    os.close(b)
    assert first == second and len(undo.fds) == kept
    assert identity(first) == identity(str(root / "usr/lib"))
    other = UndoLog()  # another start's log: never a descriptor the first one closes
    try:
        third, _, c = rootfs.ensure_target_in("/usr/lib/c.so", 0o644, other)
        os.close(c)
        assert third in other.fds and third not in undo.fds
        assert other.rollback() == []
    finally:
        other.close()
    assert undo.rollback() == []
    assert sorted(os.listdir(root / "usr/lib")) == ["elsewhere.so", "link.so", "present.so"]


def test_a_closed_undo_logs_directories_are_resolved_again(image):
    """The remembered descriptors are the undo log's: once it has closed them, their numbers may
    name anything, so a directory asked for again is resolved again."""
    root, rootfs, undo = image
    rootfs.directory("/usr/lib", undo)
    undo.close()
    fd = rootfs.directory("/usr/lib", undo)
    assert fd in undo.fds and identity(fd) == identity(str(root / "usr/lib"))


def _guard_checks_in_a_private_namespace(directory: str) -> dict:
    """A rootfs with a volume (a host directory bound at /vol); two files made in /usr/lib and two
    tried in /vol, through a guard whose checks are counted."""

    def body(result, host_mountinfo):
        for made in ("rootfs/usr/lib", "rootfs/vol", "volume"):
            os.makedirs(f"{directory}/{made}")
        _linux.mount(f"{directory}/rootfs", f"{directory}/rootfs", None, _linux.MS_BIND)
        _linux.mount(f"{directory}/volume", f"{directory}/rootfs/vol", None, _linux.MS_BIND)
        rootfs, undo = Rootfs(f"{directory}/rootfs"), UndoLog()
        guard = rootfs.guard = MountGuard(rootfs.fd, rootfs.path, host_mountinfo)
        checked = []
        judge = guard.check
        guard.check = lambda fd, path: (checked.append(path), judge(fd, path))[1]
        for name in ("a.so", "b.so"):
            os.close(rootfs.ensure_target_in(f"/usr/lib/{name}", 0o644, undo)[2])
        rootfs.ensure_symlink("/usr/lib/a.so.1", "a.so", undo)
        result["checked"] = list(checked)
        result["refused"] = []
        for name in ("a", "b"):
            try:
                rootfs.ensure_target_in(f"/vol/{name}", 0o644, undo)
            except ForeignMount as e:
                result["refused"].append(e.filename)
        result["volume"] = os.listdir(f"{directory}/volume")
        result["rollback"] = undo.rollback()
        undo.close()

    return _in_a_private_namespace(body)


def test_the_guard_judges_a_remembered_directory_once_and_a_volume_every_time(tmp_path, require):
    """A directory the rootfs remembers is judged once (its descriptor stays on its mount); a
    refusal is not remembered: each entry the hook would make in a volume is refused."""
    require("root")
    result = _guard_checks_in_a_private_namespace(str(tmp_path))
    assert "error" not in result, result["error"] if "error" in result else ""
    assert result["checked"] == ["/usr/lib/a.so"]
    assert result["refused"] == ["/vol/a", "/vol/b"]
    assert result["volume"] == [] and result["rollback"] == []


ODD = b"\xff\xfe-lib"  # a directory name that is not UTF-8 (issue 46, item 7)


def _odd_link_in_a_private_namespace(directory: str, openat2: bool) -> dict:
    """A rootfs whose /usr/lib64 is a link to usr/b'\\xff\\xfe-lib', its own mount: a library
    target and its symlink made through the link, a file bound onto the target (the mount table
    then names the odd directory), and a fresh tmpfs at /dev judged by the guard afterwards (it
    reads that table); openat2 False: the O_NOFOLLOW walk of kernels without it."""
    from oci_gpu_hook.start.linux import mountinfo
    from oci_gpu_hook.start.linux import rootfs as rootfs_module

    def body(result, host_mountinfo):
        top = os.fsencode(directory)
        os.makedirs(top + b"/rootfs/usr/" + ODD)
        os.makedirs(top + b"/rootfs/dev")
        os.symlink(ODD, top + b"/rootfs/usr/lib64")
        with open(top + b"/host-library", "wb") as f:
            f.write(b"the driver's library\n")
        _linux.mount(f"{directory}/rootfs", f"{directory}/rootfs", None, _linux.MS_BIND)
        rootfs_module._openat2_works = None if openat2 else False
        rootfs, undo = Rootfs(f"{directory}/rootfs"), UndoLog()
        rootfs.guard = MountGuard(rootfs.fd, rootfs.path, host_mountinfo)
        parent, name, target = rootfs.ensure_target_in("/usr/lib64/libcuda.so.1", 0o644, undo)
        source = os.open(f"{directory}/host-library", os.O_PATH | os.O_CLOEXEC)
        _linux.mount(f"/proc/self/fd/{source}", f"/proc/self/fd/{target}", None, _linux.MS_BIND)
        result["symlink"] = rootfs.ensure_symlink("/usr/lib64/libcuda.so", "libcuda.so.1", undo)
        dev = rootfs.open("/dev")
        _linux.mount("tmpfs", f"/proc/self/fd/{dev}", "tmpfs", 0, "mode=0755")
        fresh = rootfs.open("/dev")
        rootfs.guard.check(fresh, "/dev")  # judged from the mount table, which holds the odd name
        result["dev"] = "may create"
        odd = os.fsdecode(b"/usr/" + ODD + b"/libcuda.so.1")  # a name as os.fsdecode gives it
        with open(rootfs.open(odd, os.O_RDONLY), "rb") as f:
            result["read through the odd name"] = f.read().decode()
        mounted = os.fsdecode(top + b"/rootfs/usr/" + ODD + b"/libcuda.so.1")
        result["listed"] = mounted in [m.mountpoint for m in mountinfo.read()]
        result["entries"] = sorted(os.fsencode(n).hex() for n in os.listdir(top + b"/rootfs/usr/" + ODD))
        for fd in (target, source, dev, fresh):
            os.close(fd)
        undo.close()
        rootfs.close()

    return _in_a_private_namespace(body)


@pytest.mark.parametrize("openat2", [True, False], ids=["openat2", "walk"])
def test_a_link_to_a_directory_with_a_non_utf8_name_is_used_as_any_other(tmp_path, require, openat2):
    """Names in a rootfs are bytes: /usr/lib64 -> b'\\xff\\xfe-lib' gets the library and its
    symlink in that directory, a path naming it opens, and the mount table that then lists it
    is read (the guard's verdict on /dev): nothing decodes a name strictly (case X3 failed the
    start with UnicodeDecodeError there)."""
    require("root")
    result = _odd_link_in_a_private_namespace(str(tmp_path), openat2)
    assert "error" not in result, result["error"] if "error" in result else ""
    assert result["symlink"] == "created" and result["dev"] == "may create"
    assert result["read through the odd name"] == "the driver's library\n"
    assert result["listed"]
    assert result["entries"] == sorted(n.hex() for n in (b"libcuda.so", b"libcuda.so.1"))
