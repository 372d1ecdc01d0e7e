"""A bundle: the hook with an interpreter of its own, runnable from any directory on any host.

The node image carries its Python as one directory, which the cluster's toolkit copies onto each
node (issue 47), so that the hook a runtime runs keeps working once the image is gone, and needs
no Python, no packages and no C library of the host's: RHCOS has a Python too old for the
package's dependencies and no way to install others, and a host's libraries would change what
the hook loads. Laid out as:

| path (under BUNDLES_DIR/<id>/) | what |
|---|---|
| bin/python3 | csrc/bundle_python.c, static: runs the next with the loader below, --argv0 itself |
| bin/python3.bin | the interpreter |
| lib/ | its loader, and every library it and its extension modules need (and ctypes loads) |
| lib/pythonX.Y/ | the standard library, found by Python from bin/python3's path |
| site/ | this package and its dependencies |
| oci-gpu-hook-python | the launcher (toolkit/launcher.py) of bin/python3 with site/ |
| oci-gpu-hook | the pre-filter (toolkit/prefilter.py), static, handing on to that launcher |
| selinux/<family>/oci_gpu_hook.pp | the SELinux module, compiled per policy family (toolkit/policy_module.py) |

What a runtime runs is the pre-filter: a compiled program, which the kernel maps once and which
runs its own bundle's launcher by that bundle's path, so that a start that began with one bundle
ends in it, whichever bundle a link names meanwhile (a script's interpreter opens the script again
by the path the runtime named).

The id is a digest of everything in it but the launcher and the pre-filter, which name the id and
are made from what the digest covers (site/ holds the pre-filter's C source): a bundle is never
changed in place, only a new one made beside it.
The bundle sits at the same path in the image and on the host, so that its launcher, which names
absolute paths, is the same file in both.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import tempfile

from oci_gpu_hook.errors import Exit, HookError
from oci_gpu_hook.toolkit import launcher

BUNDLES_DIR = "/usr/local/libexec/oci-gpu-hook/bundles"
PYTHON = "bin/python3"
INTERPRETER = "bin/python3.bin"
LIBRARIES = "lib"
SITE = "site"
LAUNCHER = "oci-gpu-hook-python"
PREFILTER = "oci-gpu-hook"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "bundle_python.c")
CFLAGS = ("-O2", "-std=c11", "-Wall", "-Wextra", "-static-pie", "-s", "-Wl,-z,relro,-z,now")
ID_LENGTH = 16  # hex digits of the digest: 64 bits, against bundles that number a handful per host


class BundleError(HookError):
    exit_code = Exit.INSTALL


def directory(bundle_id: str) -> str:
    return f"{BUNDLES_DIR}/{bundle_id}"


def running() -> str | None:
    """The id of the bundle this process runs from (its interpreter is the python3 of a bundle in
    BUNDLES_DIR, by whatever path: RHCOS's /usr/local is a link to /var/usrlocal), else None."""
    top = os.path.dirname(os.path.dirname(sys.executable))
    name = os.path.basename(top)
    if os.path.relpath(sys.executable, top) != PYTHON or not is_id(name):
        return None
    try:
        if not os.path.samefile(os.path.dirname(top), BUNDLES_DIR):
            return None
    except OSError:
        return None
    return name if os.path.isfile(os.path.join(top, PREFILTER)) else None


def is_id(name: str) -> bool:
    return len(name) == ID_LENGTH and all(c in "0123456789abcdef" for c in name)


def launcher_text(bundle_id: str, note: str = "") -> str:
    """The bundle's launcher: its own python3 with its own site, by the paths it has on every host."""
    here = directory(bundle_id)
    return launcher.text(f"{here}/{PYTHON}", f"{here}/{SITE}", note=note)


def build_prefilter(bundle_id: str, cc: str) -> bytes:
    """The bundle's pre-filter: static (it runs on hosts with another C library), running the
    bundle's launcher, offering starts to the start server as install's does."""
    from oci_gpu_hook.start import prefilter_rule
    from oci_gpu_hook.toolkit import prefilter

    with tempfile.TemporaryDirectory(prefix="oci-gpu-hook-bundle-") as work:
        output = os.path.join(work, PREFILTER)
        prefilter.build(output, f"{directory(bundle_id)}/{LAUNCHER}", cc=cc, flags=("-static-pie", "-s"),
                        start_server=prefilter_rule.START_SERVER_SOCKET)  # fmt: skip
        with open(output, "rb") as f:
            return f.read()


def build_python(output: str, loader_name: str, cc: str) -> str:
    """Compile bin/python3 for a bundle whose lib/ holds the loader loader_name; returns output."""
    if not loader_name.replace(".", "").replace("-", "").replace("_", "").isalnum():
        raise BundleError(f"{loader_name!r}: not a loader's file name")
    done = subprocess.run([cc, *CFLAGS, f'-DLOADER_NAME="{loader_name}"', "-o", output, SOURCE],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"})  # fmt: skip
    if done.returncode != 0:
        first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip())
        raise BundleError(f"{cc}: cannot build a bundle's python3 (static: libc6-dev's libc.a): {first[:300]}")
    os.chmod(output, 0o755)
    return output


def identity(top: str) -> str:
    """The id of the bundle in top: a digest of every entry's relative path, kind, mode (every
    permission bit, set-id ones too) and content (a file's bytes, a link's value), directories
    included, in name order; the launcher and the pre-filter left out (made from the id, and
    checked against it where a bundle is placed), and the bytecode Python writes beside what it
    imports (__pycache__: derived from the sources, and written as the bundle runs)."""
    digest = hashlib.sha256()
    for here, names, files in os.walk(top):
        names[:] = sorted(n for n in names if n != "__pycache__")
        relative_here = os.path.relpath(here, top)
        digest.update(b"D\0" + relative_here.encode() + b"\0" + oct(os.lstat(here).st_mode & 0o7777).encode() + b"\0")
        for name in sorted(files + [n for n in names if os.path.islink(os.path.join(here, n))]):
            path = os.path.join(here, name)
            relative = os.path.relpath(path, top)
            if relative in (LAUNCHER, PREFILTER):
                continue
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                digest.update(b"L\0" + relative.encode() + b"\0" + os.readlink(path).encode() + b"\0")
                continue
            if not stat.S_ISREG(st.st_mode):
                raise BundleError(f"{path}: neither a file, a directory nor a link: not in a bundle")
            mode = oct(st.st_mode & 0o7777).encode()
            digest.update(b"F\0" + relative.encode() + b"\0" + mode + b"\0" + str(st.st_size).encode() + b"\0")
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            digest.update(b"\0")
    return digest.hexdigest()[:ID_LENGTH]
