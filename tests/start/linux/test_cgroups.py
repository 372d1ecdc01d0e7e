"""Pure: where a process's device cgroup is (v1 and v2), mountinfo's escapes, and which v1 rules
a cgroup already grants."""

import os

import pytest

from oci_gpu_hook.start.linux import cgroups, mountinfo

HYBRID_MOUNTINFO = """\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
31 25 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
42 31 0:39 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
"""
PURE_V2_MOUNTINFO = "35 25 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw\n"


@pytest.mark.parametrize(
    "cgroup_text, mountinfo, expected",
    [
        ("5:devices:/docker/abc\n0::/docker/abc\n", HYBRID_MOUNTINFO, "/sys/fs/cgroup/unified/docker/abc"),
        ("0::/system.slice/runc-x.scope\n", PURE_V2_MOUNTINFO, "/sys/fs/cgroup/system.slice/runc-x.scope"),
        ("0::/\n", PURE_V2_MOUNTINFO, "/sys/fs/cgroup"),
        # A mount of a sub-tree (cgroup namespace): the path is taken relative to its root.
        ("0::/kubepods/pod1/c1\n", "50 1 0:30 /kubepods /cg rw - cgroup2 cgroup2 rw\n", "/cg/pod1/c1"),
        ("0::/other/c1\n", "50 1 0:30 /kubepods /cg rw - cgroup2 cgroup2 rw\n", None),
        ("0::/a\n", "50 1 0:30 / /my\\040cgroup rw - cgroup2 cgroup2 rw\n", "/my cgroup/a"),
        ("5:devices:/a\n", HYBRID_MOUNTINFO, None),  # no 0:: line
        ("0::/a\n", "42 31 0:39 / /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices\n", None),
    ],
)
def test_v2_path(cgroup_text, mountinfo, expected):
    assert cgroups.v2_path(cgroup_text, mountinfo) == expected


@pytest.mark.parametrize(
    "cgroup_text, mountinfo, expected",
    [
        ("5:devices:/docker/abc\n0::/docker/abc\n", HYBRID_MOUNTINFO, "/sys/fs/cgroup/devices/docker/abc"),
        ("4:cpu,devices:/a\n", "9 1 0:9 / /cg\\040v1 rw - cgroup cgroup rw,cpu,devices\n", "/cg v1/a"),
        ("0::/a\n", HYBRID_MOUNTINFO, None),  # no devices line
        ("5:devices:/a\n", PURE_V2_MOUNTINFO, None),  # no v1 devices hierarchy mounted
    ],
)
def test_v1_devices_path(cgroup_text, mountinfo, expected):
    assert cgroups.v1_devices_path(cgroup_text, mountinfo) == expected


def test_mountinfo_unescapes_its_four_characters():
    assert mountinfo.unescape("a\\040b\\011c\\012d\\134e\\04") == "a b\tc\nd\\e\\04"


@pytest.mark.parametrize(
    "listing, rule, granted",
    [
        ("a *:* rwm\n", (195, 0, "rw"), True),  # allow-all: the root, a privileged container
        ("c 195:* rwm\n", (195, 7, "rw"), True),
        ("c 195:0 r\n", (195, 0, "rw"), False),
        ("c 195:0 rw\nc 1:3 rwm\n", (195, 1, "rw"), False),
        ("", (195, 0, "rw"), False),
        ("b 195:0 rwm\n", (195, 0, "rw"), False),  # a block device of the same numbers
    ],
)
def test_v1_granted(listing, rule, granted):
    assert cgroups.v1_granted(listing, *rule) is granted


MOUNTINFO = (
    "22 1 0:21 / / rw,relatime - ext4 /dev/sda1 rw\n"
    "30 22 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs ro,mode=755\n"
    "31 30 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate\n"
    "35 30 0:31 / /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices\n"
    "40 22 0:40 /a\\040b /mnt/with\\040space rw - overlay over\\040lay rw\n"
    "not a mountinfo line\n"
)


def test_mountinfo_one_parser():
    mounts = mountinfo.parse(MOUNTINFO)
    assert [m.mount_id for m in mounts] == [22, 30, 31, 35, 40]
    last = mounts[-1]
    assert (last.root, last.mountpoint, last.fstype, last.source) == ("/a b", "/mnt/with space", "overlay", "over lay")
    assert mounts[3].super_options == ("rw", "devices")


def test_mountinfo_names_are_bytes(tmp_path):
    """A mount point is any name a directory has, an image's included (issue 46, item 7): bytes
    that are not UTF-8 come back as os.fsdecode gives them (a path that opens the same file),
    and characters str.split() and splitlines() take for breaks (\\x1c, \\x1e, \\x85 as
    UTF-8, U+2028, a bare \\r) stay inside the name; the kernel breaks only at a newline and a
    space, which it escapes in names."""
    odd = b"/rootfs/usr/\xff\xfe-lib/libcuda.so.1"
    tricky = "/rootfs/a\x1cb\x1ec\x85d\u2028e\rf".encode()
    table = tmp_path / "mountinfo"
    table.write_bytes(
        b"22 1 0:21 / / rw,relatime - ext4 /dev/sda1 rw\n"
        b"131 22 254:0 /host-library " + odd + b" rw,relatime - ext4 /dev/vda rw\n"
        b"132 22 0:52 / " + tricky + b" rw,relatime - tmpfs tmpfs rw\n"
        b"133 22 0:53 / /rootfs/esc\\377aped rw - tmpfs tmpfs rw\n"
    )
    mounts = mountinfo.read(str(table))
    assert [m.mount_id for m in mounts] == [22, 131, 132, 133]
    assert [os.fsencode(m.mountpoint) for m in mounts] == [b"/", odd, tricky, b"/rootfs/esc\xffaped"]
    assert mounts[2].fstype == "tmpfs" and mounts[2].super_options == ("rw",)


NO_V1_DEVICES = MOUNTINFO.replace(" cgroup cgroup rw,devices", " cgroup cgroup rw,cpu")
NO_V2 = "".join(line + "\n" for line in MOUNTINFO.splitlines() if "cgroup2" not in line)


@pytest.mark.parametrize(
    "text, expected",
    [(MOUNTINFO, (True, True)), (NO_V1_DEVICES, (False, True)), (NO_V2, (True, False)), ("", (False, False))],
)
def test_mounted_hierarchies(text, expected):
    assert cgroups.mounted_hierarchies(text) == expected


@pytest.mark.parametrize(
    "cgroup_text, expected",
    [
        ("5:devices:/docker/abc\n0::/\n", "/docker/abc"),  # hybrid: the devices hierarchy tells
        ("5:cpu,devices:/k/c1\n0::/k/c1\n", "/k/c1"),
        ("0::/system.slice/runc-x.scope\n", "/system.slice/runc-x.scope"),
        ("0::/\n", None),  # the root holds host processes too
        ("5:devices:/\n0::/x\n", None),  # a devices line decides, even at the root
        ("1:name=systemd:/a\n", None),
        ("", None),
        ("garbage\n0::relative\n", None),
    ],
)
def test_identity_names_a_container_never_the_root(cgroup_text, expected):
    assert cgroups.identity(cgroup_text) == expected


@pytest.mark.parametrize(
    "cgroup, container, inside",
    [("/k/c1", "/k/c1", True), ("/k/c1/sub", "/k/c1", True), ("/k/c10", "/k/c1", False), ("/k", "/k/c1", False)],
)
def test_is_within(cgroup, container, inside):
    assert cgroups.is_within(cgroup, container) is inside
