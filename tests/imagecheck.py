"""The node image as tests build and read it (deploy/build-image.py): tests/deploy/test_image.py
and the bundle's install (tests/toolkit/test_install_bundle.py)."""

import io
import json
import os
import subprocess
import sys
import tarfile

from oci_gpu_hook.toolkit import bundle

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILDER = os.path.join(REPO, "deploy", "build-image.py")


def build(output, tmpdir, umask: int = 0o022, *args) -> subprocess.CompletedProcess:
    """The image as `make image SELINUX_HEADERS=` builds it for RHEL nodes on this Debian machine:
    the SELinux module for both families (RHEL's headers: ../shared/tools/selinux-rhel)."""
    from kubeletcheck import shared_tool

    os.makedirs(tmpdir, exist_ok=True)
    rhel = ["--selinux-headers", shared_tool("selinux-rhel")]
    return subprocess.run([sys.executable, BUILDER, "--output", str(output), *rhel, *args], capture_output=True,
                          text=True,
                          timeout=600, env={**os.environ, "TMPDIR": str(tmpdir)},
                          preexec_fn=lambda: os.umask(umask))  # fmt: skip


def layer(path) -> tarfile.TarFile:
    """The image's one layer, from the docker-archive's manifest."""
    with tarfile.open(path) as archive:
        (manifest,) = json.load(archive.extractfile("manifest.json"))
        (name,) = manifest["Layers"]
        return tarfile.open(fileobj=io.BytesIO(archive.extractfile(name).read()))


def image_bundle(image_root: str) -> str:
    """The image's one bundle, as a path under image_root."""
    parent = os.path.join(image_root, bundle.BUNDLES_DIR.lstrip("/"))
    (bundle_id,) = os.listdir(parent)
    return os.path.join(parent, bundle_id)
