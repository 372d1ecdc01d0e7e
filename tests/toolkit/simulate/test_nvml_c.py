"""The simulated driver's C programs: libnvidia-ml.so driven by the official pynvml bindings, and
nvidia-smi run against it.

Both are built once per module from sim_host.example.h, with SIM_ROOT pointing into a temporary
directory; each test starts from a fully populated device tree and removes what it wants hidden.
Device nodes are plain files here: the library only checks that they exist.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import nvmlevents
import pytest

from oci_gpu_hook.toolkit.simulate import control

CSRC = Path(__file__).resolve().parents[3] / "oci_gpu_hook" / "toolkit" / "simulate" / "csrc"
DRIVER = "550.54.15"
CFLAGS = ["-O2", "-Wall", "-Wextra", "-Werror"]

# Facts of sim_host.example.h, in NVML index order.
GPU0 = {
    "uuid": "GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77",
    "bus_id": "00000000:07:00.0",
    "bus": 7,
    "minor": 1,
}
GPU1 = {
    "uuid": "GPU-2f76cbca-88aa-4e8e-2fde-65765797dbbb",
    "bus_id": "00000000:0F:00.0",
    "bus": 15,
    "minor": 0,
}
NAME = "NVIDIA A100-SXM4-40GB"
MIGS = [  # GPU1's MIG devices: gi, ci, profile, uuid, MiB (a real A100-SXM4-40GB's), cap minors
    (1, 0, "3g.20gb", "MIG-0b8f4c2e-6a1d-5f3b-9c7e-2d4a6b8c0e1f", 20096, (12, 13)),
    (5, 0, "2g.10gb", "MIG-1c9a5d3f-7b2e-5a4c-8d6f-3e5b7c9d1f20", 9984, (48, 49)),
    (13, 0, "1g.5gb", "MIG-2dab6e40-8c3f-5b5d-9e70-4f6c8dae2031", 4864, (120, 121)),
]
GIB = 1 << 30
MIB = 1 << 20
RESERVED = 384 * MIB  # a GPU's reserved memory (nvmlMemory_v2_t) when the control file sets none


@pytest.fixture(scope="module")
def built(tmp_path_factory, require):
    require("gcc")
    base = tmp_path_factory.mktemp("nvml")
    root = base / "host"
    include = base / "include"
    include.mkdir()
    header = (CSRC / "sim_host.example.h").read_text()
    header, n = re.subn(r'#define SIM_ROOT ".*"', f"#define SIM_ROOT {json.dumps(str(root))}", header)
    assert n == 1
    (include / "sim_host.h").write_text(header)

    lib = base / "lib"
    lib.mkdir()
    real = lib / f"libnvidia-ml.so.{DRIVER}"
    subprocess.run(
        [
            "gcc",
            *CFLAGS,
            "-fPIC",
            "-shared",
            f"-I{include}",
            f"-I{CSRC}",
            "-Wl,-soname,libnvidia-ml.so.1",
            "-o",
            str(real),
            str(CSRC / "nvml.c"),
        ],
        check=True,
    )
    (lib / "libnvidia-ml.so.1").symlink_to(real.name)
    (lib / "libnvidia-ml.so").symlink_to("libnvidia-ml.so.1")
    smi = base / "nvidia-smi"
    subprocess.run(
        [
            "gcc",
            *CFLAGS,
            f"-I{include}",
            f"-I{CSRC}",
            "-o",
            str(smi),
            str(CSRC / "nvidia-smi.c"),
            f"-L{lib}",
            "-lnvidia-ml",
        ],
        check=True,
    )
    return {"root": root, "lib": real, "libdir": lib, "smi": smi}


@pytest.fixture
def host(built):
    """A fully visible host: driver loaded, every GPU node and MIG access file present."""
    root = built["root"]
    shutil.rmtree(root, ignore_errors=True)
    (root / "proc/driver/nvidia").mkdir(parents=True)
    (root / "proc/driver/nvidia/version").write_text(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {DRIVER}\n")
    caps = root / "dev/nvidia-caps"
    caps.mkdir(parents=True)
    for name in ("nvidiactl", "nvidia0", "nvidia1", "nvidia-uvm"):
        (root / "dev" / name).touch()
    for *_, minors in MIGS:
        for minor in minors:
            (caps / f"nvidia-cap{minor}").touch()
    return built


PREAMBLE = """
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
import pynvml as N

def err(fn, *args):
    try:
        fn(*args)
    except N.NVMLError as e:
        return e.value
    return 0

def mig_handles(gpu):  # the MIG devices in gpu's first three slots (the host's GPU 1 has three)
    return [N.nvmlDeviceGetMigDeviceHandleByIndex(gpu, i) for i in range(3)]

r = {}
s = lambda v: v.decode() if isinstance(v, bytes) else v  # pynvml decodes some char arrays itself
"""


def pynvml(host, body: str, *args: str) -> dict:
    """Run `body` in a fresh interpreter with pynvml bound to the simulated library; returns `r`.

    `args` follow the library path in sys.argv.

    pynvml dlopens "libnvidia-ml.so.1"; loading ours first makes the loader answer that by SONAME.
    """
    code = PREAMBLE + textwrap.dedent(body) + "\nprint(json.dumps(r))\n"
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(host["lib"]), *args], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def smi(host, *args):
    env = dict(os.environ, LD_LIBRARY_PATH=str(host["libdir"]))
    return subprocess.run([str(host["smi"]), *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture
def nv(require):
    require("pynvml")


# ---- the library through pynvml ---------------------------------------------------------------


def test_loaded_by_soname_and_versions(host, nv):
    r = pynvml(
        host,
        """
        N.nvmlInit()
        r["same"] = N.nvmlLib._handle == lib._handle
        r["driver"] = N.nvmlSystemGetDriverVersion()
        r["nvml"] = N.nvmlSystemGetNVMLVersion()
        r["cuda"] = N.nvmlSystemGetCudaDriverVersion()
        r["cuda2"] = N.nvmlSystemGetCudaDriverVersion_v2()
        r["count"] = N.nvmlDeviceGetCount()
        N.nvmlShutdown()
    """,
    )
    assert r == {"same": True, "driver": DRIVER, "nvml": "12." + DRIVER, "cuda": 12040, "cuda2": 12040, "count": 2}


def test_gpu_attributes(host, nv):
    r = pynvml(
        host,
        """
        N.nvmlInit()
        r["gpus"] = []
        for i in range(N.nvmlDeviceGetCount()):
            h = N.nvmlDeviceGetHandleByIndex(i)
            pci = N.nvmlDeviceGetPciInfo(h)
            ext = N.nvmlPciInfoExt_v1_t(version=N.nvmlPciInfoExt_v1)
            N.nvmlDeviceGetPciInfoExt(h, ctypes.byref(ext))
            mem = N.nvmlDeviceGetMemoryInfo(h)
            mem2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
            r["gpus"].append({
                "name": N.nvmlDeviceGetName(h),
                "uuid": N.nvmlDeviceGetUUID(h),
                "minor": N.nvmlDeviceGetMinorNumber(h),
                "index": N.nvmlDeviceGetIndex(h),
                "brand": N.nvmlDeviceGetBrand(h),
                "pci": [s(pci.busId), s(pci.busIdLegacy), pci.domain, pci.bus, pci.device,
                        pci.pciDeviceId, pci.pciSubSystemId],
                "ext": [s(ext.busId), ext.bus, ext.pciDeviceId],
                "cc": list(N.nvmlDeviceGetCudaComputeCapability(h)),
                "arch": N.nvmlDeviceGetArchitecture(h),
                "mem": [mem.total, mem.free, mem.used],
                "mem2": [mem2.total, mem2.reserved, mem2.free, mem2.used],
                "util": err(N.nvmlDeviceGetUtilizationRates, h) or
                        [N.nvmlDeviceGetUtilizationRates(h).gpu, N.nvmlDeviceGetUtilizationRates(h).memory],
                "persistence": N.nvmlDeviceGetPersistenceMode(h),
                "procs": [N.nvmlDeviceGetComputeRunningProcesses(h),
                          N.nvmlDeviceGetGraphicsRunningProcesses(h)],
                "mig_mode": N.nvmlDeviceGetMigMode(h),
                "max_mig": N.nvmlDeviceGetMaxMigDeviceCount(h),
                "is_mig": N.nvmlDeviceIsMigDeviceHandle(h).value,
                "gi": err(N.nvmlDeviceGetGpuInstanceId, h),
            })
        N.nvmlShutdown()
    """,
    )
    total = 40 * GIB
    for gpu, facts in zip(r["gpus"], (GPU0, GPU1)):
        legacy = "0000:" + facts["bus_id"][9:]
        assert gpu["name"] == NAME
        assert gpu["uuid"] == facts["uuid"]
        assert gpu["minor"] == facts["minor"]
        assert gpu["brand"] == 2  # NVML_BRAND_TESLA
        assert gpu["pci"] == [facts["bus_id"], legacy, 0, facts["bus"], 0, 0x20B010DE, 0x134F10DE]
        assert gpu["ext"] == [facts["bus_id"], facts["bus"], 0x20B010DE]
        assert gpu["cc"] == [8, 0]
        assert gpu["arch"] == 7  # NVML_DEVICE_ARCH_AMPERE
        assert gpu["mem"] == [total, total, 0]
        assert gpu["mem2"] == [total, RESERVED, total - RESERVED, 0]  # the driver's share is not free
        assert gpu["persistence"] == 0
        assert gpu["procs"] == [[], []]
        assert gpu["is_mig"] == 0
        assert gpu["gi"] == 3  # NOT_SUPPORTED on a physical GPU
    assert [g["index"] for g in r["gpus"]] == [0, 1]
    assert r["gpus"][0]["util"] == [0, 0]
    assert r["gpus"][1]["util"] == 3  # no GPU-wide utilization with MIG on
    assert [g["mig_mode"] for g in r["gpus"]] == [[0, 0], [1, 1]]
    assert [g["max_mig"] for g in r["gpus"]] == [0, 7]


def test_mig_handles(host, nv):
    r = pynvml(
        host,
        """
        N.nvmlInit()
        gpu = N.nvmlDeviceGetHandleByIndex(1)
        r["migs"] = []
        for i in range(N.nvmlDeviceGetMaxMigDeviceCount(gpu)):
            try:
                m = N.nvmlDeviceGetMigDeviceHandleByIndex(gpu, i)
            except N.NVMLError_NotFound:
                continue
            parent = N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
            r["migs"].append({
                "slot": i,
                "is_mig": N.nvmlDeviceIsMigDeviceHandle(m).value,
                "gi": N.nvmlDeviceGetGpuInstanceId(m),
                "ci": N.nvmlDeviceGetComputeInstanceId(m),
                "uuid": N.nvmlDeviceGetUUID(m),
                "name": N.nvmlDeviceGetName(m),
                "mem": N.nvmlDeviceGetMemoryInfo(m).total,
                "parent": N.nvmlDeviceGetUUID(parent),
                "bus": s(N.nvmlDeviceGetPciInfo(m).busId),
                "minor": err(N.nvmlDeviceGetMinorNumber, m),
                "util": err(N.nvmlDeviceGetUtilizationRates, m),
            })
        r["past_max"] = err(N.nvmlDeviceGetMigDeviceHandleByIndex, gpu, 7)
        r["on_non_mig_gpu"] = err(N.nvmlDeviceGetMigDeviceHandleByIndex, N.nvmlDeviceGetHandleByIndex(0), 0)
        r["parent_of_gpu"] = err(N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, gpu)
        N.nvmlShutdown()
    """,
    )
    assert r["migs"] == [
        {
            "slot": slot,
            "is_mig": 1,
            "gi": gi,
            "ci": ci,
            "uuid": uuid,
            "name": f"{NAME} MIG {profile}",
            "mem": mib * MIB,
            "parent": GPU1["uuid"],
            "bus": GPU1["bus_id"],
            "minor": 3,
            "util": 3,
        }
        for slot, (gi, ci, profile, uuid, mib, _) in enumerate(MIGS)
    ]
    assert r["past_max"] == 2  # INVALID_ARGUMENT
    assert r["on_non_mig_gpu"] == 2
    assert r["parent_of_gpu"] == 2


# A100-SXM4-40GB's profiles as nvidia-smi mig -lgip lists them: profile enum -> (id, slices,
# instances, SMs, copy engines, decoders, memory MiB, placement size)
A100_PROFILES = {0: (19, 1, 7, 14, 1, 0, 4864, 1), 1: (14, 2, 3, 28, 2, 1, 9984, 2), 2: (9, 3, 2, 42, 3, 2, 20096, 4),
                 3: (5, 4, 1, 56, 4, 2, 20096, 4), 4: (0, 7, 1, 98, 7, 5, 40192, 8)}  # fmt: skip
SLICES = {"3g.20gb": 3, "2g.10gb": 2, "1g.5gb": 1}


def test_mig_instances_as_nvidias_cdi_generator_asks(host, nv):
    """The calls NVIDIA's CDI generator makes for a MIG device, through the official bindings:
    the device's attributes, its GPU and compute instance looked up by id, their info, and the
    instance profiles."""
    r = pynvml(
        host,
        """
        N.nvmlInit()
        gpu = N.nvmlDeviceGetHandleByIndex(1)
        r["migs"] = []
        for m in mig_handles(gpu):
            a = N.nvmlDeviceGetAttributes(m)
            gi = N.nvmlDeviceGetGpuInstanceById(gpu, N.nvmlDeviceGetGpuInstanceId(m))
            gi_info = N.nvmlGpuInstanceGetInfo(gi)
            ci = N.nvmlGpuInstanceGetComputeInstanceById(gi, N.nvmlDeviceGetComputeInstanceId(m))
            ci_info = N.nvmlComputeInstanceGetInfo(ci)
            cip = N.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_info.profileId, 0)
            r["migs"].append({
                "attributes": [a.gpuInstanceSliceCount, a.computeInstanceSliceCount, a.memorySizeMB,
                               a.multiprocessorCount],
                "engines": [a.sharedCopyEngineCount, a.sharedDecoderCount, a.sharedEncoderCount,
                            a.sharedJpegCount, a.sharedOfaCount],
                "memory_info_mib": N.nvmlDeviceGetMemoryInfo(m).total >> 20,
                "gi": [gi_info.id, gi_info.profileId, gi_info.placement.start, gi_info.placement.size,
                       N.nvmlDeviceGetUUID(gi_info.device)],
                "ci": [ci_info.id, ci_info.profileId, ci_info.placement.size, N.nvmlDeviceGetUUID(ci_info.device)],
                "ci_profile": [cip.sliceCount, s(cip.name)],
            })
        r["profiles"] = {}
        for index in range(8):
            try:
                p = N.nvmlDeviceGetGpuInstanceProfileInfo(gpu, index)
            except N.NVMLError as e:
                r["profiles"][index] = e.value
                continue
            r["profiles"][index] = [p.id, p.sliceCount, p.instanceCount, p.multiprocessorCount, p.copyEngineCount,
                                    p.decoderCount, p.memorySizeMB, s(p.name)]
        r["v1"] = N.nvmlDeviceGetGpuInstanceProfileInfo(gpu, 0, version=1).memorySizeMB
        r["gi_unknown"] = err(N.nvmlDeviceGetGpuInstanceById, gpu, 2)
        r["gi_on_non_mig"] = err(N.nvmlDeviceGetGpuInstanceById, N.nvmlDeviceGetHandleByIndex(0), 1)
        r["ci_unknown"] = err(N.nvmlGpuInstanceGetComputeInstanceById, N.nvmlDeviceGetGpuInstanceById(gpu, 1), 1)
        r["whole_gpu_attributes"] = err(N.nvmlDeviceGetAttributes, gpu)
        r["ci_profile_too_big"] = err(N.nvmlGpuInstanceGetComputeInstanceProfileInfo,
                                      N.nvmlDeviceGetGpuInstanceById(gpu, 13), 1, 0)
        N.nvmlShutdown()
    """,
    )
    starts = {"3g.20gb": 0, "2g.10gb": 4, "1g.5gb": 6}
    by_slices = {p[1]: p for p in A100_PROFILES.values()}
    for got, (gi, ci, profile, _uuid, mib, _) in zip(r["migs"], MIGS):
        pid, slices, _, sms, copy, decoders, memory_mb, size = by_slices[SLICES[profile]]
        assert got["attributes"] == [slices, slices, memory_mb, sms]
        # GFD labels the attributes, we label the memory info: one figure, as on a real A100
        assert got["memory_info_mib"] == memory_mb == mib
        assert got["engines"] == [copy, decoders, 0, 0, 0]
        assert got["gi"] == [gi, pid, starts[profile], size, GPU1["uuid"]]
        assert got["ci"] == [ci, {1: 0, 2: 1, 3: 2}[slices], slices, GPU1["uuid"]]
        assert got["ci_profile"] == [slices, f"MIG {profile}"]
    names = ("1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb")
    expected_profiles = {str(i): [*v[:6], v[6], f"MIG {n}"] for (i, v), n in zip(A100_PROFILES.items(), names)}
    expected_profiles.update({"5": 3, "6": 3, "7": 3})  # NOT_SUPPORTED: 6- and 8-slice, REV1
    assert r["profiles"] == expected_profiles
    assert r["v1"] == 4864
    assert r["gi_unknown"] == 6 and r["ci_unknown"] == 6  # NOT_FOUND
    assert r["gi_on_non_mig"] == 3 and r["whole_gpu_attributes"] == 3  # NOT_SUPPORTED
    assert r["ci_profile_too_big"] == 3


def test_lookups(host, nv):
    r = pynvml(
        host,
        """
        N.nvmlInit()
        uuid = N.nvmlDeviceGetUUID
        r["gpu"] = uuid(N.nvmlDeviceGetHandleByUUID(sys.argv[2]))
        r["mig"] = N.nvmlDeviceGetGpuInstanceId(N.nvmlDeviceGetHandleByUUID(sys.argv[3]))
        r["bus"] = [uuid(N.nvmlDeviceGetHandleByPciBusId(b))
                    for b in ("00000000:0F:00.0", "0000:0f:00.0", "0f:00.0", "00000000:07:00.0")]
        r["unknown_uuid"] = err(N.nvmlDeviceGetHandleByUUID, "GPU-00000000-0000-0000-0000-000000000000")
        r["unknown_bus"] = err(N.nvmlDeviceGetHandleByPciBusId, "0000:99:00.0")
        r["bad_bus"] = err(N.nvmlDeviceGetHandleByPciBusId, "not-a-bus-id")
        r["bad_index"] = err(N.nvmlDeviceGetHandleByIndex, 2)
        N.nvmlShutdown()
    """,
        GPU1["uuid"],
        MIGS[2][3],
    )
    assert r == {
        "gpu": GPU1["uuid"],
        "mig": 13,
        "bus": [GPU1["uuid"], GPU1["uuid"], GPU1["uuid"], GPU0["uuid"]],
        "unknown_uuid": 6,  # NOT_FOUND
        "unknown_bus": 6,
        "bad_bus": 2,  # INVALID_ARGUMENT
        "bad_index": 2,
    }


def test_init_errors_and_strings(host, nv):
    r = pynvml(
        host,
        """
        from ctypes import byref, c_uint, c_int, create_string_buffer
        count = c_uint()
        # Straight through ctypes: pynvml refuses calls itself until nvmlInit has loaded the library.
        r["before_init"] = lib.nvmlDeviceGetCount_v2(byref(count))
        r["shutdown_before_init"] = lib.nvmlShutdown()
        cuda = c_int()
        r["cuda_before_init"] = [lib.nvmlSystemGetCudaDriverVersion(byref(cuda)), cuda.value]
        N.nvmlInit()
        N.nvmlInit()
        N.nvmlShutdown()
        r["still_initialized"] = N.nvmlDeviceGetCount()
        h = N.nvmlDeviceGetHandleByIndex(0)
        small = create_string_buffer(8)
        r["small_name"] = lib.nvmlDeviceGetName(h, small, c_uint(8))
        r["small_version"] = lib.nvmlSystemGetDriverVersion(small, c_uint(8))
        r["null_count"] = lib.nvmlDeviceGetCount_v2(None)
        r["bad_handle"] = lib.nvmlDeviceGetMinorNumber(ctypes.c_void_p(12345), byref(count))
        r["strings"] = {str(c): N.nvmlErrorString(c) for c in (0, 1, 2, 6, 7, 9, 999)}
        r["mem_v2_bad_version"] = err(N.nvmlDeviceGetMemoryInfo, h, 1)
        N.nvmlShutdown()
        r["after_shutdown"] = lib.nvmlDeviceGetCount_v2(byref(count))
        r["handle_after_shutdown"] = lib.nvmlDeviceGetMinorNumber(h, byref(count))
        r["extra_shutdown"] = lib.nvmlShutdown()
    """,
    )
    assert r == {
        "before_init": 1,
        "shutdown_before_init": 1,
        "cuda_before_init": [0, 12040],
        "still_initialized": 2,
        "small_name": 7,
        "small_version": 7,
        "null_count": 2,
        "bad_handle": 2,
        "strings": {
            "0": "Success",
            "1": "Uninitialized",
            "2": "Invalid Argument",
            "6": "Not Found",
            "7": "Insufficient Size",
            "9": "Driver Not Loaded",
            "999": "Unknown Error",
        },
        "mem_v2_bad_version": 25,  # ARGUMENT_VERSION_MISMATCH
        "after_shutdown": 1,
        "handle_after_shutdown": 1,
        "extra_shutdown": 1,
    }


VISIBLE = """
try:
    N.nvmlInit()
except N.NVMLError as e:
    r["init"] = e.value
    r["error"] = str(e)
else:
    r["init"] = 0
    r["gpus"] = []
    for i in range(N.nvmlDeviceGetCount()):
        h = N.nvmlDeviceGetHandleByIndex(i)
        migs = []
        if N.nvmlDeviceGetMigMode(h)[0]:
            for j in range(N.nvmlDeviceGetMaxMigDeviceCount(h)):
                try:
                    migs.append(N.nvmlDeviceGetUUID(N.nvmlDeviceGetMigDeviceHandleByIndex(h, j)))
                except N.NVMLError_NotFound:
                    pass
        r["gpus"].append([N.nvmlDeviceGetIndex(h), N.nvmlDeviceGetMinorNumber(h), N.nvmlDeviceGetUUID(h), migs])
    r["hidden_uuid"] = err(N.nvmlDeviceGetHandleByUUID, sys.argv[2])
    N.nvmlShutdown()
"""


def test_removing_nodes_hides_devices(host, nv):
    dev = host["root"] / "dev"
    (dev / f"nvidia{GPU0['minor']}").unlink()  # GPU0 is /dev/nvidia1: minors are swapped
    (dev / "nvidia-caps" / f"nvidia-cap{MIGS[1][5][1]}").unlink()  # 2g.10gb's CI access file
    r = pynvml(host, VISIBLE, GPU0["uuid"])
    # The container-style view: GPU1 renumbered to index 0, MIG slots compacted.
    assert r == {"init": 0, "gpus": [[0, 0, GPU1["uuid"], [MIGS[0][3], MIGS[2][3]]]], "hidden_uuid": 6}


def test_no_gpu_nodes_is_an_empty_driver(host, nv):
    for minor in (0, 1):
        (host["root"] / "dev" / f"nvidia{minor}").unlink()
    r = pynvml(host, VISIBLE, GPU0["uuid"])
    assert r == {"init": 0, "gpus": [], "hidden_uuid": 6}


def test_no_nvidiactl_is_driver_not_loaded(host, nv):
    (host["root"] / "dev" / "nvidiactl").unlink()
    r = pynvml(host, VISIBLE + "\nr['retry'] = err(N.nvmlInit)\n", GPU0["uuid"])
    assert r == {"init": 9, "error": "Driver Not Loaded", "retry": 9}


def test_without_host_procfs_looks_at_real_dev(host, nv):
    # As inside a container: the simulated host is out of sight, the runtime's /dev is what counts.
    (host["root"] / "proc/driver/nvidia/version").unlink()
    r = pynvml(host, VISIBLE, GPU0["uuid"])
    if not os.path.exists("/dev/nvidiactl"):
        assert r == {"init": 9, "error": "Driver Not Loaded"}
    else:  # a machine with a real driver: only the minors that exist under /dev count
        minors = [g["minor"] for g in (GPU0, GPU1) if os.path.exists(f"/dev/nvidia{g['minor']}")]
        assert sorted(g[1] for g in r["gpus"]) == sorted(minors)


# ---- nvidia-smi ----------------------------------------------------------------------------------


def test_smi_list(host):
    p = smi(host, "-L")
    assert (p.returncode, p.stderr) == (0, "")
    assert p.stdout == (
        f"GPU 0: {NAME} (UUID: {GPU0['uuid']})\n"
        f"GPU 1: {NAME} (UUID: {GPU1['uuid']})\n"
        f"  MIG 3g.20gb     Device  0: (UUID: {MIGS[0][3]})\n"
        f"  MIG 2g.10gb     Device  1: (UUID: {MIGS[1][3]})\n"
        f"  MIG 1g.5gb      Device  2: (UUID: {MIGS[2][3]})\n"
    )
    assert smi(host, "--list-gpus").stdout == p.stdout


def test_smi_list_follows_visibility(host):
    (host["root"] / "dev" / f"nvidia{GPU0['minor']}").unlink()
    (host["root"] / "dev" / "nvidia-caps" / f"nvidia-cap{MIGS[0][5][0]}").unlink()
    p = smi(host, "-L")
    assert p.returncode == 0
    assert p.stdout == (
        f"GPU 0: {NAME} (UUID: {GPU1['uuid']})\n"
        f"  MIG 2g.10gb     Device  0: (UUID: {MIGS[1][3]})\n"
        f"  MIG 1g.5gb      Device  1: (UUID: {MIGS[2][3]})\n"
    )


def test_smi_no_devices(host):
    for minor in (0, 1):
        (host["root"] / "dev" / f"nvidia{minor}").unlink()
    for args in (["-L"], []):
        p = smi(host, *args)
        assert (p.returncode, p.stdout) == (6, "No devices were found\n")


def test_smi_without_driver(host):
    (host["root"] / "dev" / "nvidiactl").unlink()
    p = smi(host, "-L")
    assert p.returncode == 9
    assert p.stdout.startswith("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


def test_smi_table(host):
    p = smi(host)
    assert p.returncode == 0
    lines = p.stdout.splitlines()
    table = [line for line in lines if line.startswith(("+", "|"))]
    assert all(len(line) == 91 for line in table), table
    header = lines[2]
    assert re.match(rf"\| NVIDIA-SMI {DRIVER} +Driver Version: {DRIVER} +CUDA Version: 12\.4 +\|$", header)
    rows = [line for line in lines if re.match(r"\| +\d+  NVIDIA", line)]
    assert [r.split()[1] for r in rows] == ["0", "1"]
    assert all(NAME in r for r in rows)
    assert GPU0["bus_id"] in rows[0] and GPU1["bus_id"] in rows[1]
    assert p.stdout.count("0MiB /  40960MiB") == 2
    assert "MIG devices:" in p.stdout
    assert "No running processes found" in p.stdout


def test_smi_version_query_and_usage(host):
    p = smi(host, "--version")
    assert p.returncode == 0
    assert p.stdout == (
        f"NVIDIA-SMI version  : {DRIVER}\nNVML version        : 550.54\n"
        f"DRIVER version      : {DRIVER}\nCUDA Version        : 12.4\n"
    )
    p = smi(host, "--query-gpu=index,uuid,pci.bus_id,memory.total,mig.mode.current", "--format=csv")
    assert p.returncode == 0
    assert p.stdout == (
        "index, uuid, pci.bus_id, memory.total [MiB], mig.mode.current\n"
        f"0, {GPU0['uuid']}, {GPU0['bus_id']}, 40960 MiB, Disabled\n"
        f"1, {GPU1['uuid']}, {GPU1['bus_id']}, 40960 MiB, Enabled\n"
    )
    p = smi(host, "--query-gpu=uuid", "--format=csv,noheader")
    assert p.stdout == f"{GPU0['uuid']}\n{GPU1['uuid']}\n"
    assert smi(host, "--query-gpu=bogus", "--format=csv").returncode == 2
    assert smi(host, "--frobnicate").returncode == 2
    assert smi(host, "-h").returncode == 0


# ---- live values: the control file -----------------------------------------------------------------

# For a body that changes the control file while it runs: control(text) replaces sys.argv[2]
# atomically, as control.write() does (a new inode, so the library sees the change).
CONTROL = """
import os
def control(text):
    tmp = sys.argv[2] + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, sys.argv[2])
"""


def script(*parts: str) -> str:
    """A pynvml() body from snippets, each dedented on its own."""
    return "".join(textwrap.dedent(part) for part in parts)


NO_PID = 4194303  # the highest pid Linux hands out (pid_max <= 4194304); the tests check it is unused


@pytest.fixture
def live(host):
    """The control file's place (SIM_ROOT/nvml-control), cleared after the test."""
    root = str(host["root"])
    path = os.path.join(root, control.FILE)
    assert not os.path.exists(path)  # the host fixture starts from nothing
    yield path
    control.clear(root)
    assert not os.path.exists(path)


READ_VALUES = """
N.nvmlInit()
g0 = N.nvmlDeviceGetHandleByIndex(0)
g1 = N.nvmlDeviceGetHandleByIndex(1)
m1 = N.nvmlDeviceGetMigDeviceHandleByIndex(g1, 1)

def values():
    util = N.nvmlDeviceGetUtilizationRates(g0)
    mem = N.nvmlDeviceGetMemoryInfo(g0)
    mem2 = N.nvmlDeviceGetMemoryInfo(g0, version=N.nvmlMemory_v2)
    g1_mem = N.nvmlDeviceGetMemoryInfo(g1)
    return {
        "util": [util.gpu, util.memory],
        "temperature": N.nvmlDeviceGetTemperature(g0, N.NVML_TEMPERATURE_GPU),
        "power": N.nvmlDeviceGetPowerUsage(g0),
        "sm_clock": N.nvmlDeviceGetClockInfo(g0, N.NVML_CLOCK_SM),
        "mem_clock": N.nvmlDeviceGetClockInfo(g0, N.NVML_CLOCK_MEM),
        "energy": N.nvmlDeviceGetTotalEnergyConsumption(g0),
        "memory": [mem.total, mem.used, mem.free],
        "memory_v2": [mem2.used, mem2.free],
        "g1_temperature": N.nvmlDeviceGetTemperature(g1, N.NVML_TEMPERATURE_GPU),
        "g1_memory": [g1_mem.used, g1_mem.free],
        "g1_util": err(N.nvmlDeviceGetUtilizationRates, g1),
        "mig_memory": N.nvmlDeviceGetMemoryInfo(m1).used,
    }
"""

DEFAULT_VALUES = {
    "util": [0, 0],
    "temperature": 33,
    "power": 58000,
    "sm_clock": 1410,
    "mem_clock": 1215,
    "energy": 0,
    "memory": [40 * GIB, 0, 40 * GIB],
    "memory_v2": [0, 40 * GIB - RESERVED],
    "g1_temperature": 33,
    "g1_memory": [0, 40 * GIB],
    "g1_util": 3,  # NOT_SUPPORTED with MIG on, whatever the control file says
    "mig_memory": 0,
}


def test_live_values_read_back_and_followed_without_reinit(live, nv, host):
    first = {
        GPU0["uuid"]: {"util_gpu": 37, "util_memory": 12, "temperature": 71, "power": 123456, "sm_clock": 1305,
                       "mem_clock": 1593, "energy": 5_000_000_000_123, "memory_used": 3 * GIB},
        GPU1["uuid"]: {"temperature": 64, "util_gpu": 99, "memory_used": 7 * GIB},
        MIGS[1][3]: {"memory_used": 1536 << 20},
    }  # fmt: skip
    second = {
        GPU0["uuid"]: {"util_gpu": 100, "util_memory": 0, "temperature": 88, "power": 400000, "sm_clock": 210,
                       "mem_clock": 405, "energy": 6_000_000_000_000, "memory_used": 40 * GIB},
        GPU1["uuid"]: {"memory_used": 50 * GIB},  # more than the GPU has: capped at its total
    }  # fmt: skip
    control.write(str(host["root"]), devices=first)
    r = pynvml(
        host,
        script(
            CONTROL,
            READ_VALUES,
            """
            r["first"] = values()
            r["again"] = values()  # unchanged file: same answers
            control(sys.argv[3])
            r["second"] = values()
            os.unlink(sys.argv[2])
            r["cleared"] = values()
            N.nvmlShutdown()
            """,
        ),
        live,
        control.render(devices=second),
    )
    assert r["first"] == {
        "util": [37, 12],
        "temperature": 71,
        "power": 123456,
        "sm_clock": 1305,
        "mem_clock": 1593,
        "energy": 5_000_000_000_123,
        "memory": [40 * GIB, 3 * GIB, 37 * GIB],
        "memory_v2": [3 * GIB, 37 * GIB - RESERVED],
        "g1_temperature": 64,
        "g1_memory": [7 * GIB, 33 * GIB],
        "g1_util": 3,
        "mig_memory": 1536 << 20,
    }
    assert r["again"] == r["first"]
    assert r["second"] == {
        **DEFAULT_VALUES,
        "util": [100, 0],
        "temperature": 88,
        "power": 400000,
        "sm_clock": 210,
        "mem_clock": 405,
        "energy": 6_000_000_000_000,
        "memory": [40 * GIB, 40 * GIB, 0],
        "memory_v2": [40 * GIB - RESERVED, 0],  # used is cut to what reservation leaves
        "g1_memory": [40 * GIB, 0],
    }
    assert r["cleared"] == DEFAULT_VALUES


PROCESSES = """
from ctypes import Structure, byref, c_uint, c_ulonglong

class V1(Structure):  # nvmlProcessInfo_v1_t
    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong)]

N.nvmlInit()
g0 = N.nvmlDeviceGetHandleByIndex(0)
g1 = N.nvmlDeviceGetHandleByIndex(1)
migs = mig_handles(g1)

def procs(fn, h):
    return sorted([p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in fn(h))

def v1(h):
    count = c_uint(0)
    query = [lib.nvmlDeviceGetComputeRunningProcesses(h, byref(count), None), count.value]
    array = (V1 * max(count.value, 1))()
    ret = lib.nvmlDeviceGetComputeRunningProcesses(h, byref(count), array)
    return query, ret, sorted([a.pid, a.usedGpuMemory] for a in array[: count.value])

def snapshot():
    return {
        "g0": procs(N.nvmlDeviceGetComputeRunningProcesses, g0),
        "g0_v2": procs(N.nvmlDeviceGetComputeRunningProcesses_v2, g0),
        "g0_v1": v1(g0),
        "g0_graphics": N.nvmlDeviceGetGraphicsRunningProcesses(g0) + N.nvmlDeviceGetMPSComputeRunningProcesses(g0),
        "g0_used": N.nvmlDeviceGetMemoryInfo(g0).used,
        "g1": procs(N.nvmlDeviceGetComputeRunningProcesses, g1),
        "g1_used": N.nvmlDeviceGetMemoryInfo(g1).used,
        "migs": [procs(N.nvmlDeviceGetComputeRunningProcesses, m) for m in migs],
        "migs_used": [N.nvmlDeviceGetMemoryInfo(m).used for m in migs],
    }

r["live"] = snapshot()
"""

NOT_AVAILABLE = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId of a process on a full GPU


def test_processes_only_live_ones_with_their_mig_instance(live, nv, host, sleepers):
    a, b = sleepers(), sleepers()
    assert not os.path.exists(f"/proc/{NO_PID}")
    gi, ci = MIGS[1][0], MIGS[1][1]
    control.write(
        str(host["root"]),
        processes=[
            (GPU0["uuid"], a.pid, GIB),
            (GPU0["uuid"], NO_PID, 2 * GIB),  # not running: not reported, its memory not counted
            (GPU0["uuid"], b.pid, 256 << 20),
            (MIGS[1][3], a.pid, 512 << 20),  # on GPU1's 2g.10gb
        ],
    )
    r = pynvml(host, PROCESSES + "N.nvmlShutdown()\n")["live"]
    on_g0 = sorted([[a.pid, GIB, NOT_AVAILABLE, NOT_AVAILABLE], [b.pid, 256 << 20, NOT_AVAILABLE, NOT_AVAILABLE]])
    assert r["g0"] == on_g0
    assert r["g0_v2"] == on_g0
    assert r["g0_v1"] == [[7, 2], 0, sorted([[a.pid, GIB], [b.pid, 256 << 20]])]  # 7: INSUFFICIENT_SIZE
    assert r["g0_graphics"] == []
    assert r["g0_used"] == GIB + (256 << 20)  # no memory_used set: what the live processes use
    on_mig = [[a.pid, 512 << 20, gi, ci]]
    assert r["migs"] == [[], on_mig, []]
    assert r["g1"] == on_mig  # the GPU lists its MIG devices' processes, with their instance ids
    assert r["migs_used"] == [0, 512 << 20, 0]
    assert r["g1_used"] == 512 << 20

    a.kill()
    a.wait()
    r = pynvml(host, PROCESSES + "N.nvmlShutdown()\n")["live"]
    assert r["g0"] == [[b.pid, 256 << 20, NOT_AVAILABLE, NOT_AVAILABLE]]
    assert r["g0_v1"] == [[7, 1], 0, [[b.pid, 256 << 20]]]
    assert r["g1"] == r["migs"][1] == []
    assert (r["g0_used"], r["g1_used"], r["migs_used"]) == (256 << 20, 0, [0, 0, 0])


def test_process_size_query_protocol(live, nv, host, sleepers):
    procs = [sleepers() for _ in range(3)]
    control.write(str(host["root"]), processes=[(GPU0["uuid"], p.pid, (i + 1) << 20) for i, p in enumerate(procs)])
    r = pynvml(
        host,
        """
        from ctypes import byref, c_uint
        N.nvmlInit()
        g0 = N.nvmlDeviceGetHandleByIndex(0)
        g1 = N.nvmlDeviceGetHandleByIndex(1)
        Info = N.c_nvmlProcessInfo_v3_t
        for fn in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"):
            f = getattr(lib, fn)
            count = c_uint(0)
            r[fn] = {"null": [f(g0, byref(count), None), count.value]}
            small = (Info * 2)()
            count = c_uint(2)
            r[fn]["small"] = [f(g0, byref(count), small), count.value]
            big = (Info * 8)()
            count = c_uint(8)
            r[fn]["big"] = [f(g0, byref(count), big), count.value, sorted(big[i].usedGpuMemory for i in range(3))]
            count = c_uint(5)
            r[fn]["none_running"] = [f(g1, byref(count), None), count.value]  # no processes: no buffer needed
            r[fn]["null_count"] = f(g0, None, big)
        N.nvmlShutdown()
    """,
    )
    for fn in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"):
        assert r[fn] == {
            "null": [7, 3],  # NVML_ERROR_INSUFFICIENT_SIZE and the count needed
            "small": [7, 3],
            "big": [0, 3, [1 << 20, 2 << 20, 3 << 20]],
            "none_running": [0, 0],
            "null_count": 2,  # INVALID_ARGUMENT
        }, fn


def test_memory_used_setting_overrides_the_processes(live, nv, host, sleepers):
    p = sleepers()
    control.write(
        str(host["root"]),
        devices={GPU0["uuid"]: {"memory_used": 5 * GIB}},
        processes=[(GPU0["uuid"], p.pid, GIB), (MIGS[0][3], p.pid, 2 * GIB)],
    )
    r = pynvml(
        host,
        """
        N.nvmlInit()
        g1 = N.nvmlDeviceGetHandleByIndex(1)
        r["used"] = [N.nvmlDeviceGetMemoryInfo(N.nvmlDeviceGetHandleByIndex(0)).used,
                     N.nvmlDeviceGetMemoryInfo(g1).used,
                     N.nvmlDeviceGetMemoryInfo(N.nvmlDeviceGetMigDeviceHandleByIndex(g1, 0)).used]
        N.nvmlShutdown()
    """,
    )
    assert r["used"] == [5 * GIB, 2 * GIB, 2 * GIB]


@pytest.mark.parametrize("code, name", [(999, "NVMLError_Unknown"), (9, "NVMLError_DriverNotLoaded")])
def test_fail_makes_init_and_device_calls_fail(live, nv, host, code, name):
    control.write(str(host["root"]), fail=code)
    r = pynvml(
        host,
        """
        try:
            N.nvmlInit()
        except N.NVMLError as e:
            r["init"] = [e.value, type(e).__name__, isinstance(e, N.NVMLError)]
        r["retry"] = err(N.nvmlInit)
    """,
    )
    assert r == {"init": [code, name, True], "retry": code}

    control.clear(str(host["root"]))
    r = pynvml(
        host,
        script(
            CONTROL,
            """
            N.nvmlInit()
            r["count"] = N.nvmlDeviceGetCount()
            g0 = N.nvmlDeviceGetHandleByIndex(0)
            mig = N.nvmlDeviceGetMigDeviceHandleByIndex(N.nvmlDeviceGetHandleByIndex(1), 0)
            control(sys.argv[3])  # a fault that comes while the client runs
            r["calls"] = [err(N.nvmlDeviceGetUUID, g0), err(N.nvmlDeviceGetMemoryInfo, g0),
                          err(N.nvmlDeviceGetTemperature, g0, 0), err(N.nvmlDeviceGetComputeRunningProcesses, g0),
                          err(N.nvmlDeviceGetUUID, mig)]
            r["init"] = err(N.nvmlInit)
            os.unlink(sys.argv[2])
            r["after"] = [N.nvmlDeviceGetUUID(g0), N.nvmlDeviceGetUUID(mig)]
            N.nvmlShutdown()
            """,
        ),
        live,
        control.render(fail=code),
    )
    assert r == {"count": 2, "calls": [code] * 5, "init": code, "after": [GPU0["uuid"], MIGS[0][3]]}


def test_mig_handles_have_no_board_sensors(live, nv, host):
    # Values set for the MIG device itself change nothing: its board's sensors are the GPU's.
    control.write(str(host["root"]), devices={MIGS[0][3]: {"temperature": 50, "power": 1000, "sm_clock": 900,
                                                           "mem_clock": 800, "energy": 7}})  # fmt: skip
    r = pynvml(
        host,
        """
        N.nvmlInit()
        g1 = N.nvmlDeviceGetHandleByIndex(1)
        r["mig"] = [[err(N.nvmlDeviceGetTemperature, m, N.NVML_TEMPERATURE_GPU), err(N.nvmlDeviceGetPowerUsage, m),
                     err(N.nvmlDeviceGetClockInfo, m, N.NVML_CLOCK_SM),
                     err(N.nvmlDeviceGetClockInfo, m, N.NVML_CLOCK_MEM),
                     err(N.nvmlDeviceGetTotalEnergyConsumption, m)] for m in mig_handles(g1)]
        try:
            N.nvmlDeviceGetTemperature(N.nvmlDeviceGetMigDeviceHandleByIndex(g1, 0), N.NVML_TEMPERATURE_GPU)
        except N.NVMLError_NotSupported as e:
            r["raised"] = [type(e).__name__, e.value]
        g0 = N.nvmlDeviceGetHandleByIndex(0)
        r["gpu"] = [N.nvmlDeviceGetTemperature(g1, 0), err(N.nvmlDeviceGetTemperature, g0, 1),
                    err(N.nvmlDeviceGetClockInfo, g0, 4)]
        N.nvmlShutdown()
    """,
    )
    assert r == {
        "mig": [[3] * 5] * 3,  # NVML_ERROR_NOT_SUPPORTED
        "raised": ["NVMLError_NotSupported", 3],
        "gpu": [33, 2, 2],  # the GPU itself answers; an unknown sensor or clock is INVALID_ARGUMENT
    }


# ---- events: what NVIDIA's device plugin waits on for health -----------------------------------

EVENTS = f"""
import threading, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
import nvmlevents as C
root = sys.argv[2]
XID = N.nvmlEventTypeXidCriticalError
N.nvmlInit()
g0 = N.nvmlDeviceGetHandleByIndex(0)
g1 = N.nvmlDeviceGetHandleByIndex(1)
m13 = N.nvmlDeviceGetMigDeviceHandleByIndex(g1, 2)  # gi 13, ci 0

def event(s, timeout=2000):
    try:
        e = N.nvmlEventSetWait_v2(s, timeout)
    except N.NVMLError as x:
        return x.value
    uuid = N.nvmlDeviceGetUUID(e.device)
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    return [uuid, e.eventType, e.eventData, e.gpuInstanceId, e.computeInstanceId]
"""


def test_events_deliver_injected_xids_as_nvidias_plugin_registers_them(host, nv):
    r = pynvml(
        host,
        script(
            EVENTS,
            """
            r["supported"] = [N.nvmlDeviceGetSupportedEventTypes(g0), err(N.nvmlDeviceGetSupportedEventTypes, m13)]
            C.inject_xid(root, sys.argv[3], 31)  # before any set exists: delivered to none
            s = N.nvmlEventSetCreate()
            mask = XID | N.nvmlEventTypeDoubleBitEccError | N.nvmlEventTypeSingleBitEccError
            N.nvmlDeviceRegisterEvents(g0, mask & N.nvmlDeviceGetSupportedEventTypes(g0), s)
            N.nvmlDeviceRegisterEvents(g1, XID, s)
            r["refused"] = [err(N.nvmlDeviceRegisterEvents, g0, 1 << 40, s),
                            err(N.nvmlDeviceRegisterEvents, m13, XID, s)]
            r["nothing_yet"] = event(s, 50)
            C.inject_xid(root, sys.argv[3], 79)
            C.inject_xid(root, "GPU-00000000-0000-0000-0000-000000000000", 79)  # no such GPU: skipped
            C.inject_xid(root, sys.argv[4], 48)  # a MIG device's: its GPU, naming its instances
            r["events"] = [event(s), event(s), event(s, 50)]
            later = N.nvmlEventSetCreate()  # a set sees what happens after it is made
            N.nvmlDeviceRegisterEvents(g1, XID, later)
            r["later_sees_nothing_old"] = event(later, 50)
            # An XID while a thread waits wakes it; both sets get it.
            threading.Timer(0.2, C.inject_xid, (root, sys.argv[5], 94)).start()
            r["waited"] = [event(later, 10000), event(s, 10000)]
            N.nvmlEventSetFree(later)
            r["freed"] = [err(N.nvmlEventSetWait_v2, later, 10), err(N.nvmlEventSetFree, later)]
            # The v1 entry point fills the struct without the instance ids.
            class V1(ctypes.Structure):
                _fields_ = [("device", ctypes.c_void_p), ("eventType", ctypes.c_ulonglong),
                            ("eventData", ctypes.c_ulonglong), ("guard", ctypes.c_uint * 2)]
            C.inject_xid(root, sys.argv[3], 63)
            v1 = V1(guard=(7, 7))
            r["v1"] = [lib.nvmlEventSetWait(s, ctypes.byref(v1), 2000), v1.eventType, v1.eventData, list(v1.guard)]
            N.nvmlEventSetFree(s)
            N.nvmlShutdown()
            r["uninitialized"] = err(N.nvmlEventSetCreate)
            """,
        ),
        str(host["root"]),
        GPU0["uuid"],
        MIGS[2][3],
        GPU1["uuid"],
    )
    nvmlevents.clear_events(str(host["root"]))
    xid = 8  # nvmlEventTypeXidCriticalError
    assert r == {
        "supported": [0x1F, 3],  # SBE, DBE, PState, XID, clock; a MIG handle: NOT_SUPPORTED
        "refused": [3, 3],
        "nothing_yet": 10,  # NVML_ERROR_TIMEOUT
        "events": [[GPU0["uuid"], xid, 79, 0xFFFFFFFF, 0xFFFFFFFF], [GPU1["uuid"], xid, 48, 13, 0], 10],
        "later_sees_nothing_old": 10,
        "waited": [[GPU1["uuid"], xid, 94, 0xFFFFFFFF, 0xFFFFFFFF]] * 2,
        "freed": [2, 2],
        "v1": [0, xid, 63, [7, 7]],
        "uninitialized": 1,
    }


def test_events_only_for_registered_gpus_and_fail_with_nvml(live, nv, host):
    r = pynvml(
        host,
        script(
            EVENTS,
            CONTROL.replace("sys.argv[2]", "sys.argv[3]"),
            """
            s = N.nvmlEventSetCreate()
            N.nvmlDeviceRegisterEvents(g1, XID, s)
            C.inject_xid(root, sys.argv[4], 79)  # GPU 0: not registered in this set
            r["unregistered"] = event(s, 100)
            control("fail 999\\n")
            r["failing"] = event(s, 100)
            N.nvmlShutdown()
            """,
        ),
        str(host["root"]),
        live,
        GPU0["uuid"],
    )
    nvmlevents.clear_events(str(host["root"]))
    assert r == {"unregistered": 10, "failing": 999}


def test_topology_and_nvlink_of_the_example_host(host, nv):
    # sim_host.example.h: both GPUs under one switch, joined by one NVLink (link 0 of each).
    r = pynvml(
        host,
        """
        N.nvmlInit()
        g0 = N.nvmlDeviceGetHandleByIndex(0)
        g1 = N.nvmlDeviceGetHandleByIndex(1)
        m = N.nvmlDeviceGetMigDeviceHandleByIndex(g1, 0)
        r["ancestor"] = [N.nvmlDeviceGetTopologyCommonAncestor(g0, g1), N.nvmlDeviceGetTopologyCommonAncestor(g1, g1),
                         N.nvmlDeviceGetTopologyCommonAncestor(m, g1), N.nvmlDeviceGetTopologyCommonAncestor(g0, m)]
        r["state"] = [N.nvmlDeviceGetNvLinkState(g0, 0), N.nvmlDeviceGetNvLinkState(g1, 0),
                      N.nvmlDeviceGetNvLinkState(g0, 1), N.nvmlDeviceGetNvLinkState(g0, 11),
                      err(N.nvmlDeviceGetNvLinkState, g0, 12), err(N.nvmlDeviceGetNvLinkState, g0, 18),
                      err(N.nvmlDeviceGetNvLinkState, m, 0)]
        r["remote"] = [s(N.nvmlDeviceGetNvLinkRemotePciInfo(g0, 0).busId),
                       s(N.nvmlDeviceGetNvLinkRemotePciInfo(g1, 0).busId),
                       err(N.nvmlDeviceGetNvLinkRemotePciInfo, g0, 1)]
        N.nvmlShutdown()
        """,
    )
    assert r == {
        "ancestor": [10, 0, 0, 10],  # SINGLE (one switch); INTERNAL (the same GPU, or a MIG device of it)
        # Link 0 active; 1 to 11 inactive; past an A100's 12, NOT_SUPPORTED (go-gpuallocator skips it),
        # past nvml.h's NVML_NVLINK_MAX_LINKS (18), INVALID_ARGUMENT; a MIG handle: NOT_SUPPORTED.
        "state": [1, 1, 0, 0, 3, 2, 3],
        "remote": [GPU1["bus_id"], GPU0["bus_id"], 3],
    }


@pytest.mark.parametrize("junk", [
    b"x" * 254 + b"\n",  # the longest line the reader's buffer holds whole
    b"x" * 255 + b"\n",  # the buffer full, its newline beyond it
    b"x" * 300 + b"\n",
    b"GPU-" + b"y" * 5000 + b" xid 79\n",  # an event's shape, too long to be one
    b"\0" * 10 + b"\n",  # bytes no strlen counts
], ids=["254", "255", "300", "5000-event-shaped", "nul"])  # fmt: skip
def test_events_skip_a_line_that_is_no_event_and_read_on(host, nv, junk):
    """A line the reader's 256-byte buffer cannot hold stopped it for good: it read a part with no
    newline, took that for a writer's line not yet whole, and every XID after it was never seen."""
    r = pynvml(
        host,
        script(
            EVENTS,
            """
            s = N.nvmlEventSetCreate()
            N.nvmlDeviceRegisterEvents(g0, XID, s)
            with open(root + "/" + C.FILE, "ab") as f:
                f.write(bytes.fromhex(sys.argv[4]))
            C.inject_xid(root, sys.argv[3], 79)
            r["events"] = [event(s), event(s, 50)]
            half = open(root + "/" + C.FILE, "ab", buffering=0)
            half.write(b"x" * 400)  # a long line not yet whole is waited for, not skipped
            r["half"] = event(s, 50)
            half.write(b"\\n")
            half.close()
            C.inject_xid(root, sys.argv[3], 48)
            r["after"] = event(s)
            N.nvmlShutdown()
            """,
        ),
        str(host["root"]),
        GPU0["uuid"],
        junk.hex(),
    )
    nvmlevents.clear_events(str(host["root"]))
    xid, whole = 8, 0xFFFFFFFF
    assert r == {
        "events": [[GPU0["uuid"], xid, 79, whole, whole], 10],
        "half": 10,
        "after": [GPU0["uuid"], xid, 48, whole, whole],
    }
