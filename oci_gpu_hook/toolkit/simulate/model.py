"""The simulated host as data: which GPUs, MIG instances, device numbers and driver files it has.

Pure: `describe_host()` decides everything, `build.py` writes it to disk. The description is also
saved in the host directory (simulated-host.json) as the ground truth tests compare against.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Sequence

from oci_gpu_hook.errors import SimulateError
from oci_gpu_hook.start import driver
from oci_gpu_hook.start.digits import decimal

# re.ASCII: \d alone also matches other scripts' digits (٥٥٠), which int() reads as numbers.
DRIVER_VERSION_RE = re.compile(r"^\d{3,4}\.\d{1,3}(\.\d{1,3})?$", re.ASCII)
CUDA_VERSION_RE = re.compile(r"^(\d{1,2})\.(\d{1,2})$", re.ASCII)
MAX_GPUS = 16
# A string of NVIDIA's vGPU capability (the host driver's version or branch): 10 bytes at most.
_VGPU_STRING = re.compile(r"[A-Za-z0-9._-]{1,10}", re.ASCII)
MAX_NVLINKS = 12  # per GPU, as on an A100; each NVLink of the simulation joins two GPUs

# Stable namespace so the same options always give the same UUIDs (reproducible docs and tests).
_UUID_NAMESPACE = uuid.UUID("6f1c3c57-3bd5-4a53-9f43-0d6a3d6f7a10")

# PCI buses of an 8-GPU HGX A100 board; more GPUs continue past them.
_BUSES = (0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD)


@dataclasses.dataclass(frozen=True)
class MigProfile:
    """One GPU instance profile of the A100-SXM4-40GB, as a real one reports it: `nvidia-smi mig
    -lgip`, and for a MIG device of the profile nvmlDeviceGetAttributes and
    nvmlDeviceGetMemoryInfo (which agree: 1g.5gb has 4864 MiB, not 5 GiB) and nvidia-smi's MIG
    table (SM, CE ENC DEC OFA JPG)."""

    name: str
    id: int  # NVML_GPU_INSTANCE_PROFILE_* value nvidia-smi shows
    slices: int
    instances: int  # how many fit on one GPU
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpegs: int
    ofas: int
    memory_mib: int
    placement_size: int  # memory slices (eight on an A100)


# In NVML_GPU_INSTANCE_PROFILE_<n>_SLICE order, which the simulated NVML indexes by.
MIG_PROFILES = (
    MigProfile("1g.5gb", 19, 1, 7, 14, 1, 0, 0, 0, 0, 4864, 1),
    MigProfile("2g.10gb", 14, 2, 3, 28, 2, 1, 0, 0, 0, 9984, 2),
    MigProfile("3g.20gb", 9, 3, 2, 42, 3, 2, 0, 0, 0, 20096, 4),
    MigProfile("4g.20gb", 5, 4, 1, 56, 4, 2, 0, 0, 0, 20096, 4),
    MigProfile("7g.40gb", 0, 7, 1, 98, 7, 5, 0, 1, 1, 40192, 8),
)
MIG_PROFILE = {p.name: p for p in MIG_PROFILES}

# A100-SXM4-40GB MIG layout used for every --mig GPU: GPU instance id, profile.
_MIG_LAYOUT = ((1, "3g.20gb"), (5, "2g.10gb"), (13, "1g.5gb"))


@dataclasses.dataclass(frozen=True)
class GpuModel:
    name: str
    brand: str
    compute_capability: tuple[int, int]
    memory_total: int
    pci_device_id: int
    pci_subsystem_id: int
    # The size of BAR1, the window onto the GPU's memory (lspci's "Region 1"); BAR0 (registers,
    # 16 MiB) and BAR3 (32 MiB) are alike on every model here (pci.py).
    bar1_size: int
    # HBM memory (stacked on the package, with its own temperature sensor: NVML's memory
    # temperature field answers only on such parts), not GDDR on the board.
    hbm: bool
    # The PCI class sysfs shows: 0x030200, a 3D controller (every data-centre GPU simulated here),
    # or 0x030000, a VGA controller (a GPU in display mode). GFD's gpu.mode reads it.
    pci_class: int = 0x030200


# The PCI class of a GPU in display (graphics) mode, as NVIDIA's displaymodeselector leaves an A40
# or an L40 switched to it: a VGA controller.
VGA_CONTROLLER = 0x030000

MODELS = {
    "a100": GpuModel("NVIDIA A100-SXM4-40GB", "Tesla", (8, 0), 40 << 30, 0x20B010DE, 0x134F10DE, 64 << 30, True),
    "h100": GpuModel("NVIDIA H100 80GB HBM3", "Nvidia", (9, 0), 80 << 30, 0x233010DE, 0x16C110DE, 128 << 30, True),
    "l4": GpuModel("NVIDIA L4", "Nvidia", (8, 9), 24 << 30, 0x27B810DE, 0x16CA10DE, 32 << 30, False),
    "t4": GpuModel("Tesla T4", "Tesla", (7, 5), 15 << 30, 0x1EB810DE, 0x12A210DE, 256 << 20, False),
}


@dataclasses.dataclass(frozen=True)
class MigInstance:
    index: int  # position among its GPU's MIG devices (the "1" of NVIDIA_VISIBLE_DEVICES=0:1)
    gi: int
    ci: int
    profile: str
    uuid: str
    memory_total: int
    gi_cap_minor: int
    ci_cap_minor: int


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int  # NVML index: PCI bus order
    minor: int  # /dev/nvidia<minor>: assigned at boot, not necessarily the index
    uuid: str
    bus_id: str  # procfs form, 0000:07:00.0
    model: GpuModel
    mig: tuple[MigInstance, ...]
    # Topology (what NVML's common-ancestor and NVLink queries and sysfs report): the PCIe switch
    # the GPU sits under, its NUMA node, and the NVML indices of the GPUs it has an NVLink to.
    pcie_switch: int = 0
    numa_node: int = 0
    nvlink_peers: tuple[int, ...] = ()
    # The PCI class sysfs shows for this GPU: its model's, or VGA_CONTROLLER in display mode.
    pci_class: int = 0x030200


@dataclasses.dataclass(frozen=True)
class Library:
    prefix: str  # libcuda.so
    soname: str  # libcuda.so.1
    capability: str
    lib32: bool  # the driver also ships an i386 build


@dataclasses.dataclass(frozen=True)
class SimulatedHost:
    root: str
    driver_version: str
    cuda_version: str
    gpus: tuple[Gpu, ...]
    uvm_major: int
    caps_major: int
    libraries: tuple[Library, ...]
    # DMI's product name (/sys/class/dmi/id/product_name): GFD's gpu.machine. An HPE server that
    # holds an 8-GPU HGX A100 board.
    machine: str = "ProLiant XL675d Gen10 Plus"
    # IMEX: /proc/devices' nvidia-caps-imex-channels major (0: none) and the channels whose nodes
    # exist (/dev/nvidia-caps-imex-channels/channel<n>, as `nvidia-modprobe -i <n>` makes them).
    imex_major: int = 0
    imex_channels: tuple[int, ...] = (0, 1)
    # A vGPU guest: the host's vGPU manager's driver version and branch, which each GPU's PCI
    # configuration space carries in NVIDIA's vGPU capability (pci.py); None on bare metal.
    vgpu_host_driver: tuple[str, str] | None = None

    @property
    def cuda_version_int(self) -> int:
        major, minor = self.cuda_version.split(".")
        return int(major) * 1000 + int(minor) * 10

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# The libraries driver 550 ships (NVIDIA's 550.163.01, name for name: a test compares them with
# the real files when ../shared/tools/nvidia-driver has fetched them) and their SONAMEs; "V" stands
# for the driver version. Whether an i386 build exists follows the .run installer's 32-bit compat
# set (not compared: Debian's amd64 packages carry no i386 files).
_SONAMES = {
    "libnvidia-ml.so": ("libnvidia-ml.so.1", True),
    "libnvidia-cfg.so": ("libnvidia-cfg.so.1", False),
    "libcuda.so": ("libcuda.so.1", True),
    "libcudadebugger.so": ("libcudadebugger.so.1", False),
    "libnvidia-opencl.so": ("libnvidia-opencl.so.1", True),
    "libnvidia-gpucomp.so": ("libnvidia-gpucomp.so.V", True),
    "libnvidia-ptxjitcompiler.so": ("libnvidia-ptxjitcompiler.so.1", True),
    "libnvidia-allocator.so": ("libnvidia-allocator.so.1", True),
    "libnvidia-pkcs11-openssl3.so": ("libnvidia-pkcs11-openssl3.so.V", False),
    "libnvidia-nvvm.so": ("libnvidia-nvvm.so.4", True),
    "libvdpau_nvidia.so": ("libvdpau_nvidia.so.1", True),
    "libnvidia-encode.so": ("libnvidia-encode.so.1", True),
    "libnvidia-opticalflow.so": ("libnvidia-opticalflow.so.1", True),
    "libnvcuvid.so": ("libnvcuvid.so.1", True),
    "libnvidia-eglcore.so": ("libnvidia-eglcore.so.V", True),
    "libnvidia-glcore.so": ("libnvidia-glcore.so.V", True),
    "libnvidia-tls.so": ("libnvidia-tls.so.V", True),
    "libnvidia-glsi.so": ("libnvidia-glsi.so.V", True),
    "libnvidia-fbc.so": ("libnvidia-fbc.so.1", True),
    "libnvidia-rtcore.so": ("libnvidia-rtcore.so.V", False),
    "libnvoptix.so": ("libnvoptix.so.1", False),
    "libGLX_nvidia.so": ("libGLX_nvidia.so.0", True),
    "libEGL_nvidia.so": ("libEGL_nvidia.so.0", True),
    "libGLESv2_nvidia.so": ("libGLESv2_nvidia.so.2", True),
    "libGLESv1_CM_nvidia.so": ("libGLESv1_CM_nvidia.so.1", True),
    "libnvidia-glvkspirv.so": ("libnvidia-glvkspirv.so.V", True),
    "libnvidia-ngx.so": ("libnvidia-ngx.so.1", False),
}
# Driver libraries 550 ships that no capability lists (NVAPI, for Wine and Proton): built, and
# not mounted, as on a real host. Their file is the SONAME itself.
UNVERSIONED_LIBRARIES = ("libnvidia-api.so.1",)
# What each library NEEDs of the others, as 550.163.01's ELF files say (readelf -d); the system
# libraries they also need (libc, libX11, ...) are left out: the stubs need only libc.
NEEDS = {
    "libnvidia-eglcore.so": ("libnvidia-glsi.so", "libnvidia-gpucomp.so"),
    "libnvidia-glcore.so": ("libnvidia-tls.so", "libnvidia-gpucomp.so"),
    "libEGL_nvidia.so": ("libnvidia-glsi.so",),
    "libGLX_nvidia.so": ("libnvidia-glsi.so", "libnvidia-tls.so", "libnvidia-glcore.so"),
    "libnvidia-encode.so": ("libnvcuvid.so",),
    "libnvidia-opticalflow.so": ("libnvcuvid.so",),
}


def driver_libraries(driver_version: str) -> tuple[Library, ...]:
    capability = {prefix: cap for cap, prefixes in driver.LIBRARIES.items() for prefix in prefixes}
    return tuple(
        Library(prefix, soname.replace(".V", "." + driver_version), capability[prefix], lib32)
        for prefix, (soname, lib32) in _SONAMES.items()
    )


def _uuid(kind: str, *key) -> str:
    return kind + "-" + str(uuid.uuid5(_UUID_NAMESPACE, "/".join(str(k) for k in key)))


def _free_majors(used: Sequence[int], count: int) -> list[int]:
    # The kernel hands out dynamic char majors from 511 downwards; pick ones that no driver on
    # this machine owns, so opening a simulated node reaches no real driver (ENXIO, not I/O).
    free = [m for m in range(511, 383, -1) if m not in set(used)]
    if len(free) < count:
        raise SimulateError(
            "no free character device major numbers for nvidia-uvm, nvidia-caps and nvidia-caps-imex-channels"
        )
    return free[:count]


def describe_host(
    root: str,
    gpus: int = 2,
    driver_version: str = "550.54.15",
    cuda_version: str = "12.4",
    mig: Sequence[int] = (),
    model: str = "a100",
    scramble_minors: bool = False,
    used_majors: Sequence[int] = (),
    pcie_switches: str | None = None,
    nvlinks: str = "",
    numa_nodes: str | None = None,
    graphics: Sequence[int] = (),
    vgpu_host_driver: tuple[str, str] | None = None,
) -> SimulatedHost:
    """Decide every fact of a simulated host; raises SimulateError on bad options. The topology
    options are text, as typed on the command line (parse_topology). graphics: the GPUs in display
    mode (a VGA controller's PCI class); vgpu_host_driver: (version, branch) of the vGPU host's
    driver, for a vGPU guest."""
    if not 1 <= gpus <= MAX_GPUS:
        raise SimulateError(f"--gpus {gpus}: the simulated host holds 1 to {MAX_GPUS} GPUs")
    if not DRIVER_VERSION_RE.match(driver_version):
        raise SimulateError(f"--driver-version {driver_version!r}: expected a version like 550.54.15")
    if not CUDA_VERSION_RE.match(cuda_version):
        raise SimulateError(f"--cuda-version {cuda_version!r}: expected MAJOR.MINOR like 12.4")
    if model not in MODELS:
        raise SimulateError(f"--model {model!r}: expected one of {', '.join(sorted(MODELS))}")
    for option, indices in (("--mig", mig), ("--graphics", graphics)):
        for index in indices:
            if not 0 <= index < gpus:
                raise SimulateError(f"{option} {index}: no such GPU (the host has GPUs 0 to {gpus - 1})")
    if vgpu_host_driver is not None:
        vgpu_host_driver = tuple(vgpu_host_driver)
        if len(vgpu_host_driver) != 2 or not all(
            isinstance(part, str) and _VGPU_STRING.fullmatch(part) for part in vgpu_host_driver
        ):
            given = ",".join(str(part) for part in vgpu_host_driver)
            raise SimulateError(f"--vgpu {given!r}: expected VERSION,BRANCH of the vGPU host's driver, such as "
                                "550.54.16,r551_40 (each 1 to 10 of A-Z a-z 0-9 . _ -)")  # fmt: skip
    gpu_model = MODELS[model]
    switches, numa, peers = parse_topology(gpus, pcie_switches, nvlinks, numa_nodes)
    # Minors are handed out at boot; a real host had /dev/nvidia0 at NVML index 3. Reversing
    # them lets tests catch code that confuses the NVML index with the device minor.
    minors = list(reversed(range(gpus))) if scramble_minors else list(range(gpus))
    gpu_list = []
    for index in range(gpus):
        bus = _BUSES[index] if index < len(_BUSES) else 0xC0 + index
        minor = minors[index]
        instances = ()
        if index in mig:
            instances = tuple(
                MigInstance(
                    index=i,
                    gi=gi,
                    ci=0,
                    profile=profile,
                    uuid=_uuid("MIG", driver_version, index, gi, 0),
                    memory_total=MIG_PROFILE[profile].memory_mib << 20,
                    gi_cap_minor=driver.mig_gi_cap_minor(minor, gi),
                    ci_cap_minor=driver.mig_ci_cap_minor(minor, gi, 0),
                )
                for i, (gi, profile) in enumerate(_MIG_LAYOUT)
            )
        gpu_list.append(
            Gpu(
                index=index,
                minor=minor,
                uuid=_uuid("GPU", driver_version, index),
                bus_id=f"0000:{bus:02x}:00.0",
                model=gpu_model,
                mig=instances,
                pcie_switch=switches[index],
                numa_node=numa[index],
                nvlink_peers=peers[index],
                pci_class=VGA_CONTROLLER if index in graphics else gpu_model.pci_class,
            )
        )
    uvm_major, caps_major, imex_major = _free_majors(list(used_majors) + [driver.NVIDIA_MAJOR], 3)
    return SimulatedHost(
        root=root,
        driver_version=driver_version,
        cuda_version=cuda_version,
        gpus=tuple(gpu_list),
        uvm_major=uvm_major,
        caps_major=caps_major,
        libraries=driver_libraries(driver_version),
        imex_major=imex_major,
        vgpu_host_driver=vgpu_host_driver,
    )


def nvml_bus_id(bus_id: str) -> str:
    """procfs 0000:07:00.0 -> NVML 00000000:07:00.0 (8-digit domain, upper-case hex)."""
    domain, rest = bus_id.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


# --- topology -----------------------------------------------------------------------------------


def _indices(text: str, gpus: int, option: str) -> list[int]:
    """GPU indices joined by +: "0+2"."""
    out = []
    for part in text.split("+"):
        part = part.strip()
        index = decimal(part)
        if index is None or index >= gpus:
            raise SimulateError(f"{option} {text!r}: {part!r} is not a GPU index (the host has GPUs 0 to {gpus - 1})")
        if index in out:
            raise SimulateError(f"{option} {text!r}: GPU {part} is listed twice")
        out.append(index)
    return out


def parse_topology(gpus: int, pcie_switches: str | None, nvlinks: str, numa_nodes: str | None):
    """(switch per GPU, NUMA node per GPU, NVLink peers per GPU) from the options' text.

    pcie_switches: groups of GPUs that share a PCIe switch, "0+2,1+3"; a GPU in no group has a
    switch of its own. Default: pairs in bus order (0+1, 2+3, ...), as on an HGX board.
    nvlinks: GPU pairs joined by NVLink, "0+1,2+3" (default: none).
    numa_nodes: one node per GPU, "0,0,1,1". Default: each switch's GPUs on the node of the
    switch, the first half of the switches on node 0 and the rest on node 1."""
    if pcie_switches is None:
        groups = [list(range(i, min(i + 2, gpus))) for i in range(0, gpus, 2)]
    else:
        groups = [_indices(g, gpus, "--pcie-switches") for g in pcie_switches.split(",") if g.strip()]
    switch: dict[int, int] = {}
    for number, group in enumerate(groups):
        for index in group:
            if index in switch:
                raise SimulateError(f"--pcie-switches {pcie_switches!r}: GPU {index} is under two switches")
            switch[index] = number
    for index in range(gpus):
        if index not in switch:
            switch[index] = len(groups)
            groups.append([index])
    if numa_nodes is None:
        numa = [0 if switch[i] < (len(groups) + 1) // 2 or len(groups) == 1 else 1 for i in range(gpus)]
    else:
        numa = [decimal(p.strip()) for p in numa_nodes.split(",")]
        if len(numa) != gpus or not all(node is not None and node < 64 for node in numa):
            raise SimulateError(f"--numa-nodes {numa_nodes!r}: expected {gpus} node numbers (0-63), one per GPU")
    peers: list[list[int]] = [[] for _ in range(gpus)]
    for pair in (p for p in nvlinks.split(",") if p.strip()):
        ends = _indices(pair, gpus, "--nvlink")
        if len(ends) != 2:
            raise SimulateError(f"--nvlink {pair!r}: an NVLink joins two GPUs: A+B")
        a, b = ends
        if b not in peers[a]:
            peers[a].append(b)
            peers[b].append(a)
        if max(len(peers[a]), len(peers[b])) > MAX_NVLINKS:
            raise SimulateError(f"--nvlink: a GPU has at most {MAX_NVLINKS} NVLinks (an A100 has 12)")
    return [switch[i] for i in range(gpus)], numa, [tuple(p) for p in peers]
