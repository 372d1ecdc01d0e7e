"""Device access in the container's cgroup: which hierarchy, and the rules.

cgroup v1: the devices controller's devices.allow/devices.deny files. The container's cgroup is
its `devices` line in /proc/<pid>/cgroup, joined to where this process sees that hierarchy
mounted (mountinfo). cgroup v2 (eBPF device programs) is not handled yet.
"""

from __future__ import annotations

import os

from .errors import HookError


class CgroupError(HookError):
    exit_code = 9


def read_cgroup_file(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return f.read()
    except OSError as e:
        raise CgroupError(f"/proc/{pid}/cgroup: {e.strerror} (has the container process exited?)") from None


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


def v1_devices_path(cgroup_text: str, mountinfo_text: str) -> str | None:
    """Directory of the container's v1 devices cgroup as seen from this process."""
    relative = None
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "devices" in parts[1].split(","):
            relative = parts[2]
    if relative is None:
        return None
    for line in mountinfo_text.splitlines():
        fields = line.split()
        if " - " not in line:
            continue
        pre, post = line.split(" - ", 1)
        post_fields = post.split()
        if len(post_fields) >= 3 and post_fields[0] == "cgroup" and "devices" in post_fields[2].split(","):
            root, mountpoint = fields[3], fields[4].replace("\\040", " ")
            # The hierarchy may be mounted at a sub-cgroup; the container's path must lie below it.
            if relative == root or relative.startswith(root.rstrip("/") + "/"):
                return os.path.join(mountpoint, os.path.relpath(relative, root))
    return None


def v1_rule(major: int, minor: int, access: str) -> str:
    return f"c {major}:{minor} {access}"


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
