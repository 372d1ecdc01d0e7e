"""Each simulated GPU as a PCI function: the configuration space and the resource list that sysfs
shows for it (/sys/bus/pci/devices/<bus id>/config and resource).

Pure: bytes and text from the host's description; build.py writes them. What readers do with them
decides what is here: NVIDIA's GPU feature discovery takes a GPU whose sysfs lacks `resource` for
one it cannot read, and labels the node's gpu.mode `unknown` (go-nvlib's nvpci reads it, with
vendor, device, class and numa_node); it reads `config` whole (256 bytes at least: a reader
without CAP_SYS_ADMIN gets 64) and walks its capability list for NVIDIA's vendor-specific
capability, whose "VF" signature marks a vGPU and carries the host driver's version and branch
(vgpu.present, vgpu.host-driver-version, vgpu.host-driver-branch). Layout and values follow the
PCI Local Bus Specification 3.0 (header type 0, capabilities from 0x34) and what lspci shows of
a data-centre NVIDIA GPU: BAR0 (registers, 16 MiB, 32-bit), BAR1 (memory window, 64-bit
prefetchable), BAR3 (32 MiB, 64-bit prefetchable), a 512 KiB expansion ROM; capabilities power
management (0x60), MSI (0x68), PCI Express (0x78), vendor-specific (0xb4).
"""

from __future__ import annotations

import struct

from oci_gpu_hook.toolkit.simulate.model import VGA_CONTROLLER, Gpu, SimulatedHost

# A PCI Express function's configuration space, as root reads it from sysfs.
CONFIG_SIZE = 4096
REVISION = 0xA1
BAR0_SIZE = 16 << 20
BAR3_SIZE = 32 << 20
ROM_SIZE = 512 << 10
IO_SIZE = 128  # the I/O ports a GPU in VGA mode also decodes (BAR5)

# Configuration space offsets and values.
_COMMAND_MEMORY, _COMMAND_IO, _COMMAND_MASTER, _COMMAND_NO_INTX = 0x2, 0x1, 0x4, 0x400
_STATUS_CAPABILITIES = 0x10
_BAR_MEMORY_64_PREFETCH = 0xC  # type 64-bit (0x4) | prefetchable (0x8)
_BAR_IO = 0x1
_CAP_PM, _CAP_MSI, _CAP_EXPRESS, _CAP_VENDOR = 0x01, 0x05, 0x10, 0x09
# The version 2 PCI Express capability takes 0x3c bytes: 0x78 to 0xb4.
_PM_AT, _MSI_AT, _EXPRESS_AT, _VENDOR_AT = 0x60, 0x68, 0x78, 0xB4
# NVIDIA's vendor-specific capability: 20 bytes on a physical GPU (first byte after the length
# 0x01); on a vGPU its signature "VF", then records from byte 5: record 0 is the host driver's,
# its version and branch, 10 bytes each, NUL-padded.
_VENDOR_LENGTH = 0x14
_VGPU_SIGNATURE = b"VF"
_VGPU_STRING = 10

# sysfs `resource`: one line per resource the kernel keeps for a function (six BARs, the ROM,
# six SR-IOV BARs: 13 with CONFIG_PCI_IOV, as distributions build), "start end flags".
RESOURCE_LINES = 13
_ROM_LINE = 6
# The kernel's resource flags (linux/ioport.h) with the BAR's own low bits, as it shows them.
_IORESOURCE_IO, _IORESOURCE_MEM, _IORESOURCE_PREFETCH = 0x100, 0x200, 0x2000
_IORESOURCE_READONLY, _IORESOURCE_SIZEALIGN, _IORESOURCE_MEM_64 = 0x4000, 0x40000, 0x100000
FLAGS_MEMORY_32 = _IORESOURCE_MEM | _IORESOURCE_SIZEALIGN
FLAGS_MEMORY_64_PREFETCH = (_IORESOURCE_MEM_64 | _IORESOURCE_SIZEALIGN | _IORESOURCE_PREFETCH | _IORESOURCE_MEM
                            | _BAR_MEMORY_64_PREFETCH)  # fmt: skip
FLAGS_ROM = _IORESOURCE_SIZEALIGN | _IORESOURCE_READONLY | _IORESOURCE_PREFETCH | _IORESOURCE_MEM
FLAGS_IO = _IORESOURCE_IO | _IORESOURCE_SIZEALIGN | _BAR_IO

# Where the firmware placed each GPU's windows: 32-bit ones below 4 GiB, 64-bit ones from 2 TiB,
# one naturally aligned block per GPU.
_WINDOW_32, _STRIDE_32 = 0x80000000, 0x02000000
_WINDOW_64 = 1 << 41
_IO_PORTS, _IO_STRIDE = 0x1000, 0x1000


def _block_64(size: int) -> int:
    return 1 << (size - 1).bit_length()


def resources(host: SimulatedHost, gpu: Gpu) -> list[tuple[int, int, int]]:
    """(start, end, flags) of each of the RESOURCE_LINES resources, (0, 0, 0) where unused."""
    model = gpu.model
    out = [(0, 0, 0)] * RESOURCE_LINES
    low = _WINDOW_32 + gpu.index * _STRIDE_32
    block = max(_block_64(g.model.bar1_size + BAR3_SIZE) for g in host.gpus)
    high = _WINDOW_64 + gpu.index * block
    out[0] = (low, low + BAR0_SIZE - 1, FLAGS_MEMORY_32)
    out[1] = (high, high + model.bar1_size - 1, FLAGS_MEMORY_64_PREFETCH)  # BAR1 and BAR2
    out[3] = (high + model.bar1_size, high + model.bar1_size + BAR3_SIZE - 1, FLAGS_MEMORY_64_PREFETCH)
    if gpu.pci_class == VGA_CONTROLLER:
        ports = _IO_PORTS + gpu.index * _IO_STRIDE
        out[5] = (ports, ports + IO_SIZE - 1, FLAGS_IO)
    rom = low + BAR0_SIZE
    out[_ROM_LINE] = (rom, rom + ROM_SIZE - 1, FLAGS_ROM)
    return out


def resource_text(host: SimulatedHost, gpu: Gpu) -> str:
    """sysfs `resource`: "0x%016x 0x%016x 0x%016x" a line, as the kernel prints it."""
    return "".join(f"0x{start:016x} 0x{end:016x} 0x{flags:016x}\n" for start, end, flags in resources(host, gpu))


def vendor_capability(host: SimulatedHost) -> bytes:
    """NVIDIA's vendor-specific capability, its next pointer 0 (the list's last)."""
    if host.vgpu_host_driver is None:
        return bytes([_CAP_VENDOR, 0, _VENDOR_LENGTH, 0x01]).ljust(_VENDOR_LENGTH, b"\0")
    version, branch = (part.encode("ascii").ljust(_VGPU_STRING, b"\0") for part in host.vgpu_host_driver)
    record = bytes([0, 2 + 2 * _VGPU_STRING]) + version + branch
    body = _VGPU_SIGNATURE + record
    return bytes([_CAP_VENDOR, 0, 3 + len(body)]) + body


def config_space(host: SimulatedHost, gpu: Gpu) -> bytes:
    """The function's configuration space (CONFIG_SIZE bytes, little-endian), as root reads it."""
    model = gpu.model
    space = bytearray(CONFIG_SIZE)
    bars = resources(host, gpu)
    command = _COMMAND_MEMORY | _COMMAND_MASTER | _COMMAND_NO_INTX | (_COMMAND_IO if bars[5][2] else 0)
    struct.pack_into("<HHHH", space, 0x00, model.pci_device_id & 0xFFFF, model.pci_device_id >> 16, command,
                     _STATUS_CAPABILITIES)  # fmt: skip
    struct.pack_into("<I", space, 0x08, gpu.pci_class << 8 | REVISION)
    bar1, bar3 = bars[1][0], bars[3][0]
    struct.pack_into("<IIIII", space, 0x10, bars[0][0], (bar1 & 0xFFFFFFFF) | _BAR_MEMORY_64_PREFETCH, bar1 >> 32,
                     (bar3 & 0xFFFFFFFF) | _BAR_MEMORY_64_PREFETCH, bar3 >> 32)  # fmt: skip
    if bars[5][2]:
        struct.pack_into("<I", space, 0x24, bars[5][0] | _BAR_IO)
    struct.pack_into("<HH", space, 0x2C, model.pci_subsystem_id & 0xFFFF, model.pci_subsystem_id >> 16)
    struct.pack_into("<I", space, 0x30, bars[_ROM_LINE][0])  # the ROM's address, not enabled
    space[0x34] = _PM_AT
    space[0x3C:0x3E] = bytes([0xFF, 0x01])  # no legacy interrupt line routed; pin INTA
    # Power management version 3, in D0, no soft reset on the way back from D3hot.
    space[_PM_AT : _PM_AT + 6] = bytes([_CAP_PM, _MSI_AT, 0x03, 0x00, 0x08, 0x00])
    space[_MSI_AT : _MSI_AT + 4] = bytes([_CAP_MSI, _EXPRESS_AT, 0x80, 0x00])  # 64-bit addresses
    space[_EXPRESS_AT : _EXPRESS_AT + 4] = bytes([_CAP_EXPRESS, _VENDOR_AT, 0x02, 0x00])  # version 2, endpoint
    capability = vendor_capability(host)  # after the Express capability, within the first 256 bytes
    space[_VENDOR_AT : _VENDOR_AT + len(capability)] = capability
    return bytes(space)
