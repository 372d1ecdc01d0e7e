"""cdi generate: the spec's shape, its version, the schema, and podman using it for real."""

import json
import os
import subprocess

import jsonschema
import pytest
import yaml
from hookcheck import cdi_spec_in_etc, listed_uuids

from oci_gpu_hook.errors import HookError
from oci_gpu_hook.start import inventory_cache, settings
from oci_gpu_hook.toolkit import cdi, containers, install

pytestmark = pytest.mark.host(gpus=4, mig=[2], scramble_minors=True)

SCHEMA = cdi.load_schema()
MOUNT_WITH_TYPE = {"hostPath": "/a", "containerPath": "/a", "type": "bind"}
NODE_WITH_HOST_PATH = {"path": "/dev/x", "hostPath": "/dev/y"}


def schema_errors(doc):
    return list(jsonschema.Draft7Validator(SCHEMA).iter_errors(doc))


def minimal(**edits):
    return {"cdiVersion": "0.3.0", "kind": "vendor.com/dev",
            "devices": [{"name": "dev0", "containerEdits": {"env": ["A=1"]}}], **edits}  # fmt: skip


# --- version rules and schema (no host needed) --------------------------------------------------


@pytest.mark.parametrize(
    "change, version",
    [
        (lambda d: None, "0.3.0"),
        (lambda d: d["devices"][0]["containerEdits"].update(mounts=[MOUNT_WITH_TYPE]), "0.4.0"),
        (lambda d: d["devices"][0].update(name="0"), "0.5.0"),
        (lambda d: d["devices"][0]["containerEdits"].update(deviceNodes=[NODE_WITH_HOST_PATH]), "0.5.0"),
        (lambda d: d.update(annotations={"a": "b"}), "0.6.0"),
        (lambda d: d.update(kind="vendor.com/dev.sub"), "0.6.0"),
        (lambda d: d.update(containerEdits={"additionalGids": [5]}), "0.7.0"),
    ],
)
def test_required_version(change, version):
    doc = minimal()
    change(doc)
    assert cdi.required_version(doc) == version
    assert schema_errors(doc) == []


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.pop("kind"),
        lambda d: d.update(kind="nvidia"),
        lambda d: d.update(devices=[]),
        lambda d: d["devices"][0].update(name="-bad"),
        lambda d: d["devices"][0].update(containerEdits={}),
        lambda d: d["devices"][0]["containerEdits"].update(deviceNodes=[{"path": "dev/x"}]),
        lambda d: d["devices"][0]["containerEdits"].update(deviceNodes=[{"path": "/dev/x", "type": "x"}]),
        lambda d: d["devices"][0]["containerEdits"].update(mounts=[{"hostPath": "/a"}]),
        lambda d: d["devices"][0]["containerEdits"].update(hooks=[{"hookName": "prestrat", "path": "/bin/true"}]),
        lambda d: d["devices"][0]["containerEdits"].update(unknown=1),
        lambda d: d.update(cdiVersion="0.5"),
    ],
)
def test_schema_rejects(change):
    doc = minimal()
    change(doc)
    assert schema_errors(doc)


def test_validate_rejects_a_version_below_what_the_fields_need():
    doc = minimal()
    doc["devices"][0]["name"] = "0"
    with pytest.raises(HookError, match="need 0.5.0"):
        cdi.validate(doc)


def test_warning_for_another_spec_of_the_same_kind(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "etc" / "nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: []\n")
    (tmp_path / "run" / "other.json").write_text(json.dumps({"kind": "example.com/x"}))
    (tmp_path / "run" / "broken.yaml").write_text(": : :\n")
    ours = str(tmp_path / "run" / "ours.yaml")
    dirs = (str(tmp_path / "etc"), str(tmp_path / "run"))
    assert cdi.other_specs_with_kind("nvidia.com/gpu", ours, dirs) == [str(tmp_path / "etc" / "nvidia.yaml")]
    assert cdi.other_specs_with_kind("nvidia.com/gpu", str(tmp_path / "etc" / "nvidia.yaml"), dirs) == []


# --- the generated spec ---------------------------------------------------------------------------


def test_generated_spec(host):
    config = settings.load(f"{host['root']}/config.yaml")
    spec = cdi.build_spec(inventory_cache.load(config), config)
    cdi.validate(spec)
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == "nvidia.com/gpu"
    devices = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    expected = {"all"}
    for gpu in host["gpus"]:
        expected |= {str(gpu["index"]), gpu["uuid"]}
        expected |= {f"{gpu['index']}:{m['index']}" for m in gpu["mig"]} | {m["uuid"] for m in gpu["mig"]}
    assert set(devices) == expected
    gpu1 = host["gpus"][1]
    node = {"path": f"/dev/nvidia{gpu1['minor']}", "hostPath": f"{host['root']}/dev/nvidia{gpu1['minor']}",
            "type": "c", "major": 195, "minor": gpu1["minor"]}  # fmt: skip
    assert devices["1"]["deviceNodes"] == devices[gpu1["uuid"]]["deviceNodes"] == [node]
    # Each device names itself to the hook, which records the container (issue 39, item 7).
    assert devices["1"]["env"] == ["OCI_GPU_HOOK_CDI_DEVICE_1=1"]
    assert devices[gpu1["uuid"]]["env"] == [f"OCI_GPU_HOOK_CDI_DEVICE_{gpu1['uuid'].replace('-', '_')}={gpu1['uuid']}"]
    assert devices["2:0"]["env"] == ["OCI_GPU_HOOK_CDI_DEVICE_2_0=2:0"] and devices["all"]["env"] == [
        "OCI_GPU_HOOK_CDI_DEVICE_all=all"]  # fmt: skip
    # all: every GPU node, and both capability nodes of every MIG device (as NVIDIA's spec has)
    migs = [m for gpu in host["gpus"] for m in gpu["mig"]]
    assert len(devices["all"]["deviceNodes"]) == len(host["gpus"]) + 2 * len(migs) and migs
    all_minors = {(n["major"], n["minor"]) for n in devices["all"]["deviceNodes"]}
    caps_major = devices["2:0"]["deviceNodes"][1]["major"]
    assert {(caps_major, m[k]) for m in migs for k in ("gi_cap_minor", "ci_cap_minor")} <= all_minors
    mig = host["gpus"][2]["mig"][0]
    assert [n["minor"] for n in devices["2:0"]["deviceNodes"]] == [host["gpus"][2]["minor"], mig["gi_cap_minor"],
                                                                   mig["ci_cap_minor"]]  # fmt: skip
    edits = spec["containerEdits"]
    assert [n["path"] for n in edits["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    targets = {m["containerPath"]: m for m in edits["mounts"]}
    lib = f"/usr/lib64/libnvidia-ml.so.{host['driver_version']}"
    assert targets[lib]["options"] == ["ro", "nosuid", "nodev", "bind"]
    assert "/usr/bin/nvidia-smi" in targets and not any(t.startswith("/proc") for t in targets)
    [hook] = edits["hooks"]
    assert hook["hookName"] == "createContainer" and hook["env"] == install.HOOK_ENV
    assert "ldcache-refresh" in hook["args"] and "/usr/lib64/libcuda.so=libcuda.so.1" in hook["args"]
    assert hook["args"][hook["args"].index("--dir") + 1] == "/usr/lib64"


def test_cli_output_formats_and_errors(host, hook_cli, tmp_path):
    config = f"{host['root']}/config.yaml"
    out = hook_cli("--config", config, "cdi", "generate")
    assert out.returncode == 0, out.stderr
    cdi.validate(yaml.safe_load(out.stdout))
    target = tmp_path / "spec.json"
    written = hook_cli("--config", config, "cdi", "generate", "--output", str(target))
    assert written.returncode == 0, written.stderr
    cdi.validate(json.loads(target.read_text()))
    assert [p.name for p in tmp_path.iterdir()] == ["spec.json"]  # no temporary file left
    for args, words in ((["--vendor-class", "nvidia"], "expected VENDOR/CLASS"),
                        (["--capabilities", "compute,bogus"], "unknown capability")):  # fmt: skip
        bad = hook_cli("--config", config, "cdi", "generate", *args)
        assert bad.returncode == 2 and words in bad.stderr and bad.stderr.count("\n") == 1


def test_output_goes_only_where_it_is_told(host, hook_cli, tmp_path):
    """A missing directory is an error, not made (issue 32), unless --parents says to make it."""
    config = f"{host['root']}/config.yaml"
    target = tmp_path / "missing" / "dir" / "x.yaml"
    out = hook_cli("--config", config, "cdi", "generate", "--output", str(target))
    assert out.returncode == 13 and out.stderr == f"oci-gpu-hook: {target.parent}: no such directory (--parents " \
                                                  "makes it)\n"  # fmt: skip
    assert not (tmp_path / "missing").exists()
    made = hook_cli("--config", config, "cdi", "generate", "--parents", "--output", str(target))
    assert made.returncode == 0, made.stderr
    cdi.validate(yaml.safe_load(target.read_text()))


# --- podman, for real ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def podman_spec(host, require, tmp_path_factory):
    """The generated spec in /etc/cdi and an image; both removed afterwards."""
    require("root", "podman", "runc", "busybox", "gcc")
    from oci_gpu_hook.cli import main  # noqa: F401 - the CLI must import cleanly

    with cdi_spec_in_etc(host, f"oci-gpu-hook-test-{os.getpid()}.yaml") as path:
        work = tmp_path_factory.mktemp("cdi")
        rootfs = containers.make_rootfs(str(work / "rootfs"))
        image = containers.podman_image(rootfs, f"localhost/ocigpu-cdi-{os.getpid()}:latest")
        try:
            yield path, image
        finally:
            subprocess.run(["podman", "rmi", "-f", image], capture_output=True)


def podman_device(image, device, *args):
    argv = ["podman", "run", "--rm", *containers.PODMAN_OPTIONS, "--device", device, image, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_podman_runs_the_spec_for_one_gpu(host, podman_spec):
    path, image = podman_spec
    cdi.validate(yaml.safe_load(open(path)))
    out = podman_device(image, "nvidia.com/gpu=1", "nvidia-smi", "-L")
    assert out.returncode == 0, out.stderr
    assert listed_uuids(out.stdout, ("GPU",)) == [host["gpus"][1]["uuid"]]


def test_podman_runs_the_spec_for_all_gpus(host, podman_spec):
    _, image = podman_spec
    out = podman_device(image, "nvidia.com/gpu=all", "nvidia-smi", "-L")
    assert out.returncode == 0, out.stderr
    assert listed_uuids(out.stdout, ("GPU",)) == [g["uuid"] for g in host["gpus"]]


def test_podman_all_gives_the_mig_capability_nodes(host, podman_spec):
    _, image = podman_spec
    out = podman_device(image, "nvidia.com/gpu=all", "sh", "-c", "ls /dev/nvidia-caps; nvidia-smi -L")
    assert out.returncode == 0, out.stderr
    migs = [m for g in host["gpus"] for m in g["mig"]]
    expected = {f"nvidia-cap{m[k]}" for m in migs for k in ("gi_cap_minor", "ci_cap_minor")}
    assert expected and expected <= set(out.stdout.split())
    assert set(listed_uuids(out.stdout, ("MIG",))) == {m["uuid"] for m in migs}


def test_podman_spec_by_uuid_and_mig_and_the_hooks_work(host, podman_spec):
    _, image = podman_spec
    gpu = host["gpus"][3]
    out = podman_device(image, f"nvidia.com/gpu={gpu['uuid']}", "sh", "-c",
                        "nvidia-smi -L; readlink /usr/lib64/libcuda.so; readlink /usr/lib64/libnvidia-ml.so.1; "
                        "grep -c libnvidia-ml.so.1 /etc/ld.so.cache; echo $NVIDIA_VISIBLE_DEVICES")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert listed_uuids(out.stdout, ("GPU",)) == [gpu["uuid"]]
    assert out.stdout.split("\n")[-5:] == ["libcuda.so.1", f"libnvidia-ml.so.{host['driver_version']}", "1", "void", ""]
    mig = host["gpus"][2]["mig"][1]
    out = podman_device(image, "nvidia.com/gpu=2:1", "nvidia-smi", "-L")
    assert out.returncode == 0, out.stderr
    assert listed_uuids(out.stdout, ("MIG",)) == [mig["uuid"]]


def test_a_higher_version_than_needed_would_lock_out_podman_4_3(podman_spec):
    """Why the lowest version: podman 4.3's CDI loader knows versions up to 0.5.0 and refuses a spec
    labelled 0.6.0 (newer loaders, for their part, refuse digit names and hostPath below 0.5.0)."""
    version = subprocess.run(["podman", "--version"], capture_output=True, text=True).stdout.split()[-1]
    if not version.startswith("4.3."):
        pytest.skip(f"the version limit checked here is podman 4.3's; this is podman {version}")
    path, image = podman_spec
    original = open(path).read()
    assert "cdiVersion: 0.5.0" in original
    try:
        with open(path, "w") as f:
            f.write(original.replace("cdiVersion: 0.5.0", "cdiVersion: 0.6.0"))
        out = podman_device(image, "nvidia.com/gpu=1", "true")
        assert out.returncode != 0 and "unresolvable CDI devices" in out.stderr
    finally:
        with open(path, "w") as f:
            f.write(original)


def test_spec_carries_nvidias_cdi_development_links(host):
    """As NVIDIA's CDI specs: libnvidia-ml.so, and with graphics the GBM backend link (the hook
    adds neither; libnvidia-opticalflow.so it adds in both)."""
    config = settings.load(f"{host['root']}/config.yaml")
    spec = cdi.build_spec(inventory_cache.load(config), config, capabilities=cdi.parse_capabilities("all"))
    (hook,) = spec["containerEdits"]["hooks"]
    links = {hook["args"][i + 1] for i, arg in enumerate(hook["args"]) if arg == "--link"}
    assert {
        "/usr/lib64/libnvidia-ml.so=libnvidia-ml.so.1",
        "/usr/lib64/gbm/nvidia-drm_gbm.so=../libnvidia-allocator.so.1",
        "/usr/lib64/libnvidia-opticalflow.so=libnvidia-opticalflow.so.1",
    } <= links
