"""/proc/<pid>/mountinfo: the one parser (cgroup paths, doctor, the simulated host's checks).

Standard library only and no `re`: apply reads it on every GPU start to find the container's cgroup.
"""

from __future__ import annotations

import os

from oci_gpu_hook.start.digits import decimal


class Mount:
    """One mountinfo line; root and mountpoint unescaped."""

    __slots__ = ("mount_id", "root", "mountpoint", "fstype", "source", "super_options")

    def __init__(self, mount_id: int, root: str, mountpoint: str, fstype: str, source: str, super_options: tuple):
        self.mount_id, self.root, self.mountpoint = mount_id, root, mountpoint
        self.fstype, self.source, self.super_options = fstype, source, super_options


def unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo (octal); a byte so written
    comes back as os.fsdecode gives it, as the rest of the name does (see read_text())."""
    if "\\" not in field:
        return field  # nearly every field: no copy, character by character
    out, i = [], 0
    while i < len(field):
        digits = field[i + 1 : i + 4] if field[i] == "\\" else ""
        if len(digits) == 3 and digits < "400" and all(c in "01234567" for c in digits):
            out.append(os.fsdecode(bytes([int(digits, 8)])))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse(text: str) -> list[Mount]:
    """The mounts of a mountinfo text, in its order; malformed lines are skipped. Split on what
    the kernel writes between lines and fields, a newline and a space (both escaped in names),
    never on what str.split() and splitlines() also take (\\x1c-\\x1f, \\x85, U+2028: a name
    may hold those as they are, and they must not make a line or a field of it)."""
    mounts = []
    for line in text.split("\n"):
        pre, sep, post = line.partition(" - ")
        fields, post_fields = pre.split(" "), post.split(" ")
        mount_id = decimal(fields[0])
        if not sep or len(fields) < 5 or not post_fields or mount_id is None:
            continue
        options = tuple(post_fields[2].split(",")) if len(post_fields) >= 3 else ()
        source = unescape(post_fields[1]) if len(post_fields) >= 2 else ""
        mounts.append(Mount(mount_id, unescape(fields[3]), unescape(fields[4]), post_fields[0], source, options))
    return mounts


def read_text(path: str = "/proc/self/mountinfo") -> str:
    """The table as text, its names decoded as the os module decodes names (os.fsdecode: a byte
    that is not UTF-8 is kept as a lone surrogate, and a path made of it opens the same file).
    A mount point is whatever name a directory has, an image's included: one that is not UTF-8
    must not fail the reader (issue 46, item 7)."""
    with open(path, "rb") as f:
        return os.fsdecode(f.read())


def read(path: str = "/proc/self/mountinfo") -> list[Mount]:
    return parse(read_text(path))
