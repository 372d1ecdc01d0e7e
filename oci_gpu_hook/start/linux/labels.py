"""SELinux labels for what the hook creates inside a container.

Files, directories and symlinks the hook makes in the rootfs get the container's
linux.mountLabel, so the confined container may use them; a tmpfs gets it through a context=
mount option. Host files mounted into the container keep their own labels: the hook never
relabels anything on the host. With SELinux disabled nothing happens (and libselinux is not even
loaded, which keeps the start path light).

libselinux is called directly (ctypes, in _linux.py): the PyPI `selinux` package is only a shim
that, on RHEL, starts the system Python to find the real bindings (tens of milliseconds on every
container start) and, on Debian, offers stubs.
"""

from __future__ import annotations

import os

from oci_gpu_hook.errors import Exit, HookError
from oci_gpu_hook.start.linux import _linux


class LabelError(HookError):
    exit_code = Exit.LABEL


def selinux_enabled() -> bool:
    """What libselinux says about the running kernel (the one query tests may stand in for)."""
    if not os.path.exists("/sys/fs/selinux/enforce"):
        return False
    return _linux.is_selinux_enabled()


class Labeler:
    """Labels created objects, addressed by (directory descriptor, name), never by a re-walked path."""

    def __init__(self, context: str):
        self.context = context

    def label(self, dir_fd: int, name: str) -> None:
        # lsetfilecon on /proc/self/fd/<dir>/<name>: the directory through its descriptor, the
        # final component not followed, so a symlink is labelled itself and never its target.
        path = f"/proc/self/fd/{dir_fd}/{name}"
        try:
            _linux.lsetfilecon(path, self.context)
        except OSError as e:
            raise LabelError(f"cannot label {name} with {self.context}: {e.strerror or e}") from None

    def tmpfs_option(self) -> str:
        return f',context="{self.context}"'


def labeler_for(mount_label: str | None) -> Labeler | None:
    if not mount_label or not selinux_enabled():
        return None
    return Labeler(mount_label)
