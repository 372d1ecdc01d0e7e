"""Device access in the container's cgroup: which hierarchy, and the rules.

cgroup v1: the devices controller's devices.allow/devices.deny files. The container's cgroup is
its `devices` line in /proc/<pid>/cgroup, joined to where this process sees that hierarchy
mounted (mountinfo). A rule the cgroup already grants is not written (so there is nothing to
undo): writing it and then denying it on rollback would take away access the cgroup had before,
from the whole host if the cgroup is the root. cgroup v2 (eBPF device programs): bpf.py.
"""

from __future__ import annotations

import os

from oci_gpu_hook.errors import Exit, HookError
from oci_gpu_hook.start import files
from oci_gpu_hook.start.linux import mountinfo


class CgroupError(HookError):
    exit_code = Exit.CGROUP


def read_cgroup_file(pid: int, proc: str = "/proc") -> str:
    try:
        with open(f"{proc}/{pid}/cgroup", "rb") as f:
            return os.fsdecode(f.read())  # a cgroup's name is bytes too (mountinfo.read_text)
    except OSError as e:
        raise CgroupError(f"{proc}/{pid}/cgroup: {e.strerror} (has the container process exited?)") from None


def detect_version(cgroup_text: str) -> str:
    """'v1' (devices controller present, pure v1 or hybrid), 'v2' (unified only) or 'none'."""
    v2 = False
    for line in cgroup_text.splitlines():
        _, controllers, _ = (line.split(":", 2) + ["", ""])[:3]
        if "devices" in controllers.split(","):
            return "v1"
        if line.startswith("0::"):
            v2 = True
    return "v2" if v2 else "none"


def identity(cgroup_text: str) -> str | None:
    """The cgroup that tells a container's processes from everyone else's, from /proc/<pid>/cgroup
    text: the devices controller's path where a v1 devices hierarchy is in use (hybrid hosts keep
    "0::/" for everything there), else the unified "0::" path. None for the root cgroup, which
    holds host processes too: nothing may be attributed by it."""
    unified = None
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "devices" in parts[1].split(","):
            return parts[2] if parts[2].startswith("/") and parts[2] != "/" else None
        if parts[0] == "0" and parts[1] == "":
            unified = parts[2]
    return unified if unified and unified.startswith("/") and unified != "/" else None


def is_within(cgroup: str, container_cgroup: str) -> bool:
    """A process's cgroup (identity()) lies in a container's: the same one or below it."""
    return cgroup == container_cgroup or cgroup.startswith(container_cgroup.rstrip("/") + "/")


def _where_mounted(relative: str, mountinfo_text: str, fstype: str, option: str | None = None) -> str | None:
    """Where this process sees the cgroup relative (a path inside a hierarchy) of a hierarchy of
    fstype (and, for v1, with option among its super options) mounted."""
    # Only that type's lines are parsed: apply reads the container's whole mount table on every GPU
    # start, mostly other mounts (" - " is the separator alone: mountinfo escapes spaces in paths).
    wanted = f" - {fstype} "
    lines = "\n".join(line for line in mountinfo_text.split("\n") if wanted in line)
    for mount in mountinfo.parse(lines):
        if mount.fstype != fstype or (option is not None and option not in mount.super_options):
            continue
        root = mount.root
        # The mount may show a sub-tree (a cgroup namespace, a bind mount): the path must lie below.
        if relative == root or relative.startswith(root.rstrip("/") + "/"):
            return os.path.normpath(os.path.join(mount.mountpoint, os.path.relpath(relative, root)))
    return None


def mounted_hierarchies(mountinfo_text: str) -> tuple[bool, bool]:
    """(a v1 hierarchy with the devices controller is mounted, a cgroup2 one is): the host's
    cgroup setup as doctor reports it (both: hybrid)."""
    mounts = mountinfo.parse(mountinfo_text)
    v1 = any(m.fstype == "cgroup" and "devices" in m.super_options for m in mounts)
    return v1, any(m.fstype == "cgroup2" for m in mounts)


def v1_devices_path(cgroup_text: str, mountinfo_text: str) -> str | None:
    """Directory of the container's v1 devices cgroup as seen from this process."""
    relative = None
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "devices" in parts[1].split(","):
            relative = parts[2]
    if relative is None:
        return None
    return _where_mounted(relative, mountinfo_text, "cgroup", "devices")


def v2_path(cgroup_text: str, mountinfo_text: str) -> str | None:
    """Directory of a process's cgroup v2 as seen from this process: its "0::/path" line in
    /proc/<pid>/cgroup joined to where cgroup2 is mounted here (/sys/fs/cgroup on pure v2 hosts,
    /sys/fs/cgroup/unified on hybrid ones). None without a 0:: line or a cgroup2 mount holding it."""
    relative = None
    for line in cgroup_text.splitlines():
        if line.startswith("0::"):
            relative = line[3:]
    if relative is None or not relative.startswith("/"):
        return None
    return _where_mounted(relative, mountinfo_text, "cgroup2")


def v1_rule(major: int, minor: int, access: str) -> str:
    return f"c {major}:{minor} {access}"


def v1_granted(devices_list: str, major: int, minor: int, access: str) -> bool:
    """Whether a v1 devices.list already lets char major:minor be used with access. In a cgroup
    whose default is to allow (the root, a privileged container's), the list shows `a *:* rwm`."""
    for line in devices_list.splitlines():
        parts = line.split()
        if len(parts) != 3 or parts[0] not in ("a", "c"):
            continue
        rule_major, _, rule_minor = parts[1].partition(":")
        if (rule_major in ("*", str(major)) and rule_minor in ("*", str(minor))
                and set(access) <= set(parts[2])):  # fmt: skip
            return True
    return False


def read_v1(directory: str, name: str) -> str:
    try:
        # Truncating is safe here: a rule missed in a longer devices.list is written again.
        return files.read_bounded(os.path.join(directory, name), 1 << 20)[: 1 << 20].decode("utf-8", "replace")
    except OSError as e:
        raise CgroupError(f"{directory}/{name}: {e.strerror}") from None


def write_v1(directory: str, name: str, rule: str) -> None:
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.write(fd, rule.encode())
        finally:
            os.close(fd)
    except OSError as e:
        raise CgroupError(f"{path}: cannot write '{rule}': {e.strerror}") from None
