import pytest
from hypothesis import given
from hypothesis import strategies as st

from oci_gpu_hook.errors import InventoryError
from oci_gpu_hook.start import procfs

INFORMATION = """Model:           NVIDIA A100-SXM4-40GB
IRQ:             44
GPU UUID:        GPU-e3f822b9-8c5f-95a5-b379-8dfdeefd7758
Video BIOS:      92.00.25.00.08
Bus Type:        PCIe
DMA Size:        47 bits
DMA Mask:        0x7fffffffffff
Bus Location:    0000:04:00.0
Device Minor:    3
GPU Excluded:    No
"""


@pytest.mark.parametrize(
    "line, version",
    [
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Wed Jan 22 2025", "570.86.15"),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  575.57.08  Release Build  (b@h)  Tue May 20 2025",
            "575.57.08",
        ),
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.82  Thu Oct 28 2021", "470.82"),
    ],
)
def test_driver_version_both_banners(line, version):
    assert procfs.parse_driver_version(line + "\nGCC version:  gcc version 12.2.0\n") == version


def test_driver_version_missing():
    with pytest.raises(InventoryError, match="no 'NVRM version' line"):
        procfs.parse_driver_version("GCC version: 12\n")


def test_a_driver_version_in_other_digits_is_no_version():
    """\\d alone took Arabic-Indic 550.54.15 as a version, which the library names then carried."""
    line = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  \u0665\u0665\u0660.\u0665\u0664.15  Thu Feb 22 2024"
    with pytest.raises(InventoryError, match="no 'NVRM version' line"):
        procfs.parse_driver_version(line)


def test_gpu_information():
    info = procfs.parse_gpu_information(INFORMATION, "info")
    assert info == {
        "model": "NVIDIA A100-SXM4-40GB",
        "uuid": "GPU-e3f822b9-8c5f-95a5-b379-8dfdeefd7758",
        "bus_id": "0000:04:00.0",
        "minor": 3,
    }


def test_gpu_information_old_driver_has_no_minor():
    text = INFORMATION.replace("Device Minor:    3\n", "")
    assert procfs.parse_gpu_information(text, "info")["minor"] is None


@pytest.mark.parametrize("bad", ["GPU UUID:        nope\n", "Bus Location:    zz\n", "Device Minor:    x\n"])
def test_gpu_information_rejects_bad_lines(bad):
    key = bad.split(":")[0]
    text = "\n".join(line for line in INFORMATION.splitlines() if not line.startswith(key)) + "\n" + bad
    with pytest.raises(InventoryError):
        procfs.parse_gpu_information(text, "info")


def test_bus_id_normalized_to_procfs_form():
    from oci_gpu_hook.start.inventory import normalize_bus_id

    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("3B:00.0") == "0000:3b:00.0"  # the short form NVIDIA_VISIBLE_DEVICES accepts
    assert normalize_bus_id("07.0") is None and normalize_bus_id("xyz:07:00.0") is None


def test_proc_devices_char_section_only():
    text = (
        "Character devices:\n  1 mem\n195 nvidia\n195 nvidia-modeset\n508 nvidia-uvm\n"
        "\nBlock devices:\n  8 nvidia-uvm\n"
    )
    assert procfs.parse_proc_devices(text) == {"mem": 1, "nvidia": 195, "nvidia-modeset": 195, "nvidia-uvm": 508}


def test_cap_minor():
    assert procfs.parse_cap_minor("DeviceFileMinor: 13\nDeviceFileMode: 292\nDeviceFileModify: 1\n", "a") == 13
    with pytest.raises(InventoryError):
        procfs.parse_cap_minor("DeviceFileMode: 292\n", "a")


@given(st.text())
def test_parsers_raise_only_inventory_error(text):
    for parse in (
        lambda t: procfs.parse_driver_version(t),
        lambda t: procfs.parse_gpu_information(t, "p"),
        lambda t: procfs.parse_proc_devices(t),
        lambda t: procfs.parse_cap_minor(t, "p"),
    ):
        try:
            parse(text)
        except InventoryError:
            pass
