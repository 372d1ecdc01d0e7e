"""The one bounded read and the one atomic write (start/files.py)."""

import errno
import os
import stat

import pytest

from oci_gpu_hook.start import files


def test_read_bounded_reads_one_byte_past_the_limit(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert files.read_bounded(str(path), 1000) == b"x" * 100
    assert files.read_bounded(str(path), 100) == b"x" * 100
    assert files.read_bounded(str(path), 99) == b"x" * 100  # 100 > 99: the caller can tell
    assert files.read_bounded(str(path), 10) == b"x" * 11


def test_read_bounded_a_fifo_does_not_hang(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert files.read_bounded(str(fifo), 10) == b""  # O_NONBLOCK, no writer: nothing, at once
    with pytest.raises(OSError) as e:
        files.read_bounded(str(fifo), 10, regular=True)
    assert e.value.errno == errno.EINVAL and e.value.strerror == "not a regular file"


def test_read_bounded_nofollow(tmp_path):
    (tmp_path / "target").write_bytes(b"secret")
    os.symlink(tmp_path / "target", tmp_path / "link")
    assert files.read_bounded(str(tmp_path / "link"), 10) == b"secret"
    with pytest.raises(OSError) as e:
        files.read_bounded(str(tmp_path / "link"), 10, nofollow=True)
    assert e.value.errno == errno.ELOOP


def test_write_atomically_replaces_with_mode_and_leaves_nothing(tmp_path):
    path = tmp_path / "out.json"
    path.write_bytes(b"old")
    files.write_atomically(str(path), b"new", mode=0o640)
    assert path.read_bytes() == b"new"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["out.json"]


def test_write_atomically_never_writes_through_what_is_there(tmp_path):
    """A symlink planted at the target is replaced, not followed; nothing else in the
    directory is touched (the temporary name is new, O_EXCL)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    os.symlink(victim, tmp_path / "out")
    files.write_atomically(str(tmp_path / "out"), b"mine")
    assert victim.read_bytes() == b"keep"
    assert not os.path.islink(tmp_path / "out") and (tmp_path / "out").read_bytes() == b"mine"


def test_write_atomically_cleans_up_on_failure(tmp_path):
    target = tmp_path / "dir"
    target.mkdir()
    (target / "inside").write_bytes(b"x")  # renaming a file over a non-empty directory fails
    with pytest.raises(OSError):
        files.write_atomically(str(target), b"data")
    assert sorted(os.listdir(tmp_path)) == ["dir"]
