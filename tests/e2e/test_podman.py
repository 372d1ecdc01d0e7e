"""podman (with runc) runs the hook through our hooks.d file (root, podman, runc, busybox, gcc)."""

import os

import pytest
from hookcheck import listed_uuids

from oci_gpu_hook.toolkit import containers


@pytest.fixture(scope="module")
def setup(simulated_host, require, tmp_path_factory):
    require("root", "podman", "runc", "busybox", "gcc")
    host = simulated_host(gpus=4, mig=[2], scramble_minors=True)
    work = tmp_path_factory.mktemp("podman")
    hooks_dir = containers.write_hooks_dir(str(work / "hooks.d"), f"{host['root']}/config.yaml")
    rootfs = containers.make_rootfs(str(work / "rootfs"))
    image = containers.podman_image(rootfs, f"localhost/ocigpu-test-{os.getpid()}:latest")
    yield host, hooks_dir, image
    import subprocess

    subprocess.run(["podman", "rmi", "-f", image], capture_output=True)


def test_hooks_dir_gives_exactly_one_gpu(setup):
    host, hooks_dir, image = setup
    out = containers.podman_run(hooks_dir, image, ["nvidia-smi", "-L"], {"NVIDIA_VISIBLE_DEVICES": "0"})
    assert out.returncode == 0, out.stderr
    assert listed_uuids(out.stdout, ("GPU",)) == [host["gpus"][0]["uuid"]]


def test_container_without_the_variable_is_untouched(setup):
    host, hooks_dir, image = setup
    script = ["sh", "-c", "cut -d' ' -f5 /proc/self/mountinfo | sort; ls /dev /usr/bin"]
    with_hook = containers.podman_run(hooks_dir, image, script, {})
    without = containers.podman_run(None, image, script, {})
    assert with_hook.returncode == 0 and without.returncode == 0, with_hook.stderr + without.stderr
    assert with_hook.stdout == without.stdout and "nvidia" not in with_hook.stdout
