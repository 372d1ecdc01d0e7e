"""/proc/<pid>/mountinfo: the one parser (cgroup paths, doctor, the simulated host's checks).

Standard library only and no `re`: apply reads it on every GPU start to find the container's cgroup.
"""

from __future__ import annotations


class Mount:
    """One mountinfo line; root and mountpoint unescaped."""

    __slots__ = ("mount_id", "root", "mountpoint", "fstype", "source", "super_options")

    def __init__(self, mount_id: int, root: str, mountpoint: str, fstype: str, source: str, super_options: tuple):
        self.mount_id, self.root, self.mountpoint = mount_id, root, mountpoint
        self.fstype, self.source, self.super_options = fstype, source, super_options


def unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo (octal)."""
    if "\\" not in field:
        return field  # nearly every field: no copy, character by character
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1 : i + 4]) == 3 and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse(text: str) -> list[Mount]:
    """The mounts of a mountinfo text, in its order; malformed lines are skipped."""
    mounts = []
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, post_fields = pre.split(), post.split()
        if not sep or len(fields) < 5 or not post_fields or not fields[0].isdigit():
            continue
        options = tuple(post_fields[2].split(",")) if len(post_fields) >= 3 else ()
        source = unescape(post_fields[1]) if len(post_fields) >= 2 else ""
        mounts.append(Mount(int(fields[0]), unescape(fields[3]), unescape(fields[4]), post_fields[0], source, options))
    return mounts


def read(path: str = "/proc/self/mountinfo") -> list[Mount]:
    with open(path) as f:
        return parse(f.read())
