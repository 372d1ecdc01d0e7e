"""validate: a container per GPU, with the hook, on a simulated host (root, runc, busybox, gcc)."""

import os

import pytest


def test_validate_passes_on_a_simulated_host(simulated_host, require, hook_cli):
    require("root", "runc", "busybox", "gcc")
    host = simulated_host(gpus=4, mig=[2], scramble_minors=True)
    out = hook_cli("--config", f"{host['root']}/config.yaml", "validate")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert [line.split()[3] for line in lines] == [gpu["uuid"] for gpu in host["gpus"]]
    assert all(line.startswith("PASS") for line in lines)
    assert "4 of 4 GPU(s) passed" in out.stdout


def test_validate_fails_clearly_when_a_gpu_node_is_missing(fresh_host, require, hook_cli):
    require("root", "runc", "busybox", "gcc")
    host = fresh_host(gpus=3)
    os.unlink(os.path.join(host["root"], "dev", f"nvidia{host['gpus'][1]['minor']}"))
    out = hook_cli("--config", f"{host['root']}/config.yaml", "validate")
    assert out.returncode == 1
    lines = [line for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert [line[:4] for line in lines] == ["PASS", "FAIL", "PASS"]
    assert lines[1].endswith(f"oci-gpu-hook: GPU 1 (/dev/nvidia{host['gpus'][1]['minor']}): device node missing")
    assert "2 of 3 GPU(s) passed" in out.stdout


@pytest.mark.parametrize("runtime", ["podman"])
def test_validate_with_podman(simulated_host, require, hook_cli, runtime):
    require("root", "podman", "runc", "busybox", "gcc")
    host = simulated_host(gpus=4, mig=[2], scramble_minors=True)
    out = hook_cli("--config", f"{host['root']}/config.yaml", "validate", "--runtime", runtime)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 of 4 GPU(s) passed" in out.stdout
