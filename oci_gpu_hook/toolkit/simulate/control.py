"""What the simulated GPUs report while clients run: the control file that the simulated NVML
re-reads whenever it changes (SIM_ROOT/nvml-control; its format is in csrc/nvml.c). (The event
log its event sets read, SIM_ROOT/nvml-events, is written by tests: tests/nvmlevents.py.)

Tests set exact figures through it (utilization, memory, temperatures, power, clocks, energy, PCIe
and NVLink counters, row remapping, GPM metrics, the processes using each GPU or MIG device and
their utilization, an NVML failure) and assert them end to end. What a device reports for a key
the file does not set, and which devices answer each key, is in csrc/nvml.c's comment.
"""

from __future__ import annotations

import os
import re

from oci_gpu_hook.errors import SimulateError
from oci_gpu_hook.start.files import write_atomically

FILE = "nvml-control"
# key -> unit, for the docs and for checking callers' names and numbers
VALUES = {
    "util_gpu": "%",
    "util_memory": "%",
    "memory_used": "bytes",
    "memory_reserved": "bytes",
    "temperature": "C",
    "memory_temp": "C",
    "power": "mW",
    "sm_clock": "MHz",
    "mem_clock": "MHz",
    "energy": "mJ",
    "pcie_replay": "count",
    "enc_util": "%",
    "dec_util": "%",
    "remapped_correctable": "rows",
    "remapped_uncorrectable": "rows",
    "remap_pending": "0/1",
    "remap_failure": "0/1",
    "nvlink_raw_tx": "KiB",
    "nvlink_raw_rx": "KiB",
    "gpm_graphics_util": "%",
    "gpm_sm_util": "%",
    "gpm_sm_occupancy": "%",
    "gpm_tensor_util": "%",
    "gpm_dram_util": "%",
    "gpm_pcie_tx": "MiB/s",
    "gpm_pcie_rx": "MiB/s",
    "vgpu_licensed": "0/1",
}
# The largest number each key takes: a percentage or a flag by its unit; the rest what the NVML
# call that reports it holds, unsigned long long for these and unsigned int for the others (the
# library would cut a larger number short, and the test would read back another).
_UNSIGNED_INT = (1 << 32) - 1
_WIDE = ("memory_used", "memory_reserved", "energy", "nvlink_raw_tx", "nvlink_raw_rx")
_LIMIT = {"%": 100, "0/1": 1}
_UUID = re.compile(r"^(GPU|MIG)-[0-9a-fA-F-]{8,80}$")


def render(devices: dict | None = None, processes=(), fail: int | None = None, process_utilization=()) -> str:
    """The file's text. devices: {uuid: {key: number}}; processes: (uuid, pid, bytes) triples;
    fail: an nvmlReturn_t every NVML call answers with (999: NVML_ERROR_UNKNOWN);
    process_utilization: (GPU uuid, pid, sm %, memory %, encoder %, decoder %) of a process."""
    lines = [] if fail is None else [f"fail {int(fail)}"]
    for uuid, values in (devices or {}).items():
        _check_uuid(uuid)
        for key, value in values.items():
            if key not in VALUES:
                raise SimulateError(f"unknown simulated NVML value {key!r}; known: {', '.join(VALUES)}")
            limit = _LIMIT.get(VALUES[key], (1 << 64) - 1 if key in _WIDE else _UNSIGNED_INT)
            _check_whole(f"{uuid} {key}", value, 0, limit)
            lines.append(f"{uuid} {key} {value}")
    for uuid, pid, used in processes:
        _check_uuid(uuid)
        lines.append(f"{uuid} process {int(pid)} {int(used)}")
    for entry in process_utilization:
        if not isinstance(entry, (tuple, list)) or len(entry) != 6:
            raise SimulateError(f"process utilization {entry!r}: expected (GPU uuid, pid, sm, memory, encoder, "
                                "decoder)")  # fmt: skip
        uuid, pid, *percents = entry
        _check_uuid(uuid)
        if not uuid.startswith("GPU-"):  # NVML keeps per-process samples of whole GPUs only
            raise SimulateError(f"process utilization {uuid}: a GPU's UUID, not a MIG device's")
        _check_whole(f"{uuid} process utilization pid", pid, 1, _UNSIGNED_INT)
        for what, percent in zip(("sm", "memory", "encoder", "decoder"), percents):
            _check_whole(f"{uuid} process {pid} {what} %", percent, 0, 100)
        lines.append(f"{uuid} process_util {pid} {' '.join(str(p) for p in percents)}")
    return "".join(line + "\n" for line in lines)


def write(
    root: str, devices: dict | None = None, processes=(), fail: int | None = None, process_utilization=()
) -> None:
    """Replace the simulated host's live values (atomically: a client never reads half a file)."""
    text = render(devices, processes, fail, process_utilization)
    write_atomically(os.path.join(root, FILE), text.encode(), 0o644, durable=False)


def clear(root: str) -> None:
    try:
        os.unlink(os.path.join(root, FILE))
    except FileNotFoundError:
        pass


def _check_uuid(uuid: str) -> None:
    if not isinstance(uuid, str) or not _UUID.match(uuid):
        raise SimulateError(f"{uuid!r} is not a GPU or MIG UUID")


def _check_whole(what: str, value, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise SimulateError(f"{what}: {value!r} is not a whole number from {low} to {high}")
