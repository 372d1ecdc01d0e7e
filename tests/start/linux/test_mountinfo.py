"""mountinfo.parse: the kernel's table read line by line; a malformed line is skipped, never an error."""

import pytest

from oci_gpu_hook.start.linux import mountinfo

LINE = "{id} 25 0:21 / /run rw,nosuid - tmpfs tmpfs rw,mode=755"


def test_a_line_is_read_into_its_fields():
    (mount,) = mountinfo.parse(LINE.format(id="36") + "\n")
    assert (mount.mount_id, mount.root, mount.mountpoint, mount.fstype, mount.source) == (36, "/", "/run", "tmpfs",
                                                                                          "tmpfs")  # fmt: skip


@pytest.mark.parametrize("mount_id", ["\u00b9", "\u0663", "\uff12", "", "-1"])
def test_a_mount_id_not_in_ascii_digits_is_a_malformed_line(mount_id):
    """'¹' made int() raise out of the parser; '٣' was read as mount 3."""
    text = LINE.format(id=mount_id) + "\n" + LINE.format(id="36")
    assert [m.mount_id for m in mountinfo.parse(text)] == [36]
