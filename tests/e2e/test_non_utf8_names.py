"""An image whose names are not UTF-8 starts with its GPU under real runc (issue 46, item 7).

Names in a rootfs are bytes: a link, a directory, a file named in ld.so.conf may hold any byte
but '/' and NUL. The hook reads such names (the container's mount table once its libraries are
mounted through the link, the image's ld.so.conf and the files it includes) and must carry them
as the kernel gave them, never decode them strictly: a start that fails on them is a GPU image
that no longer runs (case X3: /usr/lib64 a link to a directory with a non-UTF-8 name failed with
"internal error: UnicodeDecodeError").
"""

import json
import os

import pytest
from hookcheck import listed_uuids

from oci_gpu_hook.toolkit import containers

pytestmark = pytest.mark.host(gpus=2, mig=[], needs=("runc", "busybox"))

ODD = b"\xff\xfe-lib"  # not UTF-8: every byte of it is invalid there


def _log(host) -> list:
    try:
        with open(f"{host['root']}/hook.log") as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        return []


def test_a_lib64_link_to_a_non_utf8_directory_gets_the_libraries_there(tmp_path, host):
    """/usr/lib64 -> b'\\xff\\xfe-lib' (the image's libc and all in it), an ld.so.conf naming that
    directory, and an include that reaches a FIFO with a non-UTF-8 name: the start succeeds, the
    driver's libraries are in the directory the link points at (nvidia-smi finds NVML through the
    refreshed cache), the link is still the image's, and the log record says the ignored FIFO with
    its name intact (escaped, printable)."""
    bundle = containers.make_bundle(
        str(tmp_path / "bundle"),
        args=["sh", "-c", "nvidia-smi -L; for f in /usr/*-lib/libcuda.so.1 /usr/*-lib/libnvidia-ml.so.1; do "
                          'test -e "$f" && echo "in the link target: ${f##*/}"; done; '
                          "test -L /usr/lib64 && echo lib64 is a link"],
        env={"NVIDIA_VISIBLE_DEVICES": "1", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"},
        config_file=f"{host['root']}/config.yaml",
    )  # fmt: skip
    usr = os.path.join(os.fsencode(bundle), b"rootfs/usr")
    os.rename(os.path.join(usr, b"lib64"), os.path.join(usr, ODD))
    os.symlink(ODD, os.path.join(usr, b"lib64"))
    etc = os.path.join(os.fsencode(bundle), b"rootfs/etc")
    with open(os.path.join(etc, b"ld.so.conf"), "wb") as f:
        f.write(b"/usr/" + ODD + b"\ninclude /etc/ld.so.conf.d/*.conf\n")
    os.mkdir(os.path.join(etc, b"ld.so.conf.d"))
    os.mkfifo(os.path.join(etc, b"ld.so.conf.d/\xfe.conf"))  # never opened: said in the log
    logged = len(_log(host))

    out = containers.runc_run(bundle, f"ocigpu-{os.getpid()}-odd-names")

    assert out.returncode == 0, out.stderr
    assert listed_uuids(out.stdout) == [host["gpus"][1]["uuid"]], out.stdout
    assert "in the link target: libcuda.so.1" in out.stdout and "in the link target: libnvidia-ml.so.1" in out.stdout
    assert "lib64 is a link" in out.stdout
    starts = [e for e in _log(host)[logged:] if e["container"].endswith("-odd-names")]
    assert [e["message"] for e in starts] == ["GPU devices configured"], starts
    ignored = "/etc/ld.so.conf.d/\udcfe.conf in the image ignored: not a regular file with one link"
    assert ignored in starts[0]["skipped"], starts[0]["skipped"]
    with open(f"{host['root']}/hook.log", "rb") as f:
        raw = f.read()
    assert b"\\udcfe.conf" in raw and raw.isascii()  # the name as JSON escapes it: printable
