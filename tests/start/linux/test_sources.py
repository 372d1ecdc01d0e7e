"""sources.py's open_stat: the checks' own stat of what was opened, for apply to use instead of
asking again (real directories; root, as their owner must be)."""

from __future__ import annotations

import os

from oci_gpu_hook.start.linux.sources import HostSources


def test_open_stat_gives_the_stat_of_the_opened_file_through_a_root_symlink(tmp_path, require):
    require("root")
    os.chmod(tmp_path, 0o755)
    (tmp_path / "libfoo.so.1.2").write_bytes(b"\x7fELF")
    os.chmod(tmp_path / "libfoo.so.1.2", 0o644)
    (tmp_path / "libfoo.so.1").symlink_to("libfoo.so.1.2")
    sources = HostSources()
    try:
        fd, st = sources.open_stat(str(tmp_path / "libfoo.so.1"), "file")
        try:
            opened = os.fstat(fd)
            assert (st.st_dev, st.st_ino, st.st_mode) == (opened.st_dev, opened.st_ino, opened.st_mode)
            assert st.st_ino == os.stat(tmp_path / "libfoo.so.1.2").st_ino  # the file, not the link
        finally:
            os.close(fd)
        fd, st = sources.open_stat(str(tmp_path), "dir")
        try:
            assert (st.st_dev, st.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
        finally:
            os.close(fd)
    finally:
        sources.close()
