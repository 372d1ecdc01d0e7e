"""Each simulated GPU's PCI configuration space and resource list, read back here by the PCI Local
Bus Specification's layout (not by the simulator's or the labels' code)."""

import struct

import pytest

from oci_gpu_hook.toolkit.simulate import pci
from oci_gpu_hook.toolkit.simulate.model import MODELS, describe_host

HOSTS = {
    "a100": describe_host("/s", gpus=2),
    "t4 in display mode": describe_host("/s", gpus=2, model="t4", graphics=[0, 1]),
    "h100 vGPU guest": describe_host("/s", gpus=3, model="h100", vgpu_host_driver=("550.54.16", "r551_40")),
}


def capabilities(space: bytes) -> list[tuple[int, int, bytes]]:
    """(offset, id, the capability's bytes from its id) along the list from the pointer at 0x34,
    each entry's length its third byte where the capability has one (vendor-specific)."""
    found, at = [], space[0x34]
    while at:
        assert at not in [offset for offset, _, _ in found] and 0x40 <= at < 0x100, "a list that loops or strays"
        found.append((at, space[at], space[at : at + (space[at + 2] if space[at] == 0x09 else 2)]))
        at = space[at + 1]
    return found


@pytest.mark.parametrize("case", HOSTS)
def test_the_configuration_space_is_a_gpus_as_the_specification_lays_it_out(case):
    host = HOSTS[case]
    for gpu in host.gpus:
        space = pci.config_space(host, gpu)
        assert len(space) == 4096  # a PCI Express function's, as root reads it
        vendor, device, command, status = struct.unpack_from("<HHHH", space, 0)
        assert (vendor, device) == (0x10DE, gpu.model.pci_device_id >> 16)
        assert command & 0x6 == 0x6 and status & 0x10  # memory space and bus master on; a capability list
        assert space[0x0B] << 16 | space[0x0A] << 8 | space[0x09] == gpu.pci_class and space[0x08] == pci.REVISION
        assert space[0x0E] == 0  # header type 0: an endpoint
        assert struct.unpack_from("<HH", space, 0x2C) == (0x10DE, gpu.model.pci_subsystem_id >> 16)
        ids = [cap_id for _, cap_id, _ in capabilities(space)]
        assert ids == [0x01, 0x05, 0x10, 0x09]  # power management, MSI, PCI Express, vendor-specific
        (vendor_specific,) = [body for _, cap_id, body in capabilities(space) if cap_id == 0x09]
        if host.vgpu_host_driver is None:
            assert len(vendor_specific) == 0x14 and vendor_specific[3:5] != b"VF"
        else:  # "VF", then record 0: the host driver's version and branch, 10 bytes each
            assert vendor_specific[3:5] == b"VF" and vendor_specific[5] == 0 and vendor_specific[6] == 22
            version, branch = vendor_specific[7:17], vendor_specific[17:27]
            assert (version.rstrip(b"\0").decode(), branch.rstrip(b"\0").decode()) == host.vgpu_host_driver
            assert len(vendor_specific) == 27


@pytest.mark.parametrize("case", HOSTS)
def test_the_resource_list_is_the_kernels_and_matches_the_bars(case):
    """sysfs `resource`: 13 lines "0x%016x 0x%016x 0x%016x" (go-nvlib's nvpci refuses a line of
    another number of fields); BAR0 16 MiB, BAR1 the model's window, BAR3 32 MiB, the ROM; where
    each starts is what the configuration space's BARs say; no two GPUs' windows overlap."""
    host = HOSTS[case]
    taken = []
    for gpu in host.gpus:
        text = pci.resource_text(host, gpu)
        lines = text.splitlines()
        assert text.endswith("\n") and len(lines) == 13
        assert all(len(line.split(" ")) == 3 and all(len(f) == 18 and f.startswith("0x") for f in line.split(" "))
                   for line in lines)  # fmt: skip
        spans = [tuple(int(f, 16) for f in line.split(" ")) for line in lines]
        sizes = {i: end - start + 1 for i, (start, end, flags) in enumerate(spans) if flags}
        io = {5: pci.IO_SIZE} if gpu.pci_class == 0x030000 else {}
        assert sizes == {0: 16 << 20, 1: gpu.model.bar1_size, 3: 32 << 20, **io, 6: 512 << 10}
        space = pci.config_space(host, gpu)
        bars = struct.unpack_from("<6I", space, 0x10)
        assert spans[0][0] == bars[0] and bars[0] & 0xF == 0  # 32-bit memory
        assert spans[1][0] == (bars[1] & ~0xF | bars[2] << 32) and bars[1] & 0xF == 0xC  # 64-bit, prefetchable
        assert spans[3][0] == (bars[3] & ~0xF | bars[4] << 32) and bars[3] & 0xF == 0xC
        assert spans[6][0] == struct.unpack_from("<I", space, 0x30)[0]
        if io:
            assert bars[5] == spans[5][0] | 1 and struct.unpack_from("<H", space, 4)[0] & 0x1  # I/O space on
        for start, end, flags in spans:
            if flags:
                assert start % (end - start + 1) == 0  # naturally aligned
                assert all(end < s or start > e for s, e in taken)
                taken.append((start, end))


def test_every_model_has_a_memory_window():
    assert all(m.bar1_size >= 256 << 20 and m.bar1_size & (m.bar1_size - 1) == 0 for m in MODELS.values())
