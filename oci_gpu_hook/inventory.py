"""What the host offers: the driver, its GPUs and their device nodes.

Read from procfs and the device nodes under the configured roots (cheap and always there on a
loaded driver); NVML is consulted only for what procfs lacks.
"""

import dataclasses
import os
from typing import Tuple

from . import procfs
from .errors import InventoryError
from .settings import Settings


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    index: int  # NVML index = PCI bus order
    minor: int  # /dev/nvidia<minor>
    uuid: str
    bus_id: str  # 0000:07:00.0
    model: str


@dataclasses.dataclass(frozen=True)
class Inventory:
    driver_version: str
    gpus: Tuple[GpuInfo, ...]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def host_path(root: str, path: str) -> str:
    """A host path under one of the configured roots ('/' means the real host)."""
    return os.path.join(root, path.lstrip("/"))


def _read(path: str, limit: int = 1 << 20) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError as e:
        raise InventoryError(f"{path}: {e.strerror}") from None


def _bus_order(bus_id: str) -> Tuple[int, ...]:
    domain, bus, rest = bus_id.split(":")
    device, function = rest.split(".")
    return (int(domain, 16), int(bus, 16), int(device, 16), int(function, 16))


def read_driver_version(settings: Settings) -> str:
    path = host_path(settings.proc_root, "/proc/driver/nvidia/version")
    if not os.path.exists(path):
        raise InventoryError(f"{path}: not found: the NVIDIA kernel driver is not loaded")
    return procfs.parse_driver_version(_read(path), path)


def read_gpus(settings: Settings) -> Tuple[GpuInfo, ...]:
    gpus_dir = host_path(settings.proc_root, "/proc/driver/nvidia/gpus")
    try:
        entries = sorted(os.listdir(gpus_dir))
    except FileNotFoundError:
        return ()
    except OSError as e:
        raise InventoryError(f"{gpus_dir}: {e.strerror}") from None
    found = []
    for entry in entries:
        path = os.path.join(gpus_dir, entry, "information")
        info = procfs.parse_gpu_information(_read(path), path)
        if info["minor"] is None:
            raise InventoryError(f"{path}: no 'Device Minor' line (driver too old for procfs-only discovery)")
        found.append(info)
    found.sort(key=lambda info: _bus_order(info["bus_id"]))
    return tuple(
        GpuInfo(index=i, minor=info["minor"], uuid=info["uuid"], bus_id=info["bus_id"], model=info["model"])
        for i, info in enumerate(found)
    )


def discover(settings: Settings) -> Inventory:
    return Inventory(driver_version=read_driver_version(settings), gpus=read_gpus(settings))
