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
import subprocess

import pytest
from hookcheck import cdi_spec_in_etc, config_with, listed_uuids, runc_delete, runc_detached

from oci_gpu_hook.toolkit import containers

pytestmark = pytest.mark.host(gpus=4, mig=[2], scramble_minors=True, needs=("runc", "busybox"))

VOLUME_DIR = "/var/run/nvidia-container-devices"
STRICT = "accept_volume_mounts: true\naccept_envvar_when_unprivileged: false\n"
ANNOTATIONS = "accept_cdi_annotations: true\n"
SHOW = "nvidia-smi -L; ls /dev"


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
    listed = listed_uuids(stdout, ("GPU",))
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


# --- oci-gpu-hook's own device plugin: each Allocate answer, as a runtime turns it into a container


def our_answer(host, settings_text, strategy, id_strategy, picks, sharing=None):
    """(ContainerAllocation, picked plugin_resources.Units) from oci-gpu-hook's plugin (mixed MIG strategy) for
    the devices at positions picks of the resource (nvidia.com/gpu, or the shared one)."""
    from oci_gpu_hook.node.plugin import allocation
    from oci_gpu_hook.node.plugin import config as plugin_config
    from oci_gpu_hook.node.plugin import resources as plugin_resources
    from oci_gpu_hook.start import inventory_cache
    from oci_gpu_hook.start import settings as settings_module

    doc = {"flags": {"migStrategy": "mixed", "plugin": {"deviceListStrategy": strategy,
                                                        "deviceIDStrategy": id_strategy}}}  # fmt: skip
    if sharing:
        doc["sharing"] = {"timeSlicing": {"resources": [sharing]}}
    config = plugin_config.parse(doc, "test")
    settings = settings_module.parse(settings_text, "test")
    resource = next(r for r in plugin_resources.resources(inventory_cache.load(settings), config)
                    if r.name == "nvidia.com/gpu")  # fmt: skip
    ids = [resource.devices[i].id for i in picks]
    answer = allocation.allocate(resource, ids, config, inventory_cache.load(settings), settings.cdi_kind)
    return answer, [resource.devices[i].unit for i in picks]


def bundle_of(host, tmp_path, name, answer, settings_extra, env=None, args=("sh", "-c", SHOW)):
    """The bundle a CRI runtime makes of an Allocate answer: its env after the image's, its mounts
    and annotations, its device specs."""
    env = dict(env or {})
    bundle = containers.make_bundle(str(tmp_path / name), args=list(args), env={**env, **answer.envs},
                                    config_file=config_with(host, tmp_path, settings_extra))  # fmt: skip
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["mounts"] += [{"destination": c, "type": "bind", "source": h, "options": ["rbind", "ro" if r else "rw"]}
                         for c, h, r in answer.mounts]  # fmt: skip
    config["annotations"] = dict(answer.annotations)
    with open(path, "w") as f:
        json.dump(config, f)
    return bundle


OUR_SHAPES = [("envvar", "uuid", ""), ("envvar", "index", ""), ("volume-mounts", "uuid", STRICT),
              ("volume-mounts", "index", STRICT), ("cdi-annotations", "uuid", ANNOTATIONS)]  # fmt: skip


@pytest.mark.parametrize("strategy, id_strategy, settings", OUR_SHAPES,
                         ids=[f"{s}-{i}" for s, i, _ in OUR_SHAPES])  # fmt: skip
def test_our_plugins_answer_gives_exactly_the_allocated_gpus(tmp_path, host, strategy, id_strategy, settings):
    text = open(config_with(host, tmp_path, settings)).read()
    answer, units = our_answer(host, text, strategy, id_strategy, [0, 2])
    uuids = [u.uuid for u in units]
    # The image says all (as CUDA images do): the answer must win, whatever its shape.
    bundle = bundle_of(host, tmp_path, "ours", answer, settings, {"NVIDIA_VISIBLE_DEVICES": "all"})
    listed, _ = got(host, run(bundle, "ours"))
    assert listed == uuids and len(set(uuids)) == 2


def test_our_plugins_memory_limit_reaches_the_record_and_a_pods_own_value_cannot_raise_it(tmp_path, host):
    from oci_gpu_hook.start import container_record

    records = tmp_path / "records"
    settings = f"records_directory: {records}\n"
    text = open(config_with(host, tmp_path, settings)).read()
    shared = {"name": "nvidia.com/gpu", "replicas": 4, "memoryLimit": "per-replica"}
    answer, (unit,) = our_answer(host, text, "envvar", "uuid", [1], sharing=shared)
    assert answer.envs["OCI_GPU_HOOK_GPU_MEMORY_LIMIT"] == "25%"
    # The pod's own variable comes after the plugin's and replaces it; the mount stays.
    bundle = bundle_of(host, tmp_path, "limit", answer, settings, args=("busybox", "sleep", "600"))
    path = os.path.join(bundle, "config.json")
    config = json.load(open(path))
    config["process"]["env"].append("OCI_GPU_HOOK_GPU_MEMORY_LIMIT=100%")
    json.dump(config, open(path, "w"))
    container_id = f"ocigpu-{os.getpid()}-dp-limit"
    pid = runc_detached(bundle, container_id)
    try:
        (record,) = [r for r in container_record.read_all(str(records)).values() if r and r["id"] == container_id]
        assert record["pid"] == pid
        assert record["gpu_memory_limit"] == {unit.uuid: unit.memory_total // 4}
    finally:
        runc_delete(container_id)


def test_our_plugins_cdi_names_give_exactly_the_allocated_gpus_through_podman(tmp_path, host, require):
    """cdi-cri: the runtime (podman here; containerd 1.7+ and CRI-O with the kubelet) resolves the
    names in the answer against the spec `cdi generate` wrote; the hook only refreshes ld.so.cache."""
    require("podman")
    answer, units = our_answer(host, open(f"{host['root']}/config.yaml").read(), "cdi-cri", "uuid", [0, 2])
    assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": "void"} and not answer.mounts
    image = f"localhost/ocigpu-dp-cdi-{os.getpid()}:latest"
    with cdi_spec_in_etc(host, f"oci-gpu-hook-dp-test-{os.getpid()}.yaml"):
        try:
            containers.podman_image(containers.make_rootfs(str(tmp_path / "rootfs")), image)
            argv = ["podman", "run", "--rm", *containers.PODMAN_OPTIONS]
            for name in answer.cdi_devices:
                argv += ["--device", name]
            out = subprocess.run(argv + ["-e", "NVIDIA_VISIBLE_DEVICES=void", image, "nvidia-smi", "-L"],
                                 capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)  # fmt: skip
            assert out.returncode == 0, out.stderr
            assert listed_uuids(out.stdout, ("GPU",)) == [u.uuid for u in units]
        finally:
            subprocess.run(["podman", "rmi", "-f", image], capture_output=True)
