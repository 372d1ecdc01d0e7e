"""The plan's policy in-process: request -> plan against an inventory written as Python literals.

plan.py is pure, so these tests need no root, no gcc and no file system: the host is built here
from the inventory's record classes (what the cache holds), and the plan is built while every
file system and process call fails (see `no_file_system`).
tests/start/test_plan_on_simulated_host.py checks the same policy end to end on a simulated
host (root and gcc needed); this file is the one a newcomer can run anywhere.

The host: 3 GPUs whose /dev/nvidia<minor> numbers are not their indices (0 -> 1, 1 -> 2, 2 -> 0),
GPU 1 in MIG mode with two MIG devices, every control node, the MIG config/monitor capabilities
and driver files of each kind, under three distinct roots so that sources (host paths under a
root) and targets (paths in the container) cannot be confused.
"""

from __future__ import annotations

import builtins
import json
import os
import subprocess
from contextlib import contextmanager

import pytest

from oci_gpu_hook.errors import Exit, InventoryError, RequestError, RequirementError
from oci_gpu_hook.start import driver
from oci_gpu_hook.start.inventory import DeviceNode, DriverFile, GpuInfo, Inventory, MigDevice
from oci_gpu_hook.start.plan import (
    APP_PROFILE,
    APP_PROFILE_DIR,
    PROC_NVIDIA,
    BindMount,
    CopyFile,
    DeviceRule,
    LibraryLayout,
    MountDevice,
    MountTmpfs,
    RefreshLdcache,
    Remount,
    Symlink,
    WriteFile,
    build_plan,
    host_devices,
    resolve_device,
)
from oci_gpu_hook.start.request import parse_request
from oci_gpu_hook.start.settings import Settings
from oci_gpu_hook.start.spec import Mount, Spec

VERSION = "550.54.15"
CUDA = "12.4"
DRIVER_ROOT = "/host/driver"
DEV_ROOT = "/host/dev"
PROC_ROOT = "/host/proc"
UVM_MAJOR = 510
CAPS_MAJOR = 508
BUS_IDS = ("0000:07:00.0", "0000:3b:00.0", "0000:af:00.0", "0000:d8:00.0")
ARCHS = ("8.0", "9.0", "8.6", "8.9")  # compute capability per GPU index

RHEL = LibraryLayout("/usr/lib64", "/usr/lib")
DEBIAN = LibraryLayout("/usr/lib/x86_64-linux-gnu", "/usr/lib/i386-linux-gnu")
AARCH64_DEBIAN = LibraryLayout("/usr/lib/aarch64-linux-gnu", None)
AARCH64_RHEL = LibraryLayout("/usr/lib64", None)


def gpu_uuid(index: int) -> str:
    return f"GPU-{index}a2b3c4d-5e6f-4a8b-9c0d-e1f2a3b4c5d{index}"


def mig_uuid(gpu: int, mig: int) -> str:
    return f"MIG-{gpu}{mig}b3c4d5-6e7f-5a8b-9c0d-e1f2a3b4c5e{mig}"


def lib(capability: str, kind: str, directory: str, prefix: str, soname: str | None) -> DriverFile:
    return DriverFile(capability, kind, f"{directory}/{prefix}.{VERSION}", soname)


# As discovery lists them: libraries sorted by (kind, path), then binaries, firmware, IPC, config.
FILES = (
    lib("graphics", "library", "/usr/lib64", "libGLX_nvidia.so", "libGLX_nvidia.so.0"),
    lib("compute", "library", "/usr/lib64", "libcuda.so", "libcuda.so.1"),
    lib("video", "library", "/usr/lib64", "libnvcuvid.so", "libnvcuvid.so.1"),
    lib("graphics", "library", "/usr/lib64", "libnvidia-glcore.so", f"libnvidia-glcore.so.{VERSION}"),
    lib("utility", "library", "/usr/lib64", "libnvidia-ml.so", "libnvidia-ml.so.1"),
    lib("compute", "library", "/usr/lib64", "libnvidia-ptxjitcompiler.so", "libnvidia-ptxjitcompiler.so.1"),
    lib("graphics", "library32", "/usr/lib", "libGLX_nvidia.so", "libGLX_nvidia.so.0"),
    lib("compute", "library32", "/usr/lib", "libcuda.so", "libcuda.so.1"),
    lib("utility", "library32", "/usr/lib", "libnvidia-ml.so", "libnvidia-ml.so.1"),
    DriverFile("utility", "binary", "/usr/bin/nvidia-smi"),
    DriverFile("utility", "binary", "/usr/bin/nvidia-persistenced"),
    DriverFile("compute", "binary", "/usr/bin/nvidia-cuda-mps-control"),
    DriverFile("utility", "firmware", f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"),
    DriverFile("utility", "ipc", "/var/run/nvidia-persistenced/socket"),
    DriverFile("graphics", "config", "/usr/share/glvnd/egl_vendor.d/10_nvidia.json"),
    DriverFile("graphics", "config", "/etc/vulkan/icd.d/nvidia_icd.json"),
)


def mig_devices(gpu_minor: int) -> tuple[MigDevice, ...]:
    """Two MIG devices, GPU instances 1 and 2, compute instance 0 of each."""
    devices = []
    for index, gi in enumerate((1, 2)):
        gi_minor, ci_minor = driver.mig_gi_cap_minor(gpu_minor, gi), driver.mig_ci_cap_minor(gpu_minor, gi, 0)
        base = f"/proc/driver/nvidia/capabilities/gpu{gpu_minor}/mig/gi{gi}"
        devices.append(
            MigDevice(
                index=index,
                gi=gi,
                ci=0,
                uuid=mig_uuid(gpu_minor, index),
                gi_cap=DeviceNode(f"/dev/nvidia-caps/nvidia-cap{gi_minor}", CAPS_MAJOR, gi_minor),
                ci_cap=DeviceNode(f"/dev/nvidia-caps/nvidia-cap{ci_minor}", CAPS_MAJOR, ci_minor),
                gi_access=f"{base}/access",
                ci_access=f"{base}/ci0/access",
            )
        )
    return tuple(devices)


def make_host(gpus: int = 3, mig_gpu: int | None = 1, uvm: bool = True, caps: bool = True, files=FILES) -> Inventory:
    """An inventory as discovery would record it, from literals: GPU i has minor (i + 1) % gpus."""
    gpu_list = []
    for index in range(gpus):
        minor = (index + 1) % gpus
        gpu_list.append(
            GpuInfo(
                index=index,
                minor=minor,
                uuid=gpu_uuid(index),
                bus_id=BUS_IDS[index],
                model="NVIDIA A100-SXM4-40GB",
                node=DeviceNode(f"/dev/nvidia{minor}", driver.NVIDIA_MAJOR, minor),
                brand="Tesla",
                compute_capability=ARCHS[index],
                memory_total=40960,
                mig=mig_devices(minor) if index == mig_gpu else (),
            )
        )
    control = {
        "nvidiactl": DeviceNode("/dev/nvidiactl", 195, 255),
        "nvidia-modeset": DeviceNode("/dev/nvidia-modeset", 195, 254),
    }
    majors = {"nvidia": 195}
    if uvm:
        control["nvidia-uvm"] = DeviceNode("/dev/nvidia-uvm", UVM_MAJOR, 0)
        control["nvidia-uvm-tools"] = DeviceNode("/dev/nvidia-uvm-tools", UVM_MAJOR, 1)
        majors["nvidia-uvm"] = UVM_MAJOR
    mig_caps = {}
    if caps:
        mig_caps = {
            "config": DeviceNode("/dev/nvidia-caps/nvidia-cap1", CAPS_MAJOR, 1),
            "monitor": DeviceNode("/dev/nvidia-caps/nvidia-cap2", CAPS_MAJOR, 2),
        }
        majors["nvidia-caps"] = CAPS_MAJOR
    return Inventory(
        driver_version=VERSION,
        cuda_version=CUDA,
        nvml=True,
        driver_root=DRIVER_ROOT,
        dev_root=DEV_ROOT,
        proc_root=PROC_ROOT,
        majors=majors,
        gpus=tuple(gpu_list),
        control_devices=control,
        mig_caps=mig_caps,
        files=tuple(files),
    )


HOST = make_host()


def container(env: dict, privileged: bool = False) -> Spec:
    return Spec(
        rootfs="/r",
        env=dict(env),
        bounding_capabilities=frozenset({"CAP_SYS_ADMIN"} if privileged else ()),
        mounts=(),
        annotations={},
        mount_label=None,
    )


class FileSystemTouched(AssertionError):
    pass


@contextmanager
def no_file_system():
    """Every file system and process call fails while the policy runs: plan.py must be pure."""

    def refuse(name):
        def call(*args, **kwargs):
            raise FileSystemTouched(f"{name}{args!r}")

        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builtins, "open", refuse("open"))
        for name in ("open", "stat", "lstat", "listdir", "scandir", "readlink", "access", "getcwd", "fork"):
            mp.setattr(os, name, refuse(f"os.{name}"))
        mp.setattr(subprocess, "Popen", refuse("subprocess.Popen"))
        yield


def make_plan(env, layout=RHEL, host=HOST, privileged=False, settings=None):
    with no_file_system():
        request = parse_request(container(env, privileged), settings or Settings())
        assert request is not None, "not a GPU container"
        return build_plan(request, host, layout)


def plan_for(devices, caps=None, **kw):
    env = {"NVIDIA_VISIBLE_DEVICES": devices}
    if caps is not None:
        env["NVIDIA_DRIVER_CAPABILITIES"] = caps
    return make_plan(env, **kw)


def lines(plan) -> list[str]:
    return [op.describe() for op in plan.operations]


def of(plan, kind) -> list:
    return [op for op in plan.operations if type(op) is kind]


def targets(plan, kind) -> list[str]:
    return [op.target for op in of(plan, kind)]


def gpu_nodes(plan) -> list[str]:
    return [t for t in targets(plan, MountDevice) if t[len("/dev/nvidia") :].isdigit()]


def library_names(plan, directory) -> set[str]:
    return {os.path.basename(t) for t in targets(plan, BindMount) if os.path.dirname(t) == directory}


def selected(plan) -> list[tuple[int, int | None]]:
    return [(d.gpu.index, d.mig.index if d.mig else None) for d in plan.devices]


def dev(path, major, minor):
    return [
        f"device  {path} (char {major}:{minor}) from {DEV_ROOT}{path} [ro,nosuid,noexec]",
        f"cgroup  allow c {major}:{minor} rw",
    ]


def bind(target, flags="ro,nosuid,nodev", root=DRIVER_ROOT, note=""):
    return f"bind    {target} from {root}{target} [{flags}]{note}"


def library(directory, prefix, soname=None):
    name = f"{prefix}.{VERSION}"
    out = [f"bind    {directory}/{name} from {DRIVER_ROOT}/usr/lib64/{name} [ro,nosuid,nodev]"]
    if soname:
        out.append(f"symlink {directory}/{soname} -> {name}")
    return out


def proc_mask(*inside):
    return [
        "tmpfs   /proc/driver/nvidia (mode 0555) [nosuid,nodev,noexec] if present",
        f"copy    /proc/driver/nvidia/params from {PROC_ROOT}/proc/driver/nvidia/params"
        "; 'ModifyDeviceFiles:' -> 'ModifyDeviceFiles: 0'",
        f"copy    /proc/driver/nvidia/version from {PROC_ROOT}/proc/driver/nvidia/version",
        f"copy    /proc/driver/nvidia/registry from {PROC_ROOT}/proc/driver/nvidia/registry",
        *(bind(path, "ro,nosuid,nodev,noexec", PROC_ROOT) for path in inside),
        "remount /proc/driver/nvidia [ro,nosuid,nodev,noexec]",
    ]


CONTROL = dev("/dev/nvidiactl", 195, 255)
UVM = dev("/dev/nvidia-uvm", UVM_MAJOR, 0) + dev("/dev/nvidia-uvm-tools", UVM_MAJOR, 1)
LDCACHE_LIB64 = "ldcache refresh /etc/ld.so.cache for /usr/lib64"
# The libraries and the ld cache refresh come first: apply.py mounts the rest while ldconfig works.
UTILITY_COMPUTE_LIBRARIES = [
    *library("/usr/lib64", "libcuda.so", "libcuda.so.1"),
    "symlink /usr/lib64/libcuda.so -> libcuda.so.1",
    *library("/usr/lib64", "libnvidia-ml.so", "libnvidia-ml.so.1"),
    *library("/usr/lib64", "libnvidia-ptxjitcompiler.so", "libnvidia-ptxjitcompiler.so.1"),
    LDCACHE_LIB64,
]
UTILITY_COMPUTE_FILES = [
    bind("/usr/bin/nvidia-smi"),
    bind("/usr/bin/nvidia-persistenced"),
    bind("/usr/bin/nvidia-cuda-mps-control"),
    bind(f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"),
    bind("/var/run/nvidia-persistenced/socket", "ro,nosuid,nodev,noexec", note=" (if present)"),
    bind("/tmp/nvidia-mps", "nosuid,nodev,noexec", note=" (if present)"),
]


# --- the literal host itself ----------------------------------------------------------------------


def test_the_literal_host_has_the_shape_the_inventory_cache_holds():
    # The cache writes to_json and reads from_json: a literal that survives the round trip is a
    # host the hook could have read from its cache.
    assert Inventory.from_json(json.loads(json.dumps(HOST.to_json()))) == HOST
    assert [(g.index, g.minor, g.bus_id) for g in HOST.gpus] == [
        (0, 1, "0000:07:00.0"),
        (1, 2, "0000:3b:00.0"),
        (2, 0, "0000:af:00.0"),
    ]
    migs = [(m.gi, m.ci, m.gi_cap.minor, m.ci_cap.minor) for m in HOST.gpus[1].mig]
    assert migs == [(1, 0, 282, 283), (2, 0, 291, 292)]
    assert {f.kind for f in HOST.files} == {"library", "library32", "binary", "firmware", "ipc", "config"}
    assert LibraryLayout.for_rootfs(False, "x86_64") == RHEL and LibraryLayout.for_rootfs(True, "x86_64") == DEBIAN
    assert LibraryLayout.for_rootfs(True, "aarch64") == AARCH64_DEBIAN
    assert LibraryLayout.for_rootfs(False, "aarch64") == AARCH64_RHEL


def test_the_guard_catches_file_system_access():
    with pytest.raises(FileSystemTouched), no_file_system():
        os.path.exists("/")


# --- whole plans, operation by operation ----------------------------------------------------------


def test_one_gpu_default_capabilities_exact_plan():
    plan = plan_for("0")
    assert lines(plan) == [
        *UTILITY_COMPUTE_LIBRARIES,
        *CONTROL,
        *UVM,
        *dev("/dev/nvidia1", 195, 1),  # GPU 0's minor, not its index
        *UTILITY_COMPUTE_FILES,
        *proc_mask("/proc/driver/nvidia/gpus/0000:07:00.0"),
    ]
    assert plan.request.capabilities == {"utility", "compute"}
    assert selected(plan) == [(0, None)]


def test_mig_device_exact_plan():
    plan = plan_for("1:0")
    base = "/proc/driver/nvidia/capabilities/gpu2/mig/gi1"
    assert lines(plan) == [
        *UTILITY_COMPUTE_LIBRARIES,
        *CONTROL,
        *UVM,
        *dev("/dev/nvidia2", 195, 2),
        *dev("/dev/nvidia-caps/nvidia-cap282", CAPS_MAJOR, 282),
        *dev("/dev/nvidia-caps/nvidia-cap283", CAPS_MAJOR, 283),
        *UTILITY_COMPUTE_FILES,
        *proc_mask("/proc/driver/nvidia/gpus/0000:3b:00.0", f"{base}/access", f"{base}/ci0/access"),
    ]
    assert plan.to_json()["devices"] == [
        {"gpu_index": 1, "gpu_uuid": gpu_uuid(1), "mig_index": 0, "mig_uuid": mig_uuid(2, 0)}
    ]


def test_none_exact_plan_has_libraries_and_no_gpu():
    plan = plan_for("none")
    assert lines(plan) == [*UTILITY_COMPUTE_LIBRARIES, *CONTROL, *UVM, *UTILITY_COMPUTE_FILES, *proc_mask()]
    assert plan.devices == ()


def test_graphics_only_exact_plan_debian():
    plan = plan_for("2", "graphics", layout=DEBIAN)
    multiarch = "/usr/lib/x86_64-linux-gnu"
    assert lines(plan) == [
        *library(multiarch, "libGLX_nvidia.so", "libGLX_nvidia.so.0"),
        f"symlink {multiarch}/libGLX_indirect.so.0 -> libGLX_nvidia.so.{VERSION}",
        *library(multiarch, "libnvidia-glcore.so"),  # its SONAME is its name: no link
        f"ldcache refresh /etc/ld.so.cache for {multiarch}",
        *CONTROL,
        *dev("/dev/nvidia0", 195, 0),
        bind(f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"),  # firmware, whatever the capabilities
        bind("/usr/share/glvnd/egl_vendor.d/10_nvidia.json"),
        bind("/etc/vulkan/icd.d/nvidia_icd.json"),
        # EGL (and Vulkan) limited to GPU 2, device minor 0, as libnvidia-container writes it
        "tmpfs   /etc/nvidia/nvidia-application-profiles-rc.d (mode 0555) [nosuid,nodev,noexec]",
        "write   /etc/nvidia/nvidia-application-profiles-rc.d/10-container.conf (mode 0444): "
        '{"profiles": [{"name": "_container_", "settings": ["EGLVisibleDGPUDevices", 0x1]}], '
        '"rules": [{"pattern": [], "profile": "_container_"}]}',
        "remount /etc/nvidia/nvidia-application-profiles-rc.d [ro,nosuid,nodev,noexec]",
        *proc_mask("/proc/driver/nvidia/gpus/0000:af:00.0"),
    ]


def test_operations_serialise_with_their_type():
    plan = plan_for("0")
    (first,) = [op for op in plan.to_json()["operations"] if op["op"] == "MountDevice"][:1]
    assert first == {
        "op": "MountDevice",
        "source": f"{DEV_ROOT}/dev/nvidiactl",
        "target": "/dev/nvidiactl",
        "major": 195,
        "minor": 255,
        "flags": ["ro", "nosuid", "noexec"],
    }
    assert {op["op"] for op in plan.to_json()["operations"]} == {
        "MountDevice",
        "DeviceRule",
        "BindMount",
        "Symlink",
        "MountTmpfs",
        "CopyFile",
        "Remount",
        "RefreshLdcache",
    }


# --- device selection -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        ("0", [(0, None)]),
        ("2", [(2, None)]),
        ("2,0", [(2, None), (0, None)]),  # the order asked for
        ("1", [(1, None)]),  # a GPU in MIG mode, whole
        (gpu_uuid(1), [(1, None)]),
        (gpu_uuid(1).upper(), [(1, None)]),  # UUIDs compare case-insensitively
        ("0000:3b:00.0", [(1, None)]),
        ("3b:00.0", [(1, None)]),  # short form: domain 0000
        ("3B:00.0", [(1, None)]),
        ("00000000:af:00.0", [(2, None)]),  # 8-digit domain
        ("1:0", [(1, 0)]),
        ("1:1", [(1, 1)]),
        ("1:0,1:1", [(1, 0), (1, 1)]),
        (mig_uuid(2, 1), [(1, 1)]),
        ("MIG-" + mig_uuid(2, 1)[4:].upper(), [(1, 1)]),
        (f"MIG-{gpu_uuid(1)}/2/0", [(1, 1)]),  # pre-R470 naming: MIG-GPU-<uuid>/<gi>/<ci>
        ("all", [(0, None), (1, None), (2, None), (1, 0), (1, 1)]),  # every GPU and every MIG device
        ("none", []),
    ],
)
def test_device_ids(value, expected):
    assert selected(plan_for(value)) == expected


def test_void_and_unset_are_no_gpu_container():
    with no_file_system():
        assert parse_request(container({"NVIDIA_VISIBLE_DEVICES": "void"}), Settings()) is None
        assert parse_request(container({}), Settings()) is None


@pytest.mark.parametrize(
    "value, same_as",
    [
        (f"0,{gpu_uuid(0)},0000:07:00.0,07:00.0,0", "0"),
        (f"1:1,{mig_uuid(2, 1)},MIG-{gpu_uuid(1)}/2/0", "1:1"),
    ],
)
def test_duplicate_ids_give_one_device(value, same_as):
    plan = plan_for(value)
    assert len(plan.devices) == 1
    assert lines(plan) == lines(plan_for(same_as))


HAS = "this host has GPUs 0-2 and MIG devices 1:0-1:1"


@pytest.mark.parametrize(
    "value, missing",
    [
        ("3", "GPU 3"),  # three GPUs: 0 to 2
        ("0,7", "GPU 7"),
        ("+07", "GPU 7"),
        ("0:0", "MIG device 0:0"),  # GPU 0 is not in MIG mode
        ("1:2", "MIG device 1:2"),  # GPU 1 has two MIG devices
        ("GPU-0a2b3c4d-5e6f-4a8b-9c0d-ffffffffffff", "GPU GPU-0a2b3c4d-5e6f-4a8b-9c0d-ffffffffffff"),
        ("MIG-ffffffff-6e7f-5a8b-9c0d-e1f2a3b4c5e0", "MIG device MIG-ffffffff-6e7f-5a8b-9c0d-e1f2a3b4c5e0"),
        (f"MIG-{gpu_uuid(1)}/3/0", f"MIG device MIG-{gpu_uuid(1)}/3/0"),
        ("0000:99:00.0", "GPU at PCI 0000:99:00.0"),
        ("99:00.0", "GPU at PCI 99:00.0"),
    ],
)
def test_unknown_device_names_what_asked_and_what_the_host_has(value, missing):
    with pytest.raises(RequestError) as caught:
        plan_for(value)
    assert caught.value.message == f"NVIDIA_VISIBLE_DEVICES={value}: no {missing} ({HAS})"
    assert caught.value.exit_code == Exit.REQUEST and not isinstance(caught.value, RequirementError)


def test_unknown_device_names_the_volume_mount_or_the_annotation_that_asked():
    """Each source of a device list is named as the container has it: the one volume mount, the
    one annotation with its value (of several, in order), the variable with its whole value."""
    settings = Settings(accept_volume_mounts=True, accept_cdi_annotations=True)
    mounts = (Mount("/var/run/nvidia-container-devices/0", "/dev/null", "bind"),
              Mount("/var/run/./nvidia-container-devices/1:5", "/dev/null", "bind"))  # fmt: skip
    annotations = {"cdi.k8s.io/a": "nvidia.com/gpu=0", "cdi.k8s.io/b": "example.com/x=1,nvidia.com/gpu=GPU-ab12"}
    cases = [
        ({"mounts": mounts}, f"volume mount /var/run/nvidia-container-devices/1:5: no MIG device 1:5 ({HAS})"),
        ({"annotations": annotations},
         f"annotation cdi.k8s.io/b=example.com/x=1,nvidia.com/gpu=GPU-ab12: no GPU GPU-ab12 ({HAS})"),
        ({}, f"NVIDIA_VISIBLE_DEVICES=0, 4 ,all: no GPU 4 ({HAS})"),
    ]  # fmt: skip
    for parts, message in cases:
        spec = container({"NVIDIA_VISIBLE_DEVICES": "0, 4 ,all"}).replace(**parts)
        with no_file_system(), pytest.raises(RequestError) as caught:
            build_plan(parse_request(spec, settings), HOST, RHEL)
        assert caught.value.message == message


@pytest.mark.parametrize(
    "gpus, mig_gpu, has",
    [
        (0, None, "this host has no GPUs"),
        (1, None, "this host has GPU 0"),
        (1, 0, "this host has GPU 0 and MIG devices 0:0-0:1"),
        (4, None, "this host has GPUs 0-3"),
        (4, 3, "this host has GPUs 0-3 and MIG devices 3:0-3:1"),
    ],
)
def test_what_the_host_has_is_said_in_ranges(gpus, mig_gpu, has):
    assert host_devices(make_host(gpus=gpus, mig_gpu=mig_gpu)) == has
    one_mig = HOST.replace(gpus=(HOST.gpus[0], HOST.gpus[1].replace(mig=HOST.gpus[1].mig[1:]), HOST.gpus[2]))
    assert host_devices(one_mig) == "this host has GPUs 0-2 and MIG device 1:1"
    gaps = HOST.replace(gpus=(HOST.gpus[0], HOST.gpus[2], HOST.gpus[1].replace(index=5)))
    assert host_devices(gaps) == "this host has GPUs 0, 2, 5 and MIG devices 5:0-5:1"


def test_resolve_device_names_the_device():
    assert resolve_device("0", HOST).name == f"GPU 0 ({gpu_uuid(0)}, 0000:07:00.0, /dev/nvidia1)"
    assert resolve_device("1:1", HOST).name == f"MIG 1:1 ({mig_uuid(2, 1)})"


# --- capabilities decide files and nodes ----------------------------------------------------------


def test_utility_brings_nvidia_smi_and_nvml_only():
    plan = plan_for("0", "utility")
    assert library_names(plan, "/usr/lib64") == {f"libnvidia-ml.so.{VERSION}"}
    assert targets(plan, Symlink) == ["/usr/lib64/libnvidia-ml.so.1"]
    assert [t for t in targets(plan, BindMount) if t.startswith("/usr/bin/")] == [
        "/usr/bin/nvidia-smi",
        "/usr/bin/nvidia-persistenced",
    ]
    assert "/var/run/nvidia-persistenced/socket" in targets(plan, BindMount)
    assert "/tmp/nvidia-mps" not in targets(plan, BindMount)  # the MPS directory is compute's
    assert not {"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"} & set(targets(plan, MountDevice))


def test_compute_brings_libcuda_and_the_uvm_nodes():
    plan = plan_for("0", "compute")
    assert library_names(plan, "/usr/lib64") == {f"libcuda.so.{VERSION}", f"libnvidia-ptxjitcompiler.so.{VERSION}"}
    assert {op.target: op.value for op in of(plan, Symlink)} == {
        "/usr/lib64/libcuda.so.1": f"libcuda.so.{VERSION}",
        "/usr/lib64/libcuda.so": "libcuda.so.1",
        "/usr/lib64/libnvidia-ptxjitcompiler.so.1": f"libnvidia-ptxjitcompiler.so.{VERSION}",
    }
    assert targets(plan, MountDevice) == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia1"]
    assert [t for t in targets(plan, BindMount) if t.startswith("/usr/bin/")] == ["/usr/bin/nvidia-cuda-mps-control"]
    assert "/var/run/nvidia-persistenced/socket" not in targets(plan, BindMount)  # IPC is utility's


def test_video_implies_compute():
    plan = plan_for("0", "video")
    assert plan.request.capabilities == {"video", "compute"}
    assert library_names(plan, "/usr/lib64") == {
        f"libnvcuvid.so.{VERSION}",
        f"libcuda.so.{VERSION}",
        f"libnvidia-ptxjitcompiler.so.{VERSION}",
    }


def test_display_implies_graphics_and_brings_modeset():
    plan = plan_for("0", "display")
    assert plan.request.capabilities == {"display", "graphics"}
    assert targets(plan, MountDevice) == ["/dev/nvidiactl", "/dev/nvidia-modeset", "/dev/nvidia1"]
    assert library_names(plan, "/usr/lib64") == {f"libGLX_nvidia.so.{VERSION}", f"libnvidia-glcore.so.{VERSION}"}
    assert {"/usr/share/glvnd/egl_vendor.d/10_nvidia.json", "/etc/vulkan/icd.d/nvidia_icd.json"} <= set(
        targets(plan, BindMount)
    )


def test_graphics_without_display_has_no_modeset_node():
    assert "/dev/nvidia-modeset" not in targets(plan_for("0", "graphics"), MountDevice)


def test_compat32_places_32bit_libraries_of_the_asked_capabilities():
    plan = plan_for("0", "compute,compat32")
    assert library_names(plan, "/usr/lib") == {f"libcuda.so.{VERSION}"}  # not GLX, not NVML: not asked
    bind32 = [op for op in of(plan, BindMount) if os.path.dirname(op.target) == "/usr/lib"]
    assert [op.source for op in bind32] == [f"{DRIVER_ROOT}/usr/lib/libcuda.so.{VERSION}"]
    links = {op.target: op.value for op in of(plan, Symlink)}
    assert links["/usr/lib/libcuda.so.1"] == f"libcuda.so.{VERSION}" and links["/usr/lib/libcuda.so"] == "libcuda.so.1"
    assert of(plan, RefreshLdcache)[0].directories == ("/usr/lib64", "/usr/lib")


def test_compat32_debian_uses_the_i386_directory():
    plan = plan_for("0", "all", layout=DEBIAN)
    assert library_names(plan, "/usr/lib/i386-linux-gnu") == {
        f"libGLX_nvidia.so.{VERSION}",
        f"libcuda.so.{VERSION}",
        f"libnvidia-ml.so.{VERSION}",
    }
    assert "/usr/lib/i386-linux-gnu/libGLX_indirect.so.0" in targets(plan, Symlink)
    assert of(plan, RefreshLdcache)[0].directories == ("/usr/lib/x86_64-linux-gnu", "/usr/lib/i386-linux-gnu")


@pytest.mark.parametrize("layout", [AARCH64_DEBIAN, AARCH64_RHEL], ids=["debian", "rhel"])
def test_compat32_places_nothing_without_a_32bit_directory(layout):
    plan = plan_for("0", "all", layout=layout)
    assert "compat32" in plan.request.capabilities
    sources = [op.source for op in of(plan, BindMount)]
    assert not [s for s in sources if s.startswith(f"{DRIVER_ROOT}/usr/lib/lib")]  # no 32-bit file
    assert {os.path.dirname(t) for t in targets(plan, BindMount) if ".so." in t} == {layout.lib64}
    assert of(plan, RefreshLdcache)[0].directories == (layout.lib64,)


@pytest.mark.parametrize(
    "layout, lib64",
    [(RHEL, "/usr/lib64"), (DEBIAN, "/usr/lib/x86_64-linux-gnu"), (AARCH64_DEBIAN, "/usr/lib/aarch64-linux-gnu")],
    ids=["rhel", "debian", "aarch64-debian"],
)
def test_layout_decides_the_library_directory_only(layout, lib64):
    plan = plan_for("0", layout=layout)
    libs = [op for op in of(plan, BindMount) if ".so." in op.target]
    assert {os.path.dirname(op.target) for op in libs} == {lib64}
    assert {os.path.dirname(op.source) for op in libs} == {f"{DRIVER_ROOT}/usr/lib64"}  # host paths unchanged
    assert {os.path.dirname(t) for t in targets(plan, Symlink)} == {lib64}
    assert of(plan, RefreshLdcache) == [RefreshLdcache((lib64,))]
    # Everything else is where it is on the host, whatever the image.
    assert [t for t in targets(plan, BindMount) if ".so." not in t] == [
        t for t in targets(plan_for("0", layout=RHEL), BindMount) if ".so." not in t
    ]


def test_no_library_no_ldcache_refresh():
    host = make_host(files=[f for f in FILES if f.kind not in ("library", "library32")])
    plan = plan_for("0", host=host)
    assert of(plan, RefreshLdcache) == [] and of(plan, Symlink) == []
    assert type(plan.operations[-1]) is Remount


def test_mps_pipe_directory_only_when_allowed():
    allowed = make_plan({"NVIDIA_VISIBLE_DEVICES": "0", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps/"})
    assert "/tmp/nvidia-mps" in targets(allowed, BindMount)
    other = make_plan({"NVIDIA_VISIBLE_DEVICES": "0", "CUDA_MPS_PIPE_DIRECTORY": "/etc"})
    assert "/etc" not in targets(other, BindMount) and "/tmp/nvidia-mps" not in targets(other, BindMount)
    assert other.request.notes and "CUDA_MPS_PIPE_DIRECTORY=/etc ignored" in other.request.notes[0]


# --- /proc/driver/nvidia mask ---------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "1:0", "all", "none"])
def test_proc_mask_order_and_remount_of_the_tmpfs(value):
    plan = plan_for(value)
    ops = list(plan.operations)
    (tmpfs,) = of(plan, MountTmpfs)
    (remount,) = of(plan, Remount)
    assert tmpfs.target == remount.target == PROC_NVIDIA and tmpfs.mode == 0o555
    # The plan, not apply, decides that the mask is skipped where the container's /proc has no
    # driver files (with everything inside it).
    assert tmpfs.optional and tmpfs.to_json()["optional"] is True
    start, end = ops.index(tmpfs), ops.index(remount)
    assert start < end
    assert "ro" in remount.flags and "ro" not in tmpfs.flags
    # Everything under /proc/driver/nvidia is made between the tmpfs and its remount, and only that.
    inside = [i for i, op in enumerate(ops) if getattr(op, "target", "").startswith(PROC_NVIDIA + "/")]
    assert inside == list(range(start + 1, end))
    assert all(type(ops[i]) in (CopyFile, BindMount) for i in inside)
    assert all(op.source.startswith(PROC_ROOT + "/") for op in ops[start + 1 : end])
    # Only the selected GPUs' directories show.
    gpu_dirs = [t for t in targets(plan, BindMount) if t.startswith(f"{PROC_NVIDIA}/gpus/")]
    assert gpu_dirs == list(dict.fromkeys(f"{PROC_NVIDIA}/gpus/{d.gpu.bus_id}" for d in plan.devices))


def test_proc_params_copy_turns_off_device_file_creation():
    (params,) = [op for op in of(plan_for("0"), CopyFile) if op.target.endswith("/params")]
    assert params.rewrite == (("ModifyDeviceFiles:", "ModifyDeviceFiles: 0"),)


def test_mig_config_and_monitor_for_privileged_containers():
    env = {"NVIDIA_VISIBLE_DEVICES": "1:1", "NVIDIA_MIG_CONFIG_DEVICES": "all", "NVIDIA_MIG_MONITOR_DEVICES": "all"}
    plan = make_plan(env, privileged=True)
    nodes = targets(plan, MountDevice)
    assert nodes[-2:] == ["/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap2"]
    assert {f"{PROC_NVIDIA}/capabilities/mig/config", f"{PROC_NVIDIA}/capabilities/mig/monitor"} <= set(
        targets(plan, BindMount)
    )
    with pytest.raises(RequestError, match="only privileged containers"):
        make_plan(env)
    with pytest.raises(InventoryError) as caught:
        make_plan(env, privileged=True, host=make_host(caps=False))
    assert caught.value.message == "MIG config: /proc/devices lists no nvidia-caps driver"


# --- each target once, a rule per node ------------------------------------------------------------


@pytest.mark.parametrize(
    "value, caps",
    [
        ("all", "all"),
        ("1:0,1:1,1", "all"),  # a GPU node shared by the MIG devices and the whole GPU
        (f"0,{gpu_uuid(0)},2,1:1", "compute,utility,compat32"),
        ("none", "all"),
    ],
)
@pytest.mark.parametrize("layout", [RHEL, DEBIAN, AARCH64_DEBIAN], ids=["rhel", "debian", "aarch64"])
def test_each_target_once_and_a_rule_per_device_node(value, caps, layout):
    plan = plan_for(value, caps, layout=layout)
    made = [op.target for op in plan.operations if hasattr(op, "target") and type(op) is not Remount]
    assert len(made) == len(set(made))
    assert set(targets(plan, Remount)) <= set(made)
    nodes = [(op.major, op.minor) for op in of(plan, MountDevice)]
    rules = [(op.major, op.minor) for op in of(plan, DeviceRule)]
    assert rules == nodes  # one rule per node, in the same order
    assert all(op.access == "rw" for op in of(plan, DeviceRule))
    ops = list(plan.operations)
    for i, op in enumerate(ops):
        if type(op) is MountDevice:  # each rule right after its node
            assert ops[i + 1] == DeviceRule(op.major, op.minor)
    # ldconfig works while the rest is mounted (apply.py): every library and library link is made
    # before the refresh, and nothing after it is in a directory it indexes.
    (refresh,) = [i for i, op in enumerate(ops) if type(op) is RefreshLdcache]
    indexed = set(ops[refresh].directories)
    assert all(os.path.dirname(op.target) not in indexed for op in ops[refresh + 1 :] if hasattr(op, "target"))
    assert {os.path.dirname(op.target) for op in ops[:refresh]} == indexed


def test_two_mig_devices_of_one_gpu_share_its_node():
    plan = plan_for("1:0,1:1")
    assert targets(plan, MountDevice) == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia2",
        "/dev/nvidia-caps/nvidia-cap282",
        "/dev/nvidia-caps/nvidia-cap283",
        "/dev/nvidia-caps/nvidia-cap291",
        "/dev/nvidia-caps/nvidia-cap292",
    ]
    assert targets(plan, BindMount).count(f"{PROC_NVIDIA}/gpus/0000:3b:00.0") == 1


def test_all_gets_every_gpu_node_by_minor():
    assert gpu_nodes(plan_for("all")) == ["/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia0"]


# --- requirements ---------------------------------------------------------------------------------

CUDA_HINT = ", please update your driver to a newer version, or use an earlier cuda container"


def test_unmet_cuda_requirement_and_disable_require():
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=99.0"}
    with pytest.raises(RequirementError) as caught:
        make_plan(env)
    assert caught.value.message == "unsatisfied condition: cuda>=99.0" + CUDA_HINT
    assert caught.value.exit_code == Exit.REQUEST
    for off in ("true", "1", "TRUE"):
        assert lines(make_plan(dict(env, NVIDIA_DISABLE_REQUIRE=off))) == lines(plan_for("0"))
    assert make_plan(env, settings=Settings(disable_require=True)).devices
    with pytest.raises(RequirementError):
        make_plan(dict(env, NVIDIA_DISABLE_REQUIRE="yes"))  # not a Go boolean: still required


def test_met_requirements_change_nothing():
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=12.0 brand=tesla,driver>=550"}
    assert lines(make_plan(env)) == lines(plan_for("0"))


def test_driver_requirement():
    with pytest.raises(RequirementError, match=r"^unsatisfied condition: driver>=560$"):
        make_plan({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_DRIVER": "driver>=560"})


def test_arch_requirement_per_gpu_and_mig_by_its_parent():
    env = {"NVIDIA_REQUIRE_ARCH": "arch>=9.0"}
    assert make_plan(dict(env, NVIDIA_VISIBLE_DEVICES="1")).devices  # GPU 1 is 9.0
    assert make_plan(dict(env, NVIDIA_VISIBLE_DEVICES="1:1")).devices  # its MIG device too
    with pytest.raises(RequirementError) as caught:
        make_plan(dict(env, NVIDIA_VISIBLE_DEVICES="2"))
    assert caught.value.message == "unsatisfied condition: arch>=9.0"
    with pytest.raises(RequirementError) as caught:
        make_plan(dict(env, NVIDIA_VISIBLE_DEVICES="1,0"))
    assert caught.value.message == "unsatisfied condition: arch>=9.0 (GPU 0)"  # more than one: which
    # With no GPU selected only cuda and driver are known; a term on the GPU holds.
    assert make_plan(dict(env, NVIDIA_VISIBLE_DEVICES="none")).devices == ()
    with pytest.raises(RequirementError):
        make_plan({"NVIDIA_VISIBLE_DEVICES": "none", "NVIDIA_REQUIRE_CUDA": "cuda>=12.5"})


def test_brand_requirement():
    assert make_plan({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_REQUIRE_BRAND": "brand=TESLA"}).devices
    with pytest.raises(RequirementError) as caught:
        make_plan({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_REQUIRE_BRAND": "brand=geforce"})
    assert caught.value.message == "unsatisfied condition: brand=geforce (GPU 0)"


def test_unknown_facts_hold():
    # NVML did not answer: no CUDA version, brand or arch; terms on them hold.
    host = make_host().replace(cuda_version=None, nvml=False)
    host = host.replace(gpus=tuple(g.replace(brand=None, compute_capability=None) for g in host.gpus))
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=99.0 brand=x,arch>=10.0"}
    assert make_plan(env, host=host).devices


# --- what the host lacks --------------------------------------------------------------------------


def test_compute_without_nvidia_uvm_is_an_inventory_error():
    host = make_host(uvm=False)
    with pytest.raises(InventoryError) as caught:
        plan_for("0", host=host)
    assert caught.value.message == (
        "nvidia-uvm: /proc/devices lists no nvidia-uvm driver; load it (nvidia-modprobe -u -c=0)"
    )
    assert caught.value.exit_code == Exit.INVENTORY
    # Without compute the uvm nodes are not needed.
    assert targets(plan_for("0", "utility", host=host), MountDevice) == ["/dev/nvidiactl", "/dev/nvidia1"]


def test_untrusted_device_node_is_an_inventory_error():
    gpu0 = HOST.gpus[0]
    host = HOST.replace(gpus=(gpu0.replace(node=gpu0.node.replace(problem="missing")),) + HOST.gpus[1:])
    with pytest.raises(InventoryError) as caught:
        plan_for("0", host=host)
    assert caught.value.message == "GPU 0 (/dev/nvidia1): device node missing"
    assert selected(plan_for("2", host=host)) == [(2, None)]  # other GPUs still start
    bad = HOST.control_devices["nvidiactl"].replace(problem="is 1:3, expected 195:255")
    control = dict(HOST.control_devices, nvidiactl=bad)
    with pytest.raises(InventoryError, match=r"^nvidiactl \(/dev/nvidiactl\): device node is 1:3, expected 195:255$"):
        plan_for("none", host=HOST.replace(control_devices=control))


def test_host_without_gpus_still_plans_none_and_rejects_an_index():
    host = make_host(gpus=0, mig_gpu=None)
    assert lines(plan_for("none", host=host)) == lines(plan_for("none"))
    assert plan_for("all", host=host).devices == ()
    with pytest.raises(RequestError, match=r"^NVIDIA_VISIBLE_DEVICES=0: no GPU 0 \(this host has no GPUs\)$"):
        plan_for("0", host=host)


def test_all_gives_every_mig_devices_nodes_and_access_files():
    """`all` on a host with a MIG GPU: as NVIDIA's hook does, every MIG device's capability nodes
    and /proc access files, besides every GPU."""
    plan = plan_for("all")
    migs = HOST.gpus[1].mig
    assert len(migs) == 2
    mounted = set(targets(plan, MountDevice))
    binds = set(targets(plan, BindMount))
    for mig in migs:
        assert {mig.gi_cap.path, mig.ci_cap.path} <= mounted
        assert {mig.gi_access, mig.ci_access} <= binds
    assert {g.node.path for g in HOST.gpus} <= mounted


LIB64_ID, LIB_ID, LIB32_ID, MULTI_ID = (1, 10), (1, 11), (1, 12), (1, 13)
LIB32_LAYOUT = LibraryLayout("/usr/lib64", "/usr/lib32")


@pytest.mark.parametrize(
    "dirs, expected",
    [
        # multiarch: the 64-bit multiarch directory decides (as libnvidia-container checks it)
        ({"/usr/lib/x86_64-linux-gnu": MULTI_ID, "/usr/lib": LIB_ID}, DEBIAN),
        # RHEL: /usr/lib is a directory of its own, no /usr/lib32
        ({"/usr/lib64": LIB64_ID, "/usr/lib": LIB_ID}, RHEL),
        # /usr/lib32 present: it wins
        ({"/usr/lib64": LIB64_ID, "/usr/lib": LIB_ID, "/usr/lib32": LIB32_ID}, LIB32_LAYOUT),
        # no /usr/lib at all: /usr/lib32
        ({"/usr/lib64": LIB64_ID}, LIB32_LAYOUT),
        # /usr/lib is /usr/lib64 under another name (a symlink): /usr/lib32
        ({"/usr/lib64": LIB64_ID, "/usr/lib": LIB64_ID}, LIB32_LAYOUT),
        # nothing (no rootfs): /usr/lib64 and /usr/lib32
        ({}, LIB32_LAYOUT),
    ],
    ids=["multiarch", "rhel", "lib32-present", "no-usr-lib", "usr-lib-is-lib64", "nothing"],
)
def test_library_layout_for_image(dirs, expected):
    assert LibraryLayout.for_image(dirs, "x86_64") == expected


def test_library_layout_for_image_aarch64():
    assert LibraryLayout.for_image({"/usr/lib/aarch64-linux-gnu": MULTI_ID}, "aarch64") == AARCH64_DEBIAN
    assert LibraryLayout.for_image({"/usr/lib64": LIB64_ID, "/usr/lib": LIB_ID}, "aarch64") == AARCH64_RHEL
    assert set(LibraryLayout.probe_paths("x86_64")) == {"/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib32",
                                                        "/usr/lib"}  # fmt: skip


@pytest.mark.parametrize("devices, mask",
                         [("0", "0x2"), ("0,2", "0x3"), ("all", "0x7"), ("1:0", "0x4"), ("none", None)])  # fmt: skip
def test_graphics_app_profile_mask_is_the_device_minors(devices, mask):
    """GPU i has minor (i + 1) % 3 here: the mask is of minors, not indices."""
    plan = plan_for(devices, "graphics")
    written = [op for op in of(plan, WriteFile) if op.target == APP_PROFILE]
    if mask is None:
        assert written == [] and APP_PROFILE_DIR in targets(plan, MountTmpfs)  # the tmpfs hides the image's
    else:
        (op,) = written
        assert f'"EGLVisibleDGPUDevices", {mask}]' in op.content and op.mode == 0o444
    assert APP_PROFILE_DIR in targets(plan, Remount)


def test_no_app_profile_without_graphics():
    plan = plan_for("0", "utility,compute")
    assert APP_PROFILE_DIR not in targets(plan, MountTmpfs) and not of(plan, WriteFile)


@pytest.mark.parametrize("for_cdi", [False, True])
def test_development_links(for_cdi):
    """opticalflow's link as NVIDIA's hook adds it; libnvidia-ml.so as NVIDIA's CDI specs add it
    (the hook does not); the GBM backend always with graphics (issue 26: without it GBM finds no
    NVIDIA backend; NVIDIA's CDI specs carry it, its hook does not)."""
    files = FILES + (
        lib("video", "library", "/usr/lib64", "libnvidia-opticalflow.so", "libnvidia-opticalflow.so.1"),
        lib("compute", "library", "/usr/lib64", "libnvidia-allocator.so", "libnvidia-allocator.so.1"),
    )
    host = make_host(files=files)
    with no_file_system():
        request = parse_request(container({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "all"}),
                                Settings())  # fmt: skip
        plan = build_plan(request, host, RHEL, for_cdi=for_cdi)
    links = {op.target: op.value for op in of(plan, Symlink)}
    assert links["/usr/lib64/libnvidia-opticalflow.so"] == "libnvidia-opticalflow.so.1"
    assert links["/usr/lib64/gbm/nvidia-drm_gbm.so"] == "../libnvidia-allocator.so.1"
    cdi_only = {"/usr/lib64/libnvidia-ml.so": "libnvidia-ml.so.1"}
    assert {k: links.get(k) for k in cdi_only} == (cdi_only if for_cdi else dict.fromkeys(cdi_only))


def test_graphics_gets_the_gpus_drm_nodes_and_by_path_links():
    """As NVIDIA's runtime does for graphics and display: the selected GPUs' DRM nodes only."""
    gpus = []
    for gpu in HOST.gpus:
        dri = (DeviceNode(f"/dev/dri/card{gpu.index + 1}", 226, gpu.index + 1),
               DeviceNode(f"/dev/dri/renderD{128 + gpu.index}", 226, 128 + gpu.index))  # fmt: skip
        gpus.append(gpu.replace(dri=dri))
    host = HOST.replace(gpus=tuple(gpus))
    graphics = plan_for("1", "graphics", host=host)
    assert set(targets(graphics, MountDevice)) >= {"/dev/dri/card2", "/dev/dri/renderD129"}
    assert not {"/dev/dri/card1", "/dev/dri/card3"} & set(targets(graphics, MountDevice))
    links = {op.target: op.value for op in of(graphics, Symlink)}
    assert links["/dev/dri/by-path/pci-0000:3b:00.0-card"] == "../card2"
    assert links["/dev/dri/by-path/pci-0000:3b:00.0-render"] == "../renderD129"
    rules = {(op.major, op.minor) for op in of(graphics, DeviceRule)}
    assert {(226, 2), (226, 129)} <= rules
    compute = plan_for("1", "utility,compute", host=host)
    assert not [t for t in targets(compute, MountDevice) if t.startswith("/dev/dri/")]


def test_a_library_brings_every_driver_library_it_needs_whatever_its_capability():
    """Read from the ELF files at discovery (DriverFile.needs): graphics alone gets libnvidia-gpucomp,
    which libnvidia-glcore NEEDs and the table files under compute (issue 26, defect 1); needs are
    followed transitively; a DEPENDENCY library comes only with what needs it."""
    from oci_gpu_hook.start.inventory import DEPENDENCY

    gpucomp = f"libnvidia-gpucomp.so.{VERSION}"
    glcore, helper = f"libnvidia-glcore.so.{VERSION}", f"libnvidia-helper.so.{VERSION}"
    files = (
        DriverFile("graphics", "library", f"/usr/lib64/libGLX_nvidia.so.{VERSION}", "libGLX_nvidia.so.0",
                   (glcore, "libX11.so.6")),
        DriverFile("graphics", "library", f"/usr/lib64/{glcore}", glcore, (gpucomp,)),
        DriverFile("compute", "library", f"/usr/lib64/{gpucomp}", gpucomp, (helper,)),
        DriverFile(DEPENDENCY, "library", f"/usr/lib64/{helper}", helper),
        lib("utility", "library", "/usr/lib64", "libnvidia-ml.so", "libnvidia-ml.so.1"),
    )  # fmt: skip
    host = make_host(files=files)
    for caps, expected in (
        ("graphics", {f"libGLX_nvidia.so.{VERSION}", glcore, gpucomp, helper}),
        ("utility", {f"libnvidia-ml.so.{VERSION}"}),
    ):
        with no_file_system():
            request = parse_request(container({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": caps}),
                                    Settings())  # fmt: skip
            plan = build_plan(request, host, RHEL)
        assert library_names(plan, "/usr/lib64") == expected, caps


def test_vdpau_goes_where_its_loader_looks():
    files = FILES + (DriverFile("video", "library", f"/usr/lib64/vdpau/libvdpau_nvidia.so.{VERSION}",
                                "libvdpau_nvidia.so.1"),)  # fmt: skip
    host = make_host(files=files)
    with no_file_system():
        request = parse_request(container({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "video"}),
                                Settings())  # fmt: skip
        plan = build_plan(request, host, RHEL)
    assert library_names(plan, "/usr/lib64/vdpau") == {f"libvdpau_nvidia.so.{VERSION}"}
    links = {op.target: op.value for op in of(plan, Symlink)}
    assert links["/usr/lib64/vdpau/libvdpau_nvidia.so.1"] == f"libvdpau_nvidia.so.{VERSION}"
    (refresh,) = of(plan, RefreshLdcache)
    assert "/usr/lib64/vdpau" not in refresh.directories  # not in the ld cache, as on the host


def test_a_mig_uuid_while_nvml_fails_names_the_cause_and_the_way_that_works():
    """MIG UUIDs come from NVML alone: with NVML failing (issue 26, defect 4) such a request says
    why, what to do, and that the index works; the index does."""
    host = make_host()
    unknown = tuple(gpu.replace(mig=tuple(m.replace(uuid=None) for m in gpu.mig)) for gpu in host.gpus)
    host = host.replace(gpus=unknown, nvml_error="NVML (/usr/lib64/libnvidia-ml.so.1): Driver Not Loaded")
    with no_file_system():
        request = parse_request(container({"NVIDIA_VISIBLE_DEVICES": "MIG-5b8a7c1f-0000-5000-8000-000000000000"}),
                                Settings())  # fmt: skip
        with pytest.raises(RequestError) as e:
            build_plan(request, host, RHEL)
        assert "known by UUID only through NVML, which failed (NVML (/usr/lib64/libnvidia-ml.so.1): Driver Not " \
               "Loaded); the NVIDIA kernel module is not loaded" in e.value.message  # fmt: skip
        assert "name the MIG device by index (GPU:MIG, e.g. 0:1)" in e.value.message
        mig = "MIG-5b8a7c1f-0000-5000-8000-000000000000"
        assert e.value.message.startswith(f"NVIDIA_VISIBLE_DEVICES={mig}: {mig}: MIG devices are known by UUID")
        by_index = parse_request(container({"NVIDIA_VISIBLE_DEVICES": "1:0"}), Settings())
        assert selected(build_plan(by_index, host, RHEL)) == [(1, 0)]
