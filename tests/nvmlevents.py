"""XIDs for the simulated NVML: the event log its event sets read (SIM_ROOT/nvml-events, format in
oci_gpu_hook/toolkit/simulate/csrc/nvml.c, "events"), written as a test injects them."""

from __future__ import annotations

import os

FILE = "nvml-events"


def inject_xid(root: str, uuid: str, xid: int) -> None:
    """An XID on a simulated GPU (or, by a MIG device's UUID, on that MIG device's instances),
    delivered to every NVML event set registered for its GPU. One append of one whole line: a
    reader polling the log never sees half of it."""
    if not (uuid.startswith(("GPU-", "MIG-")) and " " not in uuid and isinstance(xid, int) and 0 < xid < 1 << 32):
        raise ValueError(f"inject_xid({uuid!r}, {xid!r}): a GPU or MIG UUID and an XID from 1 to 2**32-1")
    fd = os.open(os.path.join(root, FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, f"{uuid} xid {xid}\n".encode())
    finally:
        os.close(fd)


def clear_events(root: str) -> None:
    try:
        os.unlink(os.path.join(root, FILE))
    except FileNotFoundError:
        pass
