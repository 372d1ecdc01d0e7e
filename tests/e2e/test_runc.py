"""The hook in real runc containers on a simulated GPU host (root, runc, busybox-static, gcc)."""

import json
import os
import re

import pytest
from hookcheck import config_with, listed_uuids

from oci_gpu_hook.toolkit import containers

pytestmark = pytest.mark.host(gpus=4, mig=[2], scramble_minors=True, needs=("runc", "busybox"))


def run(tmp_path, host, script, env, debian=False, config=None, with_hook=True, name="c"):
    bundle = containers.make_bundle(
        str(tmp_path / f"bundle-{name}"), rootfs_debian=debian, args=["sh", "-c", script], env=env,
        config_file=config or f"{host['root']}/config.yaml", with_hook=with_hook,
    )  # fmt: skip
    return containers.runc_run(bundle, f"ocigpu-{os.getpid()}-{name}")


def gpu(host, i):
    return host["gpus"][i]


CASES = {
    # all: every GPU and every MIG device (nvidia-smi lists each GPU, then its MIG devices)
    "all": lambda h: [u for g in h["gpus"] for u in [g["uuid"]] + [m["uuid"] for m in g["mig"]]],
    "1": lambda h: [gpu(h, 1)["uuid"]],
    "uuid": lambda h: [gpu(h, 3)["uuid"]],
    "0,3": lambda h: [gpu(h, 0)["uuid"], gpu(h, 3)["uuid"]],
    "2:1": lambda h: [gpu(h, 2)["uuid"], gpu(h, 2)["mig"][1]["uuid"]],
}


@pytest.mark.parametrize("debian", [False, True], ids=["lib64-rootfs", "debian-rootfs"])
@pytest.mark.parametrize("case", list(CASES))
def test_nvidia_smi_lists_exactly_the_requested_gpus(tmp_path, host, case, debian):
    value = gpu(host, 3)["uuid"] if case == "uuid" else case
    out = run(tmp_path, host, "nvidia-smi -L", {"NVIDIA_VISIBLE_DEVICES": value}, debian=debian)
    assert out.returncode == 0, out.stderr
    assert listed_uuids(out.stdout) == CASES[case](host)


def test_all_gives_every_mig_devices_capability_nodes(tmp_path, host):
    """As with NVIDIA's hook: `all` on a host with a MIG GPU gives the GPU instance and compute
    instance capability nodes of every MIG device, so the instances can be used inside."""
    migs = gpu(host, 2)["mig"]
    out = run(tmp_path, host, "ls /dev/nvidia-caps", {"NVIDIA_VISIBLE_DEVICES": "all"})
    assert out.returncode == 0, out.stderr
    expected = {f"nvidia-cap{m[k]}" for m in migs for k in ("gi_cap_minor", "ci_cap_minor")}
    assert set(out.stdout.split()) == expected and len(expected) == 2 * len(migs)


def test_none_gives_a_working_nvidia_smi_and_no_gpu(tmp_path, host):
    script = "nvidia-smi -L; echo rc=$?; ls /dev"
    out = run(tmp_path, host, script, {"NVIDIA_VISIBLE_DEVICES": "none"})
    assert out.returncode == 0, out.stderr
    assert "No devices were found" in out.stdout and "rc=6" in out.stdout
    devs = out.stdout.split("rc=6", 1)[1].split()
    assert "nvidiactl" in devs and not [d for d in devs if re.fullmatch(r"nvidia\d+", d)]


MOUNTS = "cut -d' ' -f5 /proc/self/mountinfo | sort; ls /usr/bin /usr/lib64"


@pytest.mark.parametrize("env", [{"NVIDIA_VISIBLE_DEVICES": "void"}, {}], ids=["void", "unset"])
def test_non_gpu_container_is_untouched(tmp_path, host, env):
    with_hook = run(tmp_path, host, MOUNTS, env, name="hook")
    without = run(tmp_path, host, MOUNTS, env, with_hook=False, name="plain")
    assert with_hook.returncode == 0 and without.returncode == 0, with_hook.stderr + without.stderr
    assert with_hook.stdout == without.stdout
    assert "nvidia" not in with_hook.stdout


def test_requested_gpu_is_allowed_by_the_device_cgroup(tmp_path, host):
    minor = gpu(host, 1)["minor"]
    other = gpu(host, 0)["minor"]
    script = f"dd if=/dev/nvidia{minor} of=/dev/null count=1; test -e /dev/nvidia{other} && echo OTHER-PRESENT"
    out = run(tmp_path, host, script, {"NVIDIA_VISIBLE_DEVICES": "1"})
    # No driver serves major 195 here: the cgroup allowed the open, the kernel found no device.
    assert "No such device or address" in out.stdout + out.stderr
    assert "OTHER-PRESENT" not in out.stdout


def test_cgroups_off_leaves_the_device_denied(tmp_path, host):
    minor = gpu(host, 1)["minor"]
    config = config_with(host, tmp_path, "cgroups: off\n")
    out = run(tmp_path, host, f"dd if=/dev/nvidia{minor} of=/dev/null count=1", {"NVIDIA_VISIBLE_DEVICES": "1"},
              config=config)  # fmt: skip
    assert "Operation not permitted" in out.stdout + out.stderr


def test_failure_reaches_the_user_as_one_line(tmp_path, host):
    out = run(tmp_path, host, "true", {"NVIDIA_VISIBLE_DEVICES": "7"})
    assert out.returncode != 0
    refused = "NVIDIA_VISIBLE_DEVICES=7: no GPU 7 (this host has GPUs 0-3 and MIG devices 2:0-2:2)"
    assert f"oci-gpu-hook: {refused}" in out.stderr
    records = [json.loads(line) for line in open(f"{host['root']}/hook.log")]
    assert any(r["message"] == refused and r["container"].startswith("ocigpu-") for r in records)


def test_graphics_gets_the_application_profile_and_video_the_opticalflow_link(tmp_path, host):
    """The EGL application profile limits EGL to the container's GPU by its device minor, in a
    read-only tmpfs; video brings the libnvidia-opticalflow.so development link."""
    profile = "/etc/nvidia/nvidia-application-profiles-rc.d/10-container.conf"
    script = (f"cat {profile}; touch {profile}.x 2>/dev/null && echo WRITABLE; "
              "readlink /usr/lib64/libnvidia-opticalflow.so")  # fmt: skip
    out = run(tmp_path, host, script, {"NVIDIA_VISIBLE_DEVICES": "3", "NVIDIA_DRIVER_CAPABILITIES": "graphics,video"})
    assert out.returncode == 0, out.stderr
    text, link = out.stdout.rsplit("\n", 2)[:2]
    minor = gpu(host, 3)["minor"]
    assert text == ('{"profiles": [{"name": "_container_", "settings": ["EGLVisibleDGPUDevices", '
                    f'{hex(1 << minor)}]}}], "rules": [{{"pattern": [], "profile": "_container_"}}]}}')  # fmt: skip
    assert link == "libnvidia-opticalflow.so.1" and "WRITABLE" not in out.stdout


def test_graphics_gets_the_gpus_drm_nodes(tmp_path, host):
    """graphics: the chosen GPU's /dev/dri card and render nodes (char 226) and their by-path
    links; compute alone: no /dev/dri."""
    g = gpu(host, 1)
    card, render = f"card{g['index'] + 1}", f"renderD{128 + g['index']}"
    by_path = f"/dev/dri/by-path/pci-{g['bus_id']}"
    script = f"ls /dev/dri; stat -c '%t:%T' /dev/dri/{card}; readlink {by_path}-card; readlink {by_path}-render"
    out = run(tmp_path, host, script, {"NVIDIA_VISIBLE_DEVICES": "1", "NVIDIA_DRIVER_CAPABILITIES": "graphics"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["by-path", card, render, f"e2:{g['index'] + 1:x}", f"../{card}", f"../{render}"]
    out = run(tmp_path, host, "ls /dev/dri 2>&1", {"NVIDIA_VISIBLE_DEVICES": "1"}, name="compute")
    assert "No such file or directory" in out.stdout
