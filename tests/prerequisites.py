"""What a test or a bench run needs of the machine, by name: the one rule that conftest's
`require` fixture and the bench's own checks (bench/cluster.py) both apply.

A name is an executable on PATH or an importable module; "root" means running as uid 0,
"gcc-m32" a gcc that can build 32-bit programs, "ipv6" an IPv6 loopback address (::1) and an
absolute path a file that exists."""

import functools
import importlib.util
import os
import shutil
import subprocess
import tempfile


@functools.cache
def _gcc_can_build_32bit() -> bool:
    if not shutil.which("gcc"):
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "t.c")
        with open(src, "w") as f:
            f.write("int main(void) { return 0; }\n")
        proc = subprocess.run(["gcc", "-m32", "-o", os.path.join(tmp, "t"), src], capture_output=True)
        return proc.returncode == 0


@functools.cache
def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def available(name: str) -> bool:
    if name == "root":
        return os.geteuid() == 0
    if name == "ipv6":
        return _has_ipv6_loopback()
    if name == "gcc-m32":
        return _gcc_can_build_32bit()
    if name.startswith("/"):
        return os.path.exists(name)
    return bool(shutil.which(name)) or importlib.util.find_spec(name) is not None


def absent(*names: str) -> list:
    """Those of names this machine lacks, in their order."""
    return [name for name in names if not available(name)]
