"""The ldcache-refresh fast path's own argument parser: what click accepted, it accepts; what
click refused, it refuses with one line (exit 2, as click's usage errors)."""

import pytest

from oci_gpu_hook.errors import Exit, UsageError
from oci_gpu_hook.hook import main
from oci_gpu_hook.start.ldcache_refresh import parse_args


@pytest.mark.parametrize(
    "argv, directories, links",
    [
        ([], [], []),
        (["--dir", "/usr/lib64"], ["/usr/lib64"], []),
        (["--dir=/usr/lib64", "--dir", "/usr/lib"], ["/usr/lib64", "/usr/lib"], []),
        (["--link", "/usr/lib64/libcuda.so=libcuda.so.1"], [], [("/usr/lib64/libcuda.so", "libcuda.so.1")]),
        (["--link=/a=b=c", "--dir", "/x"], ["/x"], [("/a", "b=c")]),
    ],
)
def test_accepted(argv, directories, links):
    assert parse_args(argv) == (directories, links)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dir"], "--dir needs a value"),
        (["--dir", "lib"], "expected an absolute path"),
        (["--link", "/a"], "expected /PATH=VALUE"),
        (["--link", "a=b"], "expected /PATH=VALUE"),
        (["--link", "/a="], "expected /PATH=VALUE"),
        (["--verbose"], "unexpected argument"),
        (["/usr/lib64"], "unexpected argument"),
    ],
)
def test_refused(argv, message):
    with pytest.raises(UsageError, match=message):
        parse_args(argv)


def test_refused_before_reading_stdin(capsys):
    """A usage error is reported as one line, before the hook waits for a state on stdin."""
    assert main(["ldcache-refresh", "--dir", "relative"]) == Exit.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dir 'relative'" in err
