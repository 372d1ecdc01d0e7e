"""Refresh a container's ld.so.cache with the host's ldconfig, confined to the rootfs.

Never a binary from the image: the host's ldconfig (static on Debian and RHEL) runs with
`-r ROOTFS`, so it chroots into the rootfs before reading anything there. The child gets an empty
environment, no new privileges, only the capabilities chroot and file updates need, its own IPC
namespace, and resource limits; the image's LD_PRELOAD or ld.so.conf cannot reach the host.
"""

import os
import resource
import subprocess
from typing import Sequence

from . import _linux
from .errors import HookError

LDCONFIG_PATHS = ("/sbin/ldconfig", "/usr/sbin/ldconfig")
# chroot, plus writing ld.so.cache and links in an image whose files root may not own.
KEPT_CAPABILITIES = ("sys_chroot", "dac_override", "dac_read_search", "fowner", "chown")
LIMITS = {
    resource.RLIMIT_CPU: 20,
    resource.RLIMIT_AS: 1 << 30,
    resource.RLIMIT_FSIZE: 256 << 20,
    resource.RLIMIT_NOFILE: 1024,
    resource.RLIMIT_CORE: 0,
}


class LdconfigError(HookError):
    exit_code = 10


def host_ldconfig() -> str:
    for path in LDCONFIG_PATHS:
        if os.access(path, os.X_OK):
            return path
    raise LdconfigError("the host has no ldconfig (/sbin/ldconfig); it is needed to refresh the container's ld cache")


def _confine() -> None:
    """Runs in the forked child before exec: drop everything ldconfig does not need."""
    import prctl

    _linux.unshare(_linux.CLONE_NEWIPC)
    for limit, value in LIMITS.items():
        resource.setrlimit(limit, (value, value))
    keep = {getattr(prctl, f"CAP_{name.upper()}") for name in KEPT_CAPABILITIES}
    for cap in prctl.ALL_CAPS:
        if cap not in keep:
            prctl.capbset_drop(cap)
    # Effective must stay a subset of permitted at every step: lower it first.
    prctl.cap_effective.limit(*keep)
    prctl.cap_inheritable.limit()
    prctl.cap_permitted.limit(*keep)
    prctl.set_no_new_privs(True)


def refresh(rootfs_fd: int, directories: Sequence[str], timeout: float = 20.0) -> None:
    """Run ldconfig for the rootfs open at rootfs_fd (it chroots through /proc/self/fd/N, so the
    rootfs is the one the hook resolved, not a path looked up again)."""
    rootfs = f"/proc/self/fd/{rootfs_fd}"
    argv = [host_ldconfig(), "-r", rootfs, *directories]
    try:
        result = subprocess.run(
            argv,
            env={},
            cwd="/",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            preexec_fn=_confine,
            pass_fds=(rootfs_fd,),
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise LdconfigError(f"ldconfig did not finish within {timeout:.0f} s") from None
    except subprocess.SubprocessError as e:
        raise LdconfigError(f"ldconfig could not start: {e}") from None
    if result.returncode != 0:
        lines = result.stderr.decode("utf-8", "replace").strip().splitlines()
        raise LdconfigError(f"ldconfig failed: {lines[-1] if lines else f'exit {result.returncode}'}")
