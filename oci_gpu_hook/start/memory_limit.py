"""A container's GPU memory limit: what it declares (environment or pod annotation), capped on
shared GPUs by the configuration, resolved to bytes per device at start. The hook checks it before
changing anything (a bad value fails the start with one line) and keeps it in the container's
record; the watchdog (node/watchdog.py) enforces it. Pure; standard library only.

Forms: a size in MiB or GiB ("512MiB", "4GiB", "1.5GiB"; Mi and Gi too) or a share of each
device's memory ("25%"). Where several apply (the variable, the annotation, a mount the device
plugin adds at MOUNT_DIR/<limit>, the configured cap for shared GPUs), the smallest wins: a
container may lower its limit, never raise it past what the pod, the device plugin or the node
says. The mount is the device plugin's channel because a pod can override a variable the plugin
sets (the pod's own env comes later) but cannot remove a mount.
"""

from __future__ import annotations

from oci_gpu_hook.errors import RequestError, printable
from oci_gpu_hook.start.digits import is_decimal

ENV = "OCI_GPU_HOOK_GPU_MEMORY_LIMIT"
ANNOTATION = "oci-gpu-hook.io/gpu-memory-limit"
MOUNT_DIR = "/var/run/oci-gpu-hook/gpu-memory-limit"  # the device plugin's: /dev/null at MOUNT_DIR/<limit>
PER_REPLICA = "per-replica"  # the configured cap: each device's memory divided by node.replicas
_UNITS = {"mib": 1 << 20, "mi": 1 << 20, "gib": 1 << 30, "gi": 1 << 30}
MIN_BYTES = 1 << 20
ACCEPTED = "a size in MiB or GiB (512MiB, 4GiB) or a percentage of the device's memory (25%)"


def parse(text: str, where: str) -> tuple:
    """('bytes', n) or ('share', fraction) from a limit's text; RequestError naming where it came
    from for anything else, zero and negative values included."""
    value = text.strip()
    shown = printable(value[:40])
    number, unit = value, ""
    if value.endswith("%"):
        number, unit = value[:-1].strip(), "%"
    else:
        for suffix in sorted(_UNITS, key=len, reverse=True):
            if value.lower().endswith(suffix):
                number, unit = value[: -len(suffix)].strip(), suffix
                break
    # Plain decimal digits, one optional sign and dot only (float() would also take "1e3", "inf"
    # and other scripts' digits).
    plain = is_decimal((number[1:] if number.startswith("-") else number).replace(".", "", 1))
    amount = float(number) if unit and plain else None
    if amount is None:
        raise RequestError(f"{where}={shown!r}: not a GPU memory limit; expected {ACCEPTED}")
    if amount <= 0:
        raise RequestError(f"{where}={shown!r}: a GPU memory limit must be above zero")
    if unit == "%":
        if amount > 100:
            raise RequestError(f"{where}={shown!r}: a share of the device's memory cannot exceed 100%")
        return ("share", amount / 100)
    return ("bytes", int(amount * _UNITS[unit]))


def _device_memory(device) -> tuple:
    """(uuid, total bytes or None) of a plan.SelectedDevice."""
    from oci_gpu_hook.start.inventory import device_key

    total = device.mig.memory_total if device.mig is not None else device.gpu.memory_total
    return device_key(device.gpu, device.mig), total


def mounted_limits(mounts) -> list:
    """(limit text, where) for each mount at MOUNT_DIR/<limit>, normalised as the runtime would."""
    from oci_gpu_hook.start.spec import name_under

    found = []
    for mount in mounts:
        name = name_under(mount.destination, MOUNT_DIR)
        if name is not None:
            found.append((name, f"mount {MOUNT_DIR}/{name[:40]}"))  # HookError makes it printable
    return found


def resolve(env: dict, annotations: dict, cap: str | None, replicas: int, devices, mounts=()) -> dict | None:
    """{device uuid: limit in bytes} for the container's devices, or None when no limit applies.
    cap: the configured limit for shared GPUs (a size, a percentage or per-replica), applied when
    the node shares its GPUs (replicas > 1). A declared size larger than a device is refused; a
    configured cap larger than a device is that device's memory (the node's setting, not the
    container's mistake)."""
    declared = []  # (kind, amount, where, from the container)
    if env.get(ENV, "").strip():
        declared.append((*parse(env[ENV], ENV), ENV, True))
    if annotations.get(ANNOTATION, "").strip():
        declared.append((*parse(annotations[ANNOTATION], f"annotation {ANNOTATION}"), f"annotation {ANNOTATION}", True))
    for text, where in mounted_limits(mounts):
        declared.append((*parse(text, where), where, True))
    if cap and replicas > 1:
        kind, amount = ("share", 1 / replicas) if cap == PER_REPLICA else parse(cap, "shared_gpu_memory_limit")
        declared.append((kind, amount, "shared_gpu_memory_limit", False))
    if not declared or not devices:
        return None
    limits = {}
    for device in devices:
        uuid, total = _device_memory(device)
        candidates = []
        for kind, amount, where, declared_by_container in declared:
            if kind == "share":
                if total is None:
                    raise RequestError(f"{where}: a GPU memory limit in percent needs the memory of {uuid}, which "
                                       "NVML did not report; give a size in MiB or GiB")  # fmt: skip
                amount = int(total * amount)
            elif total is not None and amount > total:
                if declared_by_container:
                    raise RequestError(f"{where}: GPU memory limit {amount >> 20} MiB is larger than {uuid}'s "
                                       f"{total >> 20} MiB")  # fmt: skip
                amount = total
            if amount < MIN_BYTES:
                raise RequestError(f"{where}: GPU memory limit on {uuid} comes to {amount} bytes; the least is 1 MiB")
            candidates.append(amount)
        limits[uuid] = min(candidates)
    return limits
