import pytest

from oci_gpu_hook.errors import SimulateError
from oci_gpu_hook.start import driver
from oci_gpu_hook.toolkit.simulate.model import describe_host, driver_libraries, nvml_bus_id


def test_gpus_in_bus_order_with_stable_uuids():
    a = describe_host("/s", gpus=4)
    b = describe_host("/s", gpus=4)
    assert [g.uuid for g in a.gpus] == [g.uuid for g in b.gpus]
    assert len({g.uuid for g in a.gpus}) == 4
    assert [g.bus_id for g in a.gpus] == sorted(g.bus_id for g in a.gpus)
    assert [g.minor for g in a.gpus] == [0, 1, 2, 3]


def test_scrambled_minors_differ_from_index():
    host = describe_host("/s", gpus=4, scramble_minors=True)
    assert [g.minor for g in host.gpus] == [3, 2, 1, 0]


def test_mig_instances_and_cap_minors():
    host = describe_host("/s", gpus=2, mig=[1], scramble_minors=True)
    assert host.gpus[0].mig == ()
    gpu = host.gpus[1]  # minor 0
    assert [(m.index, m.gi, m.ci, m.profile) for m in gpu.mig] == [
        (0, 1, 0, "3g.20gb"),
        (1, 5, 0, "2g.10gb"),
        (2, 13, 0, "1g.5gb"),
    ]
    # mig-minors: gpu0/gi1/access is 12, its ci0 13 (3 + gi*9, +1 + ci)
    assert (gpu.mig[0].gi_cap_minor, gpu.mig[0].ci_cap_minor) == (12, 13)
    assert all(m.uuid.startswith("MIG-") for m in gpu.mig)


def test_cap_minor_formula_matches_driver_listing():
    assert driver.mig_gi_cap_minor(0, 0) == 3
    assert driver.mig_ci_cap_minor(0, 0, 7) == 11
    assert driver.mig_gi_cap_minor(0, 1) == 12
    assert driver.mig_gi_cap_minor(1, 0) == 138


def test_dynamic_majors_avoid_used_ones():
    host = describe_host("/s", used_majors=[511, 510, 508])
    assert (host.uvm_major, host.caps_major) == (509, 507)


def test_the_simulated_libraries_are_550s_and_each_is_in_the_capability_table():
    """The simulator builds what driver 550 ships (compared with the real files in
    tests/e2e/test_real_driver.py), each a library the hook knows; the table also names libraries
    of older drivers (libnvidia-compiler, -fatbinaryloader, -ifr, -cbl) and of other packages
    (libnvidia-nscq), which the simulator does not invent."""
    libs = driver_libraries("550.54.15")
    prefixes = {lib.prefix for lib in libs}
    table = {p for ps in driver.LIBRARIES.values() for p in ps}
    assert prefixes <= table
    assert table - prefixes == {"libnvidia-cbl.so", "libnvidia-compiler.so", "libnvidia-fatbinaryloader.so",
                                "libnvidia-ifr.so", "libnvidia-nscq.so", "libnvidia-pkcs11.so"}  # fmt: skip
    sonames = {lib.prefix: lib.soname for lib in libs}
    assert sonames["libcuda.so"] == "libcuda.so.1"
    assert sonames["libnvidia-glcore.so"] == "libnvidia-glcore.so.550.54.15"


def test_nvml_bus_id_form():
    assert nvml_bus_id("0000:0f:00.0") == "00000000:0F:00.0"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gpus": 0}, "--gpus 0"),
        ({"gpus": 17}, "--gpus 17"),
        ({"driver_version": "abc"}, "--driver-version 'abc'"),
        ({"cuda_version": "12"}, "--cuda-version '12'"),
        ({"mig": [5]}, "--mig 5: no such GPU"),
        ({"model": "v100"}, "--model 'v100'"),
        ({"cuda_version": "\u0661\u0662.\u0660"}, "--cuda-version '"),  # Arabic-Indic 12.0: int() reads it
        ({"driver_version": "\u0665\u0665\u0660.54"}, "--driver-version '"),
        ({"graphics": [2]}, "--graphics 2: no such GPU"),
        ({"vgpu_host_driver": ("550.54.16",)}, "--vgpu '550.54.16': expected VERSION,BRANCH"),
        ({"vgpu_host_driver": ("550.54.16", "r551_40_longer")}, "--vgpu '550.54.16,r551_40_longer': expected"),
        ({"vgpu_host_driver": ("550.54.16", "r551 40")}, "--vgpu '550.54.16,r551 40': expected"),
        ({"vgpu_host_driver": ("550.54.16", "")}, "--vgpu '550.54.16,': expected"),
        ({"vgpu_host_driver": ("550.54.16", "r551_40\n")}, "--vgpu '550.54.16,r551_40"),
    ],
)
def test_bad_options_are_one_line_errors(kwargs, message):
    with pytest.raises(SimulateError, match=message.replace("'", ".")):
        describe_host("/s", **kwargs)


def test_display_mode_and_a_vgpu_guest_are_described_per_gpu_and_per_host():
    """--graphics gives a GPU a VGA controller's PCI class, the others keep their model's (a 3D
    controller); --vgpu makes the host a guest of a vGPU host driver of that version and branch."""
    host = describe_host("/s", gpus=3, graphics=[1], vgpu_host_driver=["550.54.16", "r551_40"])
    assert [g.pci_class for g in host.gpus] == [0x030200, 0x030000, 0x030200]
    assert host.vgpu_host_driver == ("550.54.16", "r551_40")
    plain = describe_host("/s", gpus=2, model="t4")
    assert [g.pci_class for g in plain.gpus] == [0x030200] * 2 and plain.vgpu_host_driver is None


def test_topology_default_pairs_switches_and_splits_numa():
    host = describe_host("/s", gpus=4)
    assert [(g.pcie_switch, g.numa_node, g.nvlink_peers) for g in host.gpus] == [
        (0, 0, ()), (0, 0, ()), (1, 1, ()), (1, 1, ()),
    ]  # fmt: skip
    assert [g.numa_node for g in describe_host("/s", gpus=2).gpus] == [0, 0]


def test_topology_from_options():
    host = describe_host("/s", gpus=5, pcie_switches="0+2, 1+3", nvlinks="0+1,1+2", numa_nodes="1,0,1,0,0")
    assert [(g.pcie_switch, g.numa_node, g.nvlink_peers) for g in host.gpus] == [
        (0, 1, (1,)), (1, 0, (0, 2)), (0, 1, (1,)), (1, 0, ()), (2, 0, ()),  # GPU 4: a switch of its own
    ]  # fmt: skip


@pytest.mark.parametrize(
    "options, message",
    [
        ({"pcie_switches": "0+4"}, "--pcie-switches '0+4': '4' is not a GPU index (the host has GPUs 0 to 3)"),
        ({"pcie_switches": "0+1,1+2"}, "--pcie-switches '0+1,1+2': GPU 1 is under two switches"),
        ({"pcie_switches": "0+0"}, "--pcie-switches '0+0': GPU 0 is listed twice"),
        ({"nvlinks": "0+1+2"}, "--nvlink '0+1+2': an NVLink joins two GPUs: A+B"),
        ({"nvlinks": "x+1"}, "--nvlink 'x+1': 'x' is not a GPU index (the host has GPUs 0 to 3)"),
        ({"numa_nodes": "0,1"}, "--numa-nodes '0,1': expected 4 node numbers (0-63), one per GPU"),
        # Other digits: '¹' made int() raise, '٣' and '２' were read as 3 and 2.
        ({"numa_nodes": "0,\u00b9,0,0"}, "--numa-nodes '0,\u00b9,0,0': expected 4 node numbers (0-63), one per GPU"),
        ({"numa_nodes": "0,\u0663,0,0"}, "--numa-nodes '0,\u0663,0,0': expected 4 node numbers (0-63), one per GPU"),
        ({"pcie_switches": "1+¹"}, "--pcie-switches '1+¹': '¹' is not a GPU index (the host has GPUs 0 to 3)"),
        ({"nvlinks": "0+\uff12"}, "--nvlink '0+\uff12': '\uff12' is not a GPU index (the host has GPUs 0 to 3)"),
    ],
)
def test_topology_option_errors(options, message):
    with pytest.raises(SimulateError) as e:
        describe_host("/s", gpus=4, **options)
    assert e.value.message == message
