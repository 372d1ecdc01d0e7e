"""What the simulated GPUs report while clients run: the control file that the simulated NVML
re-reads whenever it changes (SIM_ROOT/nvml-control; its format is in csrc/nvml.c). (The event
log its event sets read, SIM_ROOT/nvml-events, is written by tests: tests/nvmlevents.py.)

Tests set exact figures through it (utilization, memory, temperature, power, clocks, energy, the
processes using each GPU or MIG device, an NVML failure) and assert them end to end.
"""

from __future__ import annotations

import os
import re

from oci_gpu_hook.errors import SimulateError
from oci_gpu_hook.start.files import write_atomically

FILE = "nvml-control"
# key -> unit, for the docs and for checking callers' names
VALUES = {
    "util_gpu": "%",
    "util_memory": "%",
    "memory_used": "bytes",
    "temperature": "C",
    "power": "mW",
    "sm_clock": "MHz",
    "mem_clock": "MHz",
    "energy": "mJ",
}
_UUID = re.compile(r"^(GPU|MIG)-[0-9a-fA-F-]{8,80}$")


def render(devices: dict | None = None, processes=(), fail: int | None = None) -> str:
    """The file's text. devices: {uuid: {key: number}}; processes: (uuid, pid, bytes) triples;
    fail: an nvmlReturn_t every NVML call answers with (999: NVML_ERROR_UNKNOWN)."""
    lines = [] if fail is None else [f"fail {int(fail)}"]
    for uuid, values in (devices or {}).items():
        _check_uuid(uuid)
        for key, value in values.items():
            if key not in VALUES:
                raise SimulateError(f"unknown simulated NVML value {key!r}; known: {', '.join(VALUES)}")
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SimulateError(f"{uuid} {key}: {value!r} is not a whole number >= 0")
            lines.append(f"{uuid} {key} {value}")
    for uuid, pid, used in processes:
        _check_uuid(uuid)
        lines.append(f"{uuid} process {int(pid)} {int(used)}")
    return "".join(line + "\n" for line in lines)


def write(root: str, devices: dict | None = None, processes=(), fail: int | None = None) -> None:
    """Replace the simulated host's live values (atomically: a client never reads half a file)."""
    write_atomically(os.path.join(root, FILE), render(devices, processes, fail).encode(), 0o644, durable=False)


def clear(root: str) -> None:
    try:
        os.unlink(os.path.join(root, FILE))
    except FileNotFoundError:
        pass


def _check_uuid(uuid: str) -> None:
    if not _UUID.match(uuid):
        raise SimulateError(f"{uuid!r} is not a GPU or MIG UUID")
