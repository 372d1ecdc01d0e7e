"""Where a test puts what another user's process must reach (a rootless podman's user, uid 65534):
a directory every user may enter, whose every ancestor only root can change.

Not under /tmp: a hook in a user namespace cannot tell root's entries of a directory every user
may write from another user's (start/linux/sources.py), so it takes nothing from there, and a test
whose simulated host lay in /tmp passed only where /tmp was not mode 1777 (issue 46: a machine's
/tmp is 1777 as Debian leaves it, or 0755 in some sandboxes). Not under pytest's tmp_path either:
it lies in root's 0700 /tmp/pytest-of-root, where no user may go. So the directory is made where
root alone can change the way to it, and that is checked, not assumed: a test fails with the
reason where no such place exists.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile

import leftovers

# Tried in this order: each is root's and 0755 on Debian and RHEL, and on the root file system,
# where programs may run (/run is mounted noexec on most hosts, and the rootless podman tests lay an
# overlay over /var/lib, which would hide what their hooks write from the test).
PLACES = ("/srv", "/opt", "/var/lib")


def _only_root_changes(path: str) -> str | None:
    """Why path, or a directory above it, is not changed by root alone and entered by all; None
    when it is."""
    while True:
        try:
            st = os.lstat(path)
        except OSError as e:
            return f"{path}: {e.strerror}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{path}: not a directory (a link, say)"
        if st.st_uid != 0 or st.st_mode & 0o022:
            return f"{path}: owned by uid {st.st_uid} with mode {st.st_mode & 0o7777:04o}, not root's alone"
        if not st.st_mode & 0o001:
            return f"{path}: mode {st.st_mode & 0o7777:04o}, closed to other users"
        if path == "/":
            return None
        path = os.path.dirname(path)


def place() -> str:
    """The first of PLACES that root alone can change, every user may enter and programs may run
    from; AssertionError
        with each one's reason where none is."""
    reasons = []
    for candidate in PLACES:
        why = _only_root_changes(candidate)
        if why is None and os.statvfs(candidate).f_flag & os.ST_NOEXEC:
            why = f"{candidate}: on a file system mounted noexec"
        if why is None:
            return candidate
        reasons.append(why)
    raise AssertionError("no directory that root alone can change for another user's files: " + "; ".join(reasons))


@contextlib.contextmanager
def shared_directory(prefix: str):
    """A new directory, mode 0755, in place(); removed afterwards."""
    top = tempfile.mkdtemp(prefix=prefix, dir=place())
    try:
        os.chmod(top, 0o755)
        assert _only_root_changes(top) is None, _only_root_changes(top)
        yield top
    finally:
        leftovers.remove_directory(top)  # with the compiled settings of its configurations


@contextlib.contextmanager
def rootless_world(prefix: str):
    """(top, the simulated host's summary) for a rootless podman test: a shared_directory holding a
    simulated 4-GPU host (top/host, minors scrambled) and a busybox rootfs (top/rootfs), which the
    test's user reaches as root's files on the way."""
    from oci_gpu_hook.toolkit import containers
    from oci_gpu_hook.toolkit.simulate import simulate

    with shared_directory(prefix) as top:
        host = simulate(f"{top}/host", gpus=4, scramble_minors=True)
        containers.make_rootfs(f"{top}/rootfs")
        yield top, host
