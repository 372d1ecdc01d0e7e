"""The compiled pre-filter (toolkit/prefilter.py) as the real runtimes run it, in front of a
launcher of this checkout: runc (config.json's prestart hook), podman and CRI-O (a hooks.d file
naming it, as install writes one). A container that asks for nothing starts untouched, without
Python; one that asks gets exactly its GPU through the Python hook; a bad request fails with the
Python hook's own line.
"""

import json
import os
import re
import subprocess
import tempfile

import criocheck
import hookcheck
import pytest
from hookcheck import listed_uuids

from oci_gpu_hook.toolkit import containers, install

pytestmark = pytest.mark.host(gpus=2, mig=[], needs=("runc", "busybox", "podman", "conmon", "strace"))
NO_GPU_7 = "oci-gpu-hook: NVIDIA_VISIBLE_DEVICES=7: no GPU 7 (this host has GPUs 0-1)"


@pytest.fixture(scope="module")
def program(host, tmp_path_factory):
    """(the pre-filter, the argv prefix runtimes run it with)."""
    built, _ = hookcheck.prefilter_for_this_checkout(tmp_path_factory.mktemp("prefilter-e2e"))
    return built, [built, "--config", f"{host['root']}/config.yaml"]


CASES = {"none": ({}, []), "gpu": ({"NVIDIA_VISIBLE_DEVICES": "1"}, [1])}


def runc_bundle(tmp_path, name, env, prefix):
    bundle = containers.make_bundle(str(tmp_path / name), args=["sh", "-c", "ls /dev; nvidia-smi -L 2>&1; true"],
                                    env=env, config_file=None)  # fmt: skip
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        doc = json.load(f)
    doc["hooks"]["prestart"][0].update(path=prefix[0], args=[*prefix, "prestart"])
    with open(path, "w") as f:
        json.dump(doc, f)
    return bundle


@pytest.mark.parametrize("case", list(CASES))
def test_runc(host, program, tmp_path, case):
    env, expected = CASES[case]
    out = containers.runc_run(runc_bundle(tmp_path, case, env, program[1]), f"ocigpu-{os.getpid()}-pf-{case}")
    assert out.returncode == 0, out.stderr
    assert listed_uuids(out.stdout) == [host["gpus"][i]["uuid"] for i in expected]
    assert {n for n in out.stdout.split() if re.fullmatch(r"nvidia\d+", n)} == {
        f"nvidia{host['gpus'][i]['minor']}" for i in expected
    }


def test_runc_without_gpus_never_starts_python(host, program, tmp_path):
    """runc under strace: for a container that asks for nothing, the hook's process execs the
    pre-filter and nothing after it."""
    bundle = runc_bundle(tmp_path, "traced", {}, program[1])
    trace = tmp_path / "trace"
    cid = f"ocigpu-{os.getpid()}-pf-traced"
    try:
        done = subprocess.run(["strace", "-f", "-qq", "-e", "trace=execve", "-o", str(trace), "runc", "run",
                               "--bundle", bundle, cid], capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        subprocess.run(["runc", "delete", "--force", cid], capture_output=True)
    assert done.returncode == 0, done.stderr
    programs = re.findall(r'execve\("([^"]+)"', trace.read_text())
    assert program[0] in programs and not any("python" in p for p in programs), programs


def test_runc_a_bad_request_fails_with_the_hooks_line(program, tmp_path):
    out = containers.runc_run(runc_bundle(tmp_path, "bad", {"NVIDIA_VISIBLE_DEVICES": "7"}, program[1]),
                              f"ocigpu-{os.getpid()}-pf-bad")  # fmt: skip
    assert out.returncode != 0 and NO_GPU_7 in out.stderr, out.stderr


@pytest.fixture(scope="module")
def podman_image(host, tmp_path_factory):
    work = tmp_path_factory.mktemp("prefilter-podman")
    image = containers.podman_image(containers.make_rootfs(str(work / "rootfs")), f"localhost/ocigpu-pf-{os.getpid()}")
    yield image
    subprocess.run(["podman", "rmi", "-f", image], capture_output=True)


@pytest.mark.parametrize("case", [*CASES, "bad"])
def test_podman(host, program, podman_image, tmp_path, case):
    hooks = install.write_hooks_dir(str(tmp_path / "hooks.d"), program[1])
    env, expected = CASES.get(case, ({"NVIDIA_VISIBLE_DEVICES": "7"}, None))
    out = containers.podman_run(hooks, podman_image, ["sh", "-c", "nvidia-smi -L 2>&1; true"], env)
    if expected is None:
        assert out.returncode != 0 and NO_GPU_7 in out.stderr, out.stderr
    else:
        assert out.returncode == 0, out.stderr
        assert listed_uuids(out.stdout) == [host["gpus"][i]["uuid"] for i in expected]


def test_crio(host, program, tmp_path):
    """CRI-O runs the hooks.d file's program at createRuntime: the same three outcomes."""
    criocheck.programs()
    hooks = install.write_hooks_dir(str(tmp_path / "hooks.d"), program[1])
    node = criocheck.CrioDaemon(tempfile.mkdtemp(prefix="oci-gpu-hook-crio-", dir="/var/tmp"), hooks)
    try:
        out = node.run_pod({"none": ({}, ["sh", "-c", "nvidia-smi -L 2>&1; true"]),
                            "gpu": ({"NVIDIA_VISIBLE_DEVICES": "1"}, ["nvidia-smi", "-L"]),
                            "bad": ({"NVIDIA_VISIBLE_DEVICES": "7"}, ["true"])})  # fmt: skip
    finally:
        node.stop()  # raises for a process, mount or cgroup of its own left
    assert listed_uuids(out["none"][0]) == [] and listed_uuids(out["gpu"][0]) == [host["gpus"][1]["uuid"]]
    assert NO_GPU_7 in out["bad"][0], out["bad"]
