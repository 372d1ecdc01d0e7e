"""`all` on an 8-GPU host with one GPU in MIG mode gives what NVIDIA's hook gives: every GPU, and
every MIG device's capability nodes and /proc access files; under runc with the hook, and through
the CDI spec podman applies.

On a simulated host the container's own /proc has no /proc/driver/nvidia (no driver is loaded),
so the hook's /proc mask, and the access files bound into it, are skipped there; the plan the
hook applies (`plan --json`, the same code) shows the access files.
"""

import json
import os
import subprocess

import pytest
from hookcheck import cdi_spec_in_etc, listed_uuids

from oci_gpu_hook.toolkit import containers

pytestmark = pytest.mark.host(gpus=8, mig=[1], needs=("runc", "busybox"))


def everything(host):
    return [u for g in host["gpus"] for u in [g["uuid"]] + [m["uuid"] for m in g["mig"]]]


def cap_nodes(host):
    return {f"nvidia-cap{m[k]}" for g in host["gpus"] for m in g["mig"] for k in ("gi_cap_minor", "ci_cap_minor")}


def test_runc_all_gives_every_mig_device(tmp_path, host, hook_cli):
    config = f"{host['root']}/config.yaml"
    bundle = containers.make_bundle(str(tmp_path / "b"), args=["sh", "-c", "nvidia-smi -L; ls /dev/nvidia-caps"],
                                    env={"NVIDIA_VISIBLE_DEVICES": "all"}, config_file=config)  # fmt: skip
    out = containers.runc_run(bundle, f"ocigpu-{os.getpid()}-allmig")
    assert out.returncode == 0, out.stderr
    assert listed_uuids(out.stdout) == everything(host)
    assert cap_nodes(host) <= set(out.stdout.split()) and len(cap_nodes(host)) == 6

    plan = hook_cli("--config", config, "plan", "--bundle", bundle, "--json")
    assert plan.returncode == 0, plan.stderr
    binds = {op["target"] for op in json.loads(plan.stdout)["operations"] if op["op"] == "BindMount"}
    gpu = host["gpus"][1]
    for mig in gpu["mig"]:
        base = f"/proc/driver/nvidia/capabilities/gpu{gpu['minor']}/mig/gi{mig['gi']}"
        assert {f"{base}/access", f"{base}/ci{mig['ci']}/access"} <= binds


def test_cdi_all_gives_every_mig_device(tmp_path, host, require):
    require("podman")
    kind = "oci-gpu-hook.test/migall"
    image = f"localhost/ocigpu-migall-{os.getpid()}:latest"
    with cdi_spec_in_etc(host, f"oci-gpu-hook-test-migall-{os.getpid()}.json", "--vendor-class", kind) as path:
        spec = json.load(open(path))
        (all_device,) = [d for d in spec["devices"] if d["name"] == "all"]
        minors = {n["minor"] for n in all_device["containerEdits"]["deviceNodes"]}
        assert {int(n[len("nvidia-cap") :]) for n in cap_nodes(host)} <= minors
        try:
            containers.podman_image(containers.make_rootfs(str(tmp_path / "rootfs")), image)
            argv = ["podman", "run", "--rm", *containers.PODMAN_OPTIONS, "--device", f"{kind}=all", image,
                    "sh", "-c", "nvidia-smi -L; ls /dev/nvidia-caps"]  # fmt: skip
            run = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
            assert run.returncode == 0, run.stderr
            assert listed_uuids(run.stdout) == everything(host)
            assert cap_nodes(host) <= set(run.stdout.split())
        finally:
            subprocess.run(["podman", "rmi", "-f", image], capture_output=True)
