"""The control file's text (simulate.control.render): the lines the simulated NVML reads, and the
input it refuses before a test could read back something other than what it set."""

import os
import re

import pytest

from oci_gpu_hook.errors import SimulateError
from oci_gpu_hook.toolkit.simulate import control
from oci_gpu_hook.toolkit.simulate.build import CSRC

GPU = "GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77"
MIG = "MIG-0b8f4c2e-6a1d-5f3b-9c7e-2d4a6b8c0e1f"


def test_lines_for_values_processes_utilization_and_a_failure():
    text = control.render(
        {GPU: {"memory_temp": 71, "remap_pending": 1, "gpm_tensor_util": 100, "nvlink_raw_tx": 1 << 40},
         MIG: {"memory_reserved": 0, "gpm_pcie_rx": 4700}},
        processes=[(MIG, 42, 1 << 30)],
        fail=999,
        process_utilization=[(GPU, 42, 40, 30, 20, 10), (GPU, 43, 0, 0, 0, 100)],
    )  # fmt: skip
    assert text == (
        "fail 999\n"
        f"{GPU} memory_temp 71\n{GPU} remap_pending 1\n{GPU} gpm_tensor_util 100\n{GPU} nvlink_raw_tx 1099511627776\n"
        f"{MIG} memory_reserved 0\n{MIG} gpm_pcie_rx 4700\n"
        f"{MIG} process 42 1073741824\n"
        f"{GPU} process_util 42 40 30 20 10\n{GPU} process_util 43 0 0 0 100\n"
    )


def test_the_keys_are_those_the_library_reads():
    """control.VALUES and the library's key list (SIM_LIVE_KEYS in csrc/nvml.c) name the same keys:
    a key only one of them knows is refused here, or silently read past there."""
    with open(os.path.join(CSRC, "nvml.c")) as f:
        source = f.read()
    listed = source[source.index("#define SIM_LIVE_KEYS(X)") :].split("\n\n", 1)[0]
    in_c = re.findall(r'X\(L_\w+, "(\w+)"\)', listed)
    assert len(in_c) == 27
    assert sorted(in_c) == sorted(control.VALUES)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"gpm_sm_utilization": 5}, "unknown simulated NVML value 'gpm_sm_utilization'"),
        ({"enc_util": 101}, f"{GPU} enc_util: 101 is not a whole number from 0 to 100"),
        ({"gpm_dram_util": -1}, "gpm_dram_util: -1 is not a whole number from 0 to 100"),
        ({"remap_failure": 2}, "remap_failure: 2 is not a whole number from 0 to 1"),
        ({"remap_pending": True}, "remap_pending: True is not a whole number"),
        ({"memory_temp": 45.5}, "memory_temp: 45.5 is not a whole number"),
        ({"pcie_replay": "3"}, "pcie_replay: '3' is not a whole number"),
        ({"pcie_replay": 1 << 32}, "pcie_replay: 4294967296 is not a whole number from 0 to 4294967295"),
        ({"memory_reserved": 1 << 64}, f"memory_reserved: {1 << 64} is not a whole number from 0 to {(1 << 64) - 1}"),
        ({"remapped_uncorrectable": -3}, "remapped_uncorrectable: -3 is not a whole number from 0 to 4294967295"),
    ],
)
def test_values_out_of_range_or_unknown_are_refused(values, message):
    with pytest.raises(SimulateError, match=message.replace("(", r"\(").replace(")", r"\)")):
        control.render({GPU: values})


def test_wide_values_take_what_unsigned_long_long_holds():
    top = (1 << 64) - 1
    assert control.render({GPU: {"nvlink_raw_rx": top, "memory_reserved": top}}) == (
        f"{GPU} nvlink_raw_rx {top}\n{GPU} memory_reserved {top}\n"
    )


@pytest.mark.parametrize(
    "entry, message",
    [
        ((GPU, 42, 40, 30, 20), "expected (GPU uuid, pid, sm, memory, encoder, decoder)"),
        (42, "expected (GPU uuid, pid, sm, memory, encoder, decoder)"),
        ((MIG, 42, 1, 1, 1, 1), f"process utilization {MIG}: a GPU's UUID, not a MIG device's"),
        (("GPU-xyz", 42, 1, 1, 1, 1), "'GPU-xyz' is not a GPU or MIG UUID"),
        ((None, 42, 1, 1, 1, 1), "None is not a GPU or MIG UUID"),
        ((GPU, 0, 1, 1, 1, 1), "process utilization pid: 0 is not a whole number from 1 to 4294967295"),
        ((GPU, "42", 1, 1, 1, 1), "process utilization pid: '42' is not a whole number"),
        ((GPU, 42, 101, 1, 1, 1), "process 42 sm %: 101 is not a whole number from 0 to 100"),
        ((GPU, 42, 1, -1, 1, 1), "process 42 memory %: -1 is not a whole number from 0 to 100"),
        ((GPU, 42, 1, 1, 2.5, 1), "process 42 encoder %: 2.5 is not a whole number"),
        ((GPU, 42, 1, 1, 1, False), "process 42 decoder %: False is not a whole number"),
    ],
)
def test_process_utilization_refuses_bad_entries(entry, message):
    with pytest.raises(SimulateError) as e:
        control.render(process_utilization=[entry])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_write_replaces_the_file_with_the_rendered_text(tmp_path):
    control.write(str(tmp_path), {GPU: {"dec_util": 9}}, process_utilization=[(GPU, 7, 1, 2, 3, 4)])
    assert (tmp_path / control.FILE).read_text() == f"{GPU} dec_util 9\n{GPU} process_util 7 1 2 3 4\n"
    with pytest.raises(SimulateError):
        control.write(str(tmp_path), {GPU: {"dec_util": 900}})
    assert (tmp_path / control.FILE).read_text() == f"{GPU} dec_util 9\n{GPU} process_util 7 1 2 3 4\n"
