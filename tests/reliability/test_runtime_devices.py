"""Attack round 2, class 5: device nodes the runtime already made (config.json linux.devices,
`podman --device`, a device plugin's device specs). A char device with the planned numbers at the
target is what the hook wanted anyway: it is kept (and mounted over); anything else still fails.
"""

import json
import os
import subprocess

import pytest
from hookcheck import listed_uuids

from oci_gpu_hook.toolkit import containers

pytestmark = pytest.mark.host(gpus=4, mig=[2], scramble_minors=True, needs=("runc", "busybox"))


def bundle_with_device(tmp_path, host, path, minor, name):
    env = {"NVIDIA_VISIBLE_DEVICES": "0"}
    bundle = containers.make_bundle(str(tmp_path / name), args=["sh", "-c", "nvidia-smi -L"], env=env,
                              config_file=f"{host['root']}/config.yaml")  # fmt: skip
    config_json = os.path.join(bundle, "config.json")
    config = json.load(open(config_json))
    config["linux"]["devices"] = [
        {"path": path, "type": "c", "major": 195, "minor": minor, "fileMode": 0o666, "uid": 0, "gid": 0}
    ]
    json.dump(config, open(config_json, "w"))
    return bundle


def test_runc_linux_devices_node_with_the_right_numbers_is_kept(tmp_path, host):
    gpu0 = host["gpus"][0]
    bundle = bundle_with_device(tmp_path, host, f"/dev/nvidia{gpu0['minor']}", gpu0["minor"], "right")
    out = containers.runc_run(bundle, f"ocigpu-{os.getpid()}-devright")
    assert out.returncode == 0, out.stderr
    assert listed_uuids(out.stdout, ("GPU",)) == [gpu0["uuid"]]


def test_runc_linux_devices_node_with_other_numbers_is_refused(tmp_path, host):
    target = f"/dev/nvidia{host['gpus'][0]['minor']}"
    bundle = bundle_with_device(tmp_path, host, target, host["gpus"][1]["minor"], "wrong")
    out = containers.runc_run(bundle, f"ocigpu-{os.getpid()}-devwrong")
    assert out.returncode != 0
    assert "oci-gpu-hook: " in out.stderr and target in out.stderr and "not a regular file" in out.stderr


def test_podman_device_flag(tmp_path, host, require):
    require("podman")
    gpu0 = host["gpus"][0]
    rootfs = containers.make_rootfs(str(tmp_path / "rootfs"))
    tag = f"localhost/ocigpu-device-{os.getpid()}:latest"
    containers.podman_image(rootfs, tag)
    try:
        hooks = containers.write_hooks_dir(str(tmp_path / "hooks.d"), f"{host['root']}/config.yaml")
        node = f"{host['root']}/dev/nvidia{gpu0['minor']}"
        out = containers.podman_run(hooks, tag, ["nvidia-smi", "-L"], {"NVIDIA_VISIBLE_DEVICES": "0"},
                              options=["--device", f"{node}:/dev/nvidia{gpu0['minor']}"])  # fmt: skip
    finally:
        subprocess.run(["podman", "rmi", "-f", tag], capture_output=True)
    assert out.returncode == 0, out.stderr
    assert listed_uuids(out.stdout, ("GPU",)) == [gpu0["uuid"]]
