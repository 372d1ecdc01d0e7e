"""Parsers for the files the NVIDIA kernel driver publishes under /proc.

Pure functions over text: each returns plain data or raises InventoryError naming the file and
what was wrong, never anything else, whatever the input (tests fuzz them).
"""

from __future__ import annotations

import re

from oci_gpu_hook.errors import InventoryError
from oci_gpu_hook.start.digits import is_decimal
from oci_gpu_hook.start.inventory import normalize_bus_id

# Both banner variants seen on real hosts: "Kernel Module  570.86.15  Wed Jan ..." and
# "Open Kernel Module for x86_64  575.57.08  Release Build ...". re.ASCII: \d alone also matches
# other scripts' digits (٥٧٥), which no driver writes.
_VERSION_RE = re.compile(r"^NVRM version:.*?Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)(?:\s|$)", re.ASCII)
_BUS_ID_RE = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def parse_driver_version(text: str, path: str = "/proc/driver/nvidia/version") -> str:
    for line in text.splitlines():
        match = _VERSION_RE.match(line)
        if match:
            return match.group(1)
    raise InventoryError(f"{path}: no 'NVRM version' line with a driver version")


def parse_key_values(text: str) -> dict[str, str]:
    """'Key:   value' lines, as in gpus/<bus id>/information and params."""
    values = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            values[key.strip()] = value.strip()
    return values


def parse_gpu_information(text: str, path: str) -> dict[str, object]:
    """GPU facts from gpus/<bus id>/information; Device Minor is absent on older drivers (None)."""
    values = parse_key_values(text)
    uuid = values.get("GPU UUID", "")
    bus_id = values.get("Bus Location", "")
    if not uuid.startswith("GPU-"):
        raise InventoryError(f"{path}: no valid 'GPU UUID' line")
    if not _BUS_ID_RE.match(bus_id):
        raise InventoryError(f"{path}: no valid 'Bus Location' line")
    minor = values.get("Device Minor")
    if minor is not None and not (is_decimal(minor) and int(minor) < 255):
        raise InventoryError(f"{path}: 'Device Minor' is {minor!r}, expected a number below 255")
    return {
        "model": values.get("Model", "Unknown"),
        "uuid": uuid,
        "bus_id": normalize_bus_id(bus_id),
        "minor": int(minor) if minor is not None else None,
    }


def parse_char_devices(text: str) -> list[tuple[int, str]]:
    """(major, name) for each character device driver /proc/devices lists, in its order."""
    devices = []
    for line in text.split("Block devices:")[0].splitlines():
        fields = line.split()
        if len(fields) == 2 and is_decimal(fields[0]):
            devices.append((int(fields[0]), fields[1]))
    return devices


def parse_proc_devices(text: str) -> dict[str, int]:
    """Character device names -> majors (the first, should a name appear twice), from /proc/devices."""
    majors = {}
    for major, name in parse_char_devices(text):
        majors.setdefault(name, major)
    return majors


def parse_cap_minor(text: str, path: str) -> int:
    """DeviceFileMinor of a capabilities/.../access file: the /dev/nvidia-caps/nvidia-cap<N> minor."""
    minor = parse_key_values(text).get("DeviceFileMinor", "")
    if not is_decimal(minor):
        raise InventoryError(f"{path}: no valid 'DeviceFileMinor' line")
    return int(minor)
