"""Docker's `--gpus` with the hook, end to end: a real dockerd (Debian's docker.io) started here
(tests/dockercheck.py: its own socket, roots and cgroup parent; what it changes on the host is put
back). `oci-gpu-hook install --runtime docker` writes the program dockerd looks for under a --root
of the test's own, put first on dockerd's PATH.
"""

import os
import re

import pytest
from dockercheck import Dockerd

from oci_gpu_hook.toolkit import containers, install


@pytest.fixture(scope="module")
def docker(simulated_host, require, tmp_path_factory):
    require("root", "runc", "busybox", "gcc", "dockerd", "docker")
    host = simulated_host(gpus=4, mig=[2])
    work = str(tmp_path_factory.mktemp("docker"))
    root = os.path.join(work, "root")
    os.mkdir(root)
    prefix = containers.hook_command(f"{host['root']}/config.yaml")
    assert install.install(root, ("docker",), prefix)
    program_dir = os.path.join(root, "usr/bin")
    assert os.listdir(program_dir) == ["nvidia-container-runtime-hook"]
    with Dockerd(work, program_dir) as daemon:
        rootfs = containers.make_rootfs(os.path.join(work, "rootfs"))
        yield daemon.client, host, daemon.import_image(rootfs, "localhost/ocigpu-docker:test")


def uuids(stdout):
    return re.findall(r"UUID: ((?:GPU|MIG)-[0-9a-f-]+)\)", stdout)


def all_uuids(host):
    return [u for g in host["gpus"] for u in [g["uuid"]] + [m["uuid"] for m in g["mig"]]]


CASES = {
    # name: (--gpus value, the UUIDs nvidia-smi must list)
    "all": (lambda h: "all", all_uuids),
    "count 2": (lambda h: "2", lambda h: [h["gpus"][0]["uuid"], h["gpus"][1]["uuid"]]),
    "device=1,3": (lambda h: '"device=1,3"', lambda h: [h["gpus"][1]["uuid"], h["gpus"][3]["uuid"]]),
    "uuid": (lambda h: f"device={h['gpus'][3]['uuid']}", lambda h: [h["gpus"][3]["uuid"]]),
    "mig uuid": (lambda h: f"device={h['gpus'][2]['mig'][1]['uuid']}",
                 lambda h: [h["gpus"][2]["uuid"], h["gpus"][2]["mig"][1]["uuid"]]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_gpus_flag(docker, case):
    client, host, image = docker
    gpus, expected = CASES[case]
    out = client.run(gpus(host), "nvidia-smi -L; echo VISIBLE=$NVIDIA_VISIBLE_DEVICES", image)
    assert out.returncode == 0, out.stderr
    assert uuids(out.stdout) == expected(host)
    # Only the chosen GPUs' nodes are in the container.
    nodes = client.run(gpus(host), "ls /dev", image).stdout.split()
    minors = {g["minor"] for g in host["gpus"] if g["uuid"] in expected(host)}
    assert sorted(n for n in nodes if re.fullmatch(r"nvidia\d+", n)) == sorted(f"nvidia{m}" for m in minors)


def test_capabilities_utility_gives_nvidia_smi_but_not_cuda(docker):
    client, host, image = docker
    script = (
        "echo CAPS=$NVIDIA_DRIVER_CAPABILITIES; nvidia-smi -L >/dev/null && echo SMI-OK; "
        "ls /usr/lib64/libcuda.so.1 2>/dev/null || echo NO-CUDA; ls /dev/nvidia-uvm 2>/dev/null || echo NO-UVM"
    )
    out = client.run("all,capabilities=utility", script, image)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["CAPS=utility", "SMI-OK", "NO-CUDA", "NO-UVM"]


def test_default_capabilities_give_cuda(docker):
    client, host, image = docker
    out = client.run("1", "readlink /usr/lib64/libcuda.so.1; ls /dev/nvidia-uvm", image)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"libcuda.so.{host['driver_version']}", "/dev/nvidia-uvm"]


def test_without_gpus_the_hook_does_not_run(docker):
    client, host, image = docker
    out = client.run(None, "ls /dev; ls /usr/lib64; echo VISIBLE=${NVIDIA_VISIBLE_DEVICES-unset}", image)
    assert out.returncode == 0, out.stderr
    assert "nvidiactl" not in out.stdout and "libcuda" not in out.stdout and "VISIBLE=unset" in out.stdout
