"""Docker's `--gpus` with the hook, end to end: a real dockerd (Debian's docker.io) as a host runs
it, after `oci-gpu-hook install --runtime docker` as a user runs it (tests/dockercheck.HostDockerd:
a private mount namespace with overlays, install writes /usr/bin/nvidia-container-runtime-hook
there, dockerd starts with no flags and its own PATH, its settings in /etc/docker/daemon.json;
what it changes outside the namespace is put back).
"""

import os
import re

import pytest
from dockercheck import HostDockerd
from hookcheck import listed_uuids

from oci_gpu_hook.toolkit import containers, install


@pytest.fixture(scope="module")
def docker(simulated_host, require, tmp_path_factory):
    require("root", "runc", "busybox", "gcc", "dockerd", "docker", "unshare")
    host = simulated_host(gpus=4, mig=[2])
    work = str(tmp_path_factory.mktemp("docker"))
    rootfs = containers.make_rootfs(os.path.join(work, "rootfs"))
    cli = containers.hook_command(f"{host['root']}/config.yaml")
    with HostDockerd(work, cli, rootfs, "localhost/ocigpu-docker:test") as daemon:
        assert f"wrote {install.DOCKER_HOOK}" in daemon.before["install"]["stdout"], daemon.before["install"]
        yield daemon.client, host, daemon.tag


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
    assert listed_uuids(out.stdout) == expected(host)
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
