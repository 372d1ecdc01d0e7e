"""Every shape of NVIDIA's Kubernetes device plugin's Allocate answer, as the config.json a runtime
makes of it, run through runc with the hook: the container gets exactly the allocated GPUs.

The shapes: the environment variable (UUIDs or indices); volume-mount device lists (/dev/null at
/var/run/nvidia-container-devices/<id>, the variable set to that directory); CDI annotations
(cdi.k8s.io/<prefix><id> = nvidia.com/gpu=<id>); and device specs (PASS_DEVICE_SPECS: the runtime
makes the /dev/nvidia* nodes itself and allows them in the device cgroup), each under the default
settings and under `accept_envvar_when_unprivileged: false`, where the image's or pod's own
NVIDIA_VISIBLE_DEVICES must not widen what was allocated.
"""

import json
import os
import re

import pytest
from hookcheck import config_with

from oci_gpu_hook.toolkit import containers

VOLUME_DIR = "/var/run/nvidia-container-devices"
STRICT = "accept_volume_mounts: true\naccept_envvar_when_unprivileged: false\n"
ANNOTATIONS = "accept_cdi_annotations: true\n"
SHOW = "nvidia-smi -L; ls /dev"


@pytest.fixture(scope="module")
def host(simulated_host, require):
    require("root", "runc", "busybox", "gcc")
    return simulated_host(gpus=4, mig=[2], scramble_minors=True)


def node(host, path):
    st = os.stat(os.path.join(host["root"], path.lstrip("/")))
    return {"path": path, "type": "c", "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev),
            "fileMode": 0o666, "uid": 0, "gid": 0}  # fmt: skip


def allocate(host, tmp_path, name, shape, ids, settings="", env=None):
    """A bundle as the runtime would make it from an Allocate answer of this shape for ids."""
    env = dict(env or {})
    if shape == "envvar":
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(ids)
    elif shape == "volume-mounts":
        env["NVIDIA_VISIBLE_DEVICES"] = VOLUME_DIR
    bundle = containers.make_bundle(str(tmp_path / name), args=["sh", "-c", SHOW], env=env,
                                    config_file=config_with(host, tmp_path, settings))  # fmt: skip
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        config = json.load(f)
    if shape == "volume-mounts":
        config["mounts"] += [{"destination": f"{VOLUME_DIR}/{i}", "type": "bind", "source": "/dev/null",
                              "options": ["rbind", "ro"]} for i in ids]  # fmt: skip
    elif shape == "cdi-annotations":
        config["annotations"] = {f"cdi.k8s.io/nvidia-device-plugin_{i}": f"nvidia.com/gpu={i}" for i in ids}
    elif shape == "device-specs":
        env_line = f"NVIDIA_VISIBLE_DEVICES={','.join(ids)}"
        config["process"]["env"].append(env_line)
        gpus = [g for g in host["gpus"] if g["uuid"] in ids or str(g["index"]) in ids]
        nodes = [node(host, "/dev/nvidiactl"), node(host, "/dev/nvidia-uvm"), node(host, "/dev/nvidia-uvm-tools")]
        nodes += [node(host, f"/dev/nvidia{g['minor']}") for g in gpus]
        config["linux"]["devices"] = nodes
        config["linux"]["resources"]["devices"] += [
            {"allow": True, "type": "c", "major": n["major"], "minor": n["minor"], "access": "rwm"} for n in nodes
        ]
    with open(path, "w") as f:
        json.dump(config, f)
    return bundle


def run(bundle, name):
    out = containers.runc_run(bundle, f"ocigpu-{os.getpid()}-dp-{name}")
    assert out.returncode == 0, out.stderr
    return out.stdout


def got(host, stdout):
    """(UUIDs nvidia-smi lists, GPU indices whose nodes are in /dev)."""
    listed = re.findall(r"UUID: (GPU-[0-9a-f-]+)\)", stdout)
    minors = {int(m) for m in re.findall(r"^nvidia(\d+)$", stdout, re.M)}
    return listed, sorted(g["index"] for g in host["gpus"] if g["minor"] in minors)


SHAPES = [
    # (shape, id strategy, settings)
    ("envvar", "uuid", ""),
    ("envvar", "index", ""),
    ("volume-mounts", "uuid", STRICT),
    ("volume-mounts", "index", STRICT),
    ("volume-mounts", "uuid", "accept_volume_mounts: true\n"),
    ("cdi-annotations", "uuid", ANNOTATIONS),
    ("cdi-annotations", "index", ANNOTATIONS),
    ("device-specs", "uuid", ""),
    ("device-specs", "index", ""),
]


@pytest.mark.parametrize("shape, strategy, settings", SHAPES,
                         ids=[f"{s}-{i}{'-strict' if 'false' in c else ''}" for s, i, c in SHAPES])  # fmt: skip
def test_exactly_the_allocated_gpus(tmp_path, host, shape, strategy, settings):
    allocated = [1, 3]
    ids = [host["gpus"][i]["uuid"] if strategy == "uuid" else str(i) for i in allocated]
    # With CDI annotations the variable stays the image's own (CUDA images say "all"): the
    # annotations must win. The other shapes set the variable themselves.
    image_env = {"NVIDIA_VISIBLE_DEVICES": "all"} if shape == "cdi-annotations" else {}
    bundle = allocate(host, tmp_path, "b", shape, ids, settings, image_env)
    listed, nodes = got(host, run(bundle, "b"))
    assert listed == [host["gpus"][i]["uuid"] for i in allocated]
    assert nodes == allocated


def test_cdi_annotations_win_over_the_images_variable(tmp_path, host):
    ids = [host["gpus"][2]["uuid"]]
    bundle = allocate(host, tmp_path, "a", "cdi-annotations", ids, ANNOTATIONS, {"NVIDIA_VISIBLE_DEVICES": "all"})
    listed, nodes = got(host, run(bundle, "a"))
    assert listed == ids and nodes == [2]


def test_strict_settings_ignore_the_variable_of_an_unprivileged_container(tmp_path, host):
    """accept_envvar_when_unprivileged: false, and the variable alone (no mounts): no GPU at all,
    whatever the variable says; the volume mounts are the only way in."""
    bundle = allocate(host, tmp_path, "s", "envvar", ["all"], STRICT)
    listed, nodes = got(host, run(bundle, "s"))
    assert listed == [] and nodes == []


def test_strict_settings_volume_mounts_beat_a_forged_variable(tmp_path, host):
    """A pod that also sets NVIDIA_VISIBLE_DEVICES=all next to its one allocated mount gets the one."""
    ids = [host["gpus"][0]["uuid"]]
    bundle = allocate(host, tmp_path, "f", "volume-mounts", ids, STRICT)
    path = os.path.join(bundle, "config.json")
    config = json.load(open(path))
    config["process"]["env"] = [e for e in config["process"]["env"] if not e.startswith("NVIDIA_VISIBLE_DEVICES=")]
    config["process"]["env"].append("NVIDIA_VISIBLE_DEVICES=all")
    json.dump(config, open(path, "w"))
    listed, nodes = got(host, run(bundle, "f"))
    assert listed == ids and nodes == [0]
