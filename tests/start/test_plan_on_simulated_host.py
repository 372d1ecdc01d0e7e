"""Issue acceptance for request -> inventory -> plan, on a real simulated host (8 GPUs, MIG on 1)."""

import json
import os
import re

import pytest

from oci_gpu_hook.start import driver
from oci_gpu_hook.start.linux import arch
from oci_gpu_hook.toolkit.simulate.model import driver_libraries

pytestmark = pytest.mark.host(gpus=8, mig=[1])


def make_bundle(tmp_path, env, debian=False, caps=()):
    bundle = tmp_path / "bundle"
    (bundle / "rootfs" / "etc").mkdir(parents=True, exist_ok=True)
    if debian:  # what tells the layout is the multiarch directory, as for NVIDIA's hook
        (bundle / "rootfs" / "etc" / "debian_version").write_text("12.0\n")
        (bundle / "rootfs" / arch.current().multiarch.lstrip("/")).mkdir(parents=True)
    config = {
        "ociVersion": "1.0.2",
        "root": {"path": "rootfs"},
        "process": {"env": [f"{k}={v}" for k, v in env.items()], "capabilities": {"bounding": list(caps)}},
        "mounts": [],
    }
    (bundle / "config.json").write_text(json.dumps(config))
    return str(bundle)


def plan(hook_cli, host, tmp_path, env, *, as_json=True, **kw):
    args = ["--config", f"{host['root']}/config.yaml", "plan", "--bundle", make_bundle(tmp_path, env, **kw)]
    out = hook_cli(*args, *(["--json"] if as_json else []))
    return out, (json.loads(out.stdout) if as_json and out.returncode == 0 else None)


def ops(result, name):
    return [op for op in result["operations"] if op["op"] == name]


def device_targets(result):
    return {op["target"] for op in ops(result, "MountDevice")}


def expected_libraries(host, caps):
    return {
        f"{lib.prefix}.{host['driver_version']}"
        for lib in driver_libraries(host["driver_version"])
        if lib.capability in caps
    }


def test_one_gpu_by_uuid(hook_cli, host, tmp_path):
    gpu3 = host["gpus"][3]
    out, result = plan(hook_cli, host, tmp_path, {"NVIDIA_VISIBLE_DEVICES": gpu3["uuid"]})
    assert out.returncode == 0, out.stderr
    nodes = device_targets(result)
    assert f"/dev/nvidia{gpu3['minor']}" in nodes
    assert not {f"/dev/nvidia{g['minor']}" for g in host["gpus"] if g is not gpu3} & nodes
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} <= nodes
    assert "/dev/nvidia-modeset" not in nodes
    libs = {os.path.basename(op["target"]) for op in ops(result, "BindMount") if "/usr/lib64/" in op["target"]}
    assert libs == expected_libraries(host, {"utility", "compute"})
    assert all(op["target"].startswith("/usr/lib64/") for op in ops(result, "BindMount") if ".so." in op["target"])
    rules = {(op["major"], op["minor"]) for op in ops(result, "DeviceRule")}
    assert (195, gpu3["minor"]) in rules and (195, 255) in rules
    assert {op["target"] for op in ops(result, "BindMount") if op["target"].startswith("/usr/bin/")} == {
        f"/usr/bin/{b}" for b in driver.BINARIES["utility"] + driver.BINARIES["compute"]
    }
    gpu_dirs = [op["target"] for op in ops(result, "BindMount") if "/proc/driver/nvidia/gpus/" in op["target"]]
    assert gpu_dirs == [f"/proc/driver/nvidia/gpus/{gpu3['bus_id']}"]
    assert ops(result, "RefreshLdcache")[0]["directories"] == ["/usr/lib64"]
    # Right after the last library: the rest is mounted while ldconfig works.
    names = [op["op"] for op in result["operations"]]
    refresh = names.index("RefreshLdcache")
    assert names[refresh + 1 :].count("RefreshLdcache") == 0 and "MountDevice" not in names[:refresh]
    assert not [op for op in result["operations"][refresh + 1 :] if op.get("target", "").startswith("/usr/lib64/")]


def test_scrambled_minors_follow_the_gpu_not_the_index(hook_cli, simulated_host, tmp_path):
    host = simulated_host(gpus=4, scramble_minors=True)
    out, result = plan(hook_cli, host, tmp_path, {"NVIDIA_VISIBLE_DEVICES": "0"})
    assert out.returncode == 0, out.stderr
    gpu_nodes = {t for t in device_targets(result) if t[len("/dev/nvidia") :].isdigit()}
    assert gpu_nodes == {f"/dev/nvidia{host['gpus'][0]['minor']}"} == {"/dev/nvidia3"}


def test_mig_device_gets_cap_nodes_and_access_files(hook_cli, host, tmp_path):
    out, result = plan(hook_cli, host, tmp_path, {"NVIDIA_VISIBLE_DEVICES": "1:0"})
    assert out.returncode == 0, out.stderr
    gpu1 = host["gpus"][1]
    mig = gpu1["mig"][0]
    nodes = device_targets(result)
    assert {
        f"/dev/nvidia{gpu1['minor']}",
        f"/dev/nvidia-caps/nvidia-cap{mig['gi_cap_minor']}",
        f"/dev/nvidia-caps/nvidia-cap{mig['ci_cap_minor']}",
    } <= nodes
    base = f"/proc/driver/nvidia/capabilities/gpu{gpu1['minor']}/mig/gi{mig['gi']}"
    binds = {op["target"] for op in ops(result, "BindMount")}
    assert {f"{base}/access", f"{base}/ci{mig['ci']}/access"} <= binds
    assert result["devices"][0]["mig_uuid"] == mig["uuid"]
    # the same device by MIG UUID
    out, by_uuid = plan(hook_cli, host, tmp_path, {"NVIDIA_VISIBLE_DEVICES": mig["uuid"]})
    assert by_uuid["operations"] == result["operations"]


def test_none_gives_libraries_and_no_gpu_node(hook_cli, host, tmp_path):
    out, result = plan(hook_cli, host, tmp_path, {"NVIDIA_VISIBLE_DEVICES": "none"})
    assert out.returncode == 0, out.stderr
    assert not [t for t in device_targets(result) if t[len("/dev/nvidia") :].isdigit()]
    assert "/dev/nvidiactl" in device_targets(result)
    assert any("libcuda.so." in op["target"] for op in ops(result, "BindMount"))
    assert result["devices"] == []


def test_void_is_not_a_gpu_container(hook_cli, host, tmp_path):
    out, _ = plan(hook_cli, host, tmp_path, {"NVIDIA_VISIBLE_DEVICES": "void"}, as_json=False)
    assert out.returncode == 0 and out.stdout.startswith("not a GPU container")


def test_unsatisfied_cuda_requirement_and_disable_require(hook_cli, host, tmp_path):
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=99.0"}
    out, _ = plan(hook_cli, host, tmp_path, env)
    assert out.returncode != 0
    assert out.stderr == (
        "oci-gpu-hook: unsatisfied condition: cuda>=99.0, please update your driver to a newer "
        "version, or use an earlier cuda container\n"
    )
    out, result = plan(hook_cli, host, tmp_path, dict(env, NVIDIA_DISABLE_REQUIRE="true"))
    assert out.returncode == 0, out.stderr


def test_arch_and_brand_requirements_use_nvml_facts(hook_cli, host, tmp_path):
    ok = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_REQUIRE_ARCH": "arch>=8.0 brand=tesla"}
    assert plan(hook_cli, host, tmp_path, ok)[0].returncode == 0
    out, _ = plan(hook_cli, host, tmp_path, {"NVIDIA_VISIBLE_DEVICES": "2", "NVIDIA_REQUIRE_X": "arch>=9.0"})
    assert out.returncode != 0 and "unsatisfied condition: arch>=9.0" in out.stderr


def test_debian_rootfs_gets_multiarch_dirs_and_all_capabilities(hook_cli, host, tmp_path):
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "all"}
    out, result = plan(hook_cli, host, tmp_path, env, debian=True)
    assert out.returncode == 0, out.stderr
    targets = {op["target"] for op in ops(result, "BindMount")}
    multiarch, multiarch32 = arch.current().multiarch, arch.current().multiarch32  # x86_64: x86_64-linux-gnu
    assert f"{multiarch}/libGLX_nvidia.so.{host['driver_version']}" in targets
    if host["lib32"] and multiarch32:
        assert f"{multiarch32}/libcuda.so.{host['driver_version']}" in targets
    # The simulator's configuration and data files, each at its own path (OpenCL's is compute's).
    simulated = {p for paths in driver.CONFIG_FILES.values() for p in paths if os.path.exists(host["root"] + p)}
    assert simulated and simulated <= targets
    links = {op["target"]: op["value"] for op in ops(result, "Symlink")}
    assert links[f"{multiarch}/libcuda.so"] == "libcuda.so.1"
    assert links[f"{multiarch}/libGLX_indirect.so.0"] == f"libGLX_nvidia.so.{host['driver_version']}"
    assert "/dev/nvidia-modeset" in device_targets(result)


def test_unknown_device_is_one_line(hook_cli, host, tmp_path):
    out, _ = plan(hook_cli, host, tmp_path, {"NVIDIA_VISIBLE_DEVICES": "0,12"})
    has = "this host has GPUs 0-7 and MIG devices 1:0-1:2"
    assert out.returncode == 5 and out.stderr == f"oci-gpu-hook: NVIDIA_VISIBLE_DEVICES=0,12: no GPU 12 ({has})\n"


def test_human_plan_is_readable(hook_cli, host, tmp_path):
    out, _ = plan(hook_cli, host, tmp_path, {"NVIDIA_VISIBLE_DEVICES": "1:0"}, as_json=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("request: devices: 1:0 (from env); capabilities: compute, utility")
    assert "devices: MIG 1:0 (MIG-" in out.stdout and "  1. bind    /usr/lib64/" in out.stdout
    assert re.search(r"\n +\d+\. device  /dev/nvidiactl \(char 195:255\) from ", out.stdout)


def test_info_json_agrees_with_the_simulator(hook_cli, host):
    out = hook_cli("--config", f"{host['root']}/config.yaml", "info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["driver_version"] == host["driver_version"] and info["cuda_version"] == host["cuda_version"]
    assert [(g["uuid"], g["minor"], g["bus_id"]) for g in info["gpus"]] == [
        (g["uuid"], g["minor"], g["bus_id"]) for g in host["gpus"]
    ]
    assert [[(m["gi"], m["ci"], m["uuid"]) for m in g["mig"]] for g in info["gpus"]] == [
        [(m["gi"], m["ci"], m["uuid"]) for m in g["mig"]] for g in host["gpus"]
    ]
    caps = [[(m["gi_cap"]["minor"], m["ci_cap"]["minor"]) for m in g["mig"]] for g in info["gpus"]]
    assert caps == [[(m["gi_cap_minor"], m["ci_cap_minor"]) for m in g["mig"]] for g in host["gpus"]]
    libs = {f["path"] for f in info["files"] if f["kind"] == "library"}
    vdpau = {driver.VDPAU_PREFIX: driver.VDPAU_DIR + "/"}  # the backend is in vdpau/ (not in the ld cache)
    assert libs == {f"/usr/lib64/{vdpau.get(lib['prefix'], '')}{lib['prefix']}.{host['driver_version']}"
                    for lib in host["libraries"]}  # fmt: skip
    assert all(g["brand"] == "Tesla" and g["compute_capability"] == "8.0" for g in info["gpus"])


# What config.json holds, by case, on a runtime with or without CDI: "mounts" and "devices" are what
# a runtime that applied the spec `cdi generate` wrote puts there; the rest is what a pod's own
# hostPath mounts (or a privileged pod's devices) put there on a runtime that only passes the
# cdi.k8s.io annotations on.
CDI_CASES = {
    "a runtime without CDI": lambda t: ([], []),
    "everything the CDI spec gives": lambda t: (t["mounts"], t["devices"]),
    "the host's MPS pipe directory": lambda t: ([t["mps"]], []),
    "one driver file": lambda t: (t["mounts"][:1], []),
    "every driver file, no device node": lambda t: (t["mounts"], []),
    "every device node, no driver file": lambda t: ([], t["devices"]),
    "everything but the GPU's own node": lambda t: (t["mounts"], [d for d in t["devices"] if d != t["gpu_node"]]),
    "everything but one driver file": lambda t: (t["mounts"][1:], t["devices"]),
    "every node with other numbers": lambda t: (t["mounts"], [{**d, "minor": d["minor"] + 1} for d in t["devices"]]),
    "an unrelated mount": lambda t: ([{"destination": "/etc/hosts", "source": "/etc/hosts", "type": "bind"}], []),
    "every driver file elsewhere": lambda t: (
        [{**m, "destination": "/opt" + m["destination"]} for m in t["mounts"]],
        [],
    ),
    "other files at the driver files' places": lambda t: (
        [{**m, "source": m["source"] + ".old"} for m in t["mounts"]],
        [],
    ),
}
# The cases where no mount of config.json is one of the plan's binds (the same file at the same place).
NONE_OF_THE_PLANS = ("an unrelated mount", "every driver file elsewhere", "other files at the driver files' places")


@pytest.mark.parametrize("case", CDI_CASES)
def test_the_hook_stands_down_only_where_the_runtime_applied_every_cdi_edit(host, tmp_path, case):
    """With accept_cdi_annotations, the hook reads the cdi.k8s.io annotations; a runtime that
    applies CDI (CRI-O) has already applied them from the spec `cdi generate` wrote, and the hook
    stands down rather than fail on the runtime's mounts. That is told by every device node and
    every driver file the plan would give, in config.json's linux.devices and mounts, never by one
    path: a legitimate MPS client that mounts the host's /tmp/nvidia-mps on a runtime without
    CDI, or a pod that mounts driver files of its own, still gets its GPU node, its rule and its
    record from the hook."""
    from hookcheck import config_with

    from oci_gpu_hook.start import inventory_cache
    from oci_gpu_hook.start import settings as settings_module
    from oci_gpu_hook.start import spec as spec_module
    from oci_gpu_hook.start.plan import BindMount, decide
    from oci_gpu_hook.toolkit import cdi

    settings = settings_module.load(config_with(host, tmp_path, "accept_cdi_annotations: true\n"))
    inventory = inventory_cache.load(settings)
    gpu = host["gpus"][0]
    spec = cdi.build_spec(inventory, settings)
    (own,) = [d["containerEdits"]["deviceNodes"] for d in spec["devices"] if d["name"] == gpu["uuid"]]
    nodes = spec["containerEdits"]["deviceNodes"] + own
    given = {
        "mounts": [{"destination": m["containerPath"], "source": m["hostPath"], "type": "bind"}
                   for m in spec["containerEdits"]["mounts"]],
        # As the runtime writes a CDI device node into config.json (with its mode, uid and gid).
        "devices": [{"path": n["path"], "type": n["type"], "major": n["major"], "minor": n["minor"],
                     "fileMode": 0o666, "uid": 0, "gid": 0} for n in nodes],
        "gpu_node": None,
    }  # fmt: skip
    (given["gpu_node"],) = [d for d in given["devices"] if d["path"] == f"/dev/nvidia{gpu['minor']}"]

    def decided(mounts, devices):
        doc = {"root": {"path": "rootfs"}, "process": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}, "mounts": mounts,
               "linux": {"devices": devices},
               "annotations": {"cdi.k8s.io/oci-gpu-hook_nvidia.com_gpu": f"nvidia.com/gpu={gpu['uuid']}"}}  # fmt: skip
        return decide(spec_module.parse(doc, str(tmp_path)), settings, lambda: inventory)

    acting = decided([], [])
    (mps,) = [op for op in acting.operations if isinstance(op, BindMount) and op.target == driver.MPS_PIPE_DIRECTORY]
    given["mps"] = {"destination": mps.target, "source": mps.source, "type": "bind", "options": ["rbind"]}
    assert len(given["mounts"]) > 1 and given["mps"]["source"] not in {m["source"] for m in given["mounts"]}

    mounts, devices = CDI_CASES[case](given)
    plan = decided(mounts, devices)
    assert plan is not None and [d.gpu.uuid for d in plan.devices] == [gpu["uuid"]]
    if case == "everything the CDI spec gives":
        # the runtime did it all: nothing to do again, but the record (issue 39, item 7)
        assert plan.applied_by_runtime and plan.replace(applied_by_runtime=False) == acting
        assert plan.to_json()["operations"] == [] and "applied by the runtime" in plan.describe()
    else:  # the hook does its job: the GPU's node, its rule (and so its record)
        assert not plan.applied_by_runtime
        # ... less the binds the runtime made already, the same file at the same place: left to it
        made = {(m["source"], m["destination"]) for m in mounts}
        left = [op for op in acting.operations if isinstance(op, BindMount) and (op.source, op.target) in made]
        assert plan.mounted_by_runtime == tuple(left) and len(left) == (0 if case in NONE_OF_THE_PLANS else len(mounts))
        assert plan.operations == tuple(op for op in acting.operations if op not in left)
        assert plan.replace(operations=acting.operations, mounted_by_runtime=()) == acting
        said = [line for line in plan.describe().splitlines() if line.endswith(": mounted by the runtime already")]
        assert len(said) == len(left) and [op["target"] for op in plan.to_json()["mounted_by_runtime"]] == [
            op.target for op in left]  # fmt: skip
