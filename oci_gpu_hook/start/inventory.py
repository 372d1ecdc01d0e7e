"""What the host offers: driver, GPUs, MIG instances, device nodes, driver files.

The model only: plain, serialisable records that the plan reads. discover.py fills them from
the host; the hook reads them from the cache (inventory_cache.py) instead of discovering on
every start.
"""

from __future__ import annotations

import os

from oci_gpu_hook.frozen import Frozen


class DeviceNode(Frozen):
    __slots__ = ("path", "major", "minor", "problem")
    _defaults = {"problem": None}
    path: str  # path under dev_root, the same inside the container: /dev/nvidia0
    major: int
    minor: int
    problem: str | None  # why the node cannot be trusted (missing, wrong type or numbers)


class MigDevice(Frozen):
    __slots__ = ("index", "gi", "ci", "uuid", "gi_cap", "ci_cap", "gi_access", "ci_access", "profile", "memory_total",
                 "attributes")  # fmt: skip
    _defaults = {"profile": None, "memory_total": None, "attributes": None}
    index: int  # among its GPU's MIG devices, NVML order: the "1" of "0:1"
    gi: int
    ci: int
    uuid: str | None  # None when NVML was not available
    gi_cap: DeviceNode
    ci_cap: DeviceNode
    gi_access: str  # procfs path (under proc_root) of the GPU instance's access file
    ci_access: str
    profile: str | None  # 1g.5gb; None when NVML was not available
    memory_total: int | None  # bytes
    # NVML's attributes of the MIG device (nvmlDeviceGetAttributes), under GFD's label names:
    # multiprocessors, engines.copy, engines.decoder, engines.encoder, engines.jpeg, engines.ofa.
    # None when NVML was not available.
    attributes: dict | None


class GpuInfo(Frozen):
    __slots__ = (
        "index",
        "minor",
        "uuid",
        "bus_id",
        "model",
        "node",
        "brand",
        "compute_capability",
        "memory_total",
        "mig",
        "dri",
    )
    _defaults = {"brand": None, "compute_capability": None, "memory_total": None, "mig": (), "dri": ()}
    index: int  # NVML index: PCI bus order
    minor: int  # /dev/nvidia<minor>
    uuid: str
    bus_id: str  # 0000:07:00.0
    model: str
    node: DeviceNode
    brand: str | None
    compute_capability: str | None
    memory_total: int | None
    mig: tuple[MigDevice, ...]
    dri: tuple[DeviceNode, ...]  # its DRM card and render nodes (/dev/dri/card1, renderD128), if any


class DriverFile(Frozen):
    __slots__ = ("capability", "kind", "path", "soname", "needs", "target")
    _defaults = {"soname": None, "needs": (), "target": None}
    capability: str  # or DEPENDENCY: a driver library only another one needs
    kind: str  # library, library32, binary, firmware, ipc, config
    path: str  # host path under driver_root, every link resolved: /usr/lib64/libcuda.so.550.54.15
    soname: str | None  # libraries: the SONAME link name, libcuda.so.1
    needs: tuple  # libraries: the driver libraries it NEEDs (ELF DT_NEEDED), by SONAME
    target: str | None  # config files reached through a link: the path it goes to in the container


# The capability of a driver library that no capability lists but that a listed one NEEDs: it
# reaches a container only with a library that needs it.
DEPENDENCY = "dependency"


class Inventory(Frozen):
    __slots__ = (
        "driver_version",
        "cuda_version",
        "nvml",
        "driver_root",
        "dev_root",
        "proc_root",
        "majors",
        "gpus",
        "control_devices",
        "mig_caps",
        "files",
        "nvml_error",
        "imex_channels",
    )
    _defaults = {"nvml_error": None, "imex_channels": {}}
    driver_version: str
    cuda_version: str | None
    nvml: bool  # whether NVML answered (brand, arch, memory and MIG UUIDs are known)
    driver_root: str
    dev_root: str
    proc_root: str
    majors: dict[str, int]
    gpus: tuple[GpuInfo, ...]
    control_devices: dict[str, DeviceNode]  # nvidiactl, nvidia-modeset, nvidia-uvm, nvidia-uvm-tools
    mig_caps: dict[str, DeviceNode]  # config, monitor
    files: tuple[DriverFile, ...]
    nvml_error: str | None  # why NVML did not answer, when it was asked and failed
    imex_channels: dict[str, DeviceNode]  # "<n>": /dev/nvidia-caps-imex-channels/channel<n>, those present

    @classmethod
    def from_json(cls, data: dict) -> Inventory:
        def node(d):
            return DeviceNode(**d)

        def mig(d):
            return MigDevice(**dict(d, gi_cap=node(d["gi_cap"]), ci_cap=node(d["ci_cap"])))

        def gpu(d):
            return GpuInfo(**dict(d, node=node(d["node"]), mig=tuple(mig(m) for m in d["mig"]),
                                  dri=tuple(node(n) for n in d.get("dri", ()))))  # fmt: skip

        return cls(
            **dict(
                data,
                gpus=tuple(gpu(g) for g in data["gpus"]),
                control_devices={k: node(v) for k, v in data["control_devices"].items()},
                mig_caps={k: node(v) for k, v in data["mig_caps"].items()},
                imex_channels={k: node(v) for k, v in data.get("imex_channels", {}).items()},
                files=tuple(DriverFile(**dict(f, needs=tuple(f.get("needs", ())))) for f in data["files"]),
            )
        )

    def files_for(self, capabilities, kinds=None) -> tuple[DriverFile, ...]:
        return tuple(f for f in self.files if f.capability in capabilities and (kinds is None or f.kind in kinds))


def device_key(gpu: GpuInfo, mig: MigDevice | None = None) -> str:
    """The key a GPU or MIG device goes by in memory limits and health: its UUID, or for a MIG
    device NVML did not name, <gpu uuid>/gi<n>."""
    if mig is None:
        return gpu.uuid
    return mig.uuid or f"{gpu.uuid}/gi{mig.gi}"


def normalize_bus_id(value: str) -> str | None:
    """A PCI bus id in the form the inventory keeps (procfs's: 0000:07:00.0, lower case, 4-digit
    domain) from any accepted spelling ([domain:]bus:device.function, any domain width); None if
    it is not one. The one normalisation: discovery and device selection both use it."""
    parts = value.lower().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3:
        return None
    device, dot, function = parts[2].partition(".")
    fields = (parts[0], parts[1], device, function)
    # Each field with or without its leading zeros (0:7:0.0 is 0000:07:00.0), as NVIDIA reads them.
    if not dot or not all(0 < len(f) <= n and f.strip("0123456789abcdef") == "" for f, n in zip(fields, (8, 2, 2, 1))):
        return None
    domain, bus, device_number, function_number = (int(f, 16) for f in fields)
    if function_number > 7:
        return None
    return f"{domain:04x}:{bus:02x}:{device_number:02x}.{function_number}"


def host_path(root: str, path: str) -> str:
    """A host path under one of the configured roots ('/' means the real host)."""
    return os.path.join(root, path.lstrip("/"))
