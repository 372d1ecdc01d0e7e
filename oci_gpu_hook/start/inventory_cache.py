"""The inventory cache: discovery once, not on every container start.

`oci-gpu-hook inventory refresh` (and the hook itself when the cache is stale) writes the
inventory as JSON, atomically, with a fingerprint of what it was built from: the driver version
banner, the GPUs procfs lists, the device nodes and the driver root's ld.so.cache. The hook
recomputes the fingerprint (a few stat calls and two small reads) and uses the cache only when it
still matches, and only when it is a regular file of the hook's own uid (settings.CACHE_UID, for
a hook running as root) that no one else may write (settings.read_trusted): its paths become
mount sources, so a file of root's, which a uid 0 without capabilities may have written, will
not do. Anything else counts as stale: rediscovered, and replaced by the rewrite
(settings.write_trusted). Standard library only: this is on the start path.
"""

from __future__ import annotations

import os

from oci_gpu_hook.start import driver, files, jsonio
from oci_gpu_hook.start.inventory import Inventory, host_path
from oci_gpu_hook.start.settings import Settings, read_trusted, write_trusted

FORMAT = 5  # 2: GPUs list their DRM nodes; 3: MIG devices their profile and memory; 4: libraries
# what they need, and why NVML did not answer; 5: MIG devices their attributes (SMs, engines)
MAX_BYTES = 16 << 20  # an 8-GPU host's cache is 14 kB


def _stat_key(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _read_small(path: str) -> str | None:
    try:
        return files.read_bounded(path, 1 << 16)[: 1 << 16].decode("utf-8", "replace")
    except OSError:
        return None


def _nodes(directory: str, prefix: str = "nvidia"):
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    nodes = []
    for entry in entries:
        if entry.name.startswith(prefix):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            nodes.append([entry.name, st.st_mode, st.st_rdev, st.st_ino])
    return sorted(nodes)


def _names(directory: str) -> list:
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def fingerprint(settings: Settings) -> dict:
    proc_nvidia = host_path(settings.proc_root, "/proc/driver/nvidia")
    devices = _read_small(host_path(settings.proc_root, "/proc/devices")) or ""
    try:
        gpus = sorted(os.listdir(os.path.join(proc_nvidia, "gpus")))
    except OSError:
        gpus = []
    return {
        "roots": [settings.driver_root, settings.dev_root, settings.proc_root],
        "version": _read_small(os.path.join(proc_nvidia, "version")),
        "majors": [line for line in devices.splitlines() if "nvidia" in line],
        "gpus": gpus,
        "ld.so.cache": _stat_key(host_path(settings.driver_root, "/etc/ld.so.cache")),
        "dev": _nodes(host_path(settings.dev_root, "/dev")),
        "dev/nvidia-caps": _nodes(host_path(settings.dev_root, "/dev/nvidia-caps")),
        "dev/nvidia-caps-imex-channels": _nodes(host_path(settings.dev_root, driver.IMEX_CHANNELS_DIR), "channel"),
        # nvidia-drm loaded (or unloaded) after the cache was written: its DRM nodes come or go.
        "dev/dri/by-path": _names(host_path(settings.dev_root, driver.DRI_BY_PATH)),
    }


def read(settings: Settings, current: dict | None = None) -> Inventory | None:
    """The cached inventory if it is present and still matches the host, else None."""
    path = settings.inventory_cache
    try:
        current = current if current is not None else fingerprint(settings)
        if _memory is not None and path in _memory:
            identity, printed, inventory = _memory[path]
            if _identity(os.lstat(path)) == identity and printed == current:
                return inventory
        seen = []
        doc = jsonio.loads(read_trusted(path, MAX_BYTES, seen))
        if doc.get("format") != FORMAT:
            return None
        if doc.get("fingerprint") != current:
            return None
        inventory = Inventory.from_json(doc["inventory"])
        if _memory is not None:
            _memory[path] = (_identity(seen[0]), current, inventory)
        return inventory
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # absent, torn by hand, from another version or not ours alone: rebuild


# The inventories read, by cache path, with the identity of the file they were read from and its
# fingerprint: only in a start server's spare worker (server.Spare), which reads the cache before
# its start comes. Used only while the file at the path is still that file, unchanged (the
# identity holds its inode, size, times, mode and owner: a rewrite, always a rename, or a chmod
# changes it) and the host still has that fingerprint.
_memory: dict | None = None


def keep_in_memory() -> None:
    global _memory
    _memory = {}


def _identity(st) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid)


def write(settings: Settings, inventory: Inventory, print_=None) -> None:
    """Write atomically: readers see the old file or the new one, never a torn one; the hook's own
    (settings.write_trusted). OSError: nothing written (a root without CAP_CHOWN writes none)."""
    import json

    path = settings.inventory_cache
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    doc = {"format": FORMAT, "fingerprint": print_ or fingerprint(settings), "inventory": inventory.to_json()}
    write_trusted(path, json.dumps(doc, separators=(",", ":")).encode(), durable=True)


# Of the hook's budget, what a rebuild with NVML must leave for the plan, the mounts and ldconfig.
APPLY_RESERVE = 2.0
MIN_NVML_SECONDS = 0.5


def load(settings: Settings, budget=None) -> Inventory:
    """The inventory for the hook: from the cache when fresh, else discovered and cached. With a
    budget (the hook's), NVML gets only what the budget leaves after APPLY_RESERVE, and a hung
    NVML fails the start with one line in time, before anything in the container changed."""
    current = fingerprint(settings)
    cached = read(settings, current)
    if cached is not None:
        return cached
    from oci_gpu_hook.errors import InventoryError, NvmlError
    from oci_gpu_hook.start.discover import discover  # the parsers load only when discovering

    nvml_timeout = None
    if budget is not None:
        nvml_timeout = budget.remaining() - min(APPLY_RESERVE, budget.seconds / 4)
        if nvml_timeout < MIN_NVML_SECONDS:
            raise InventoryError(
                f"the inventory cache is stale and the hook's {budget.seconds:g} s budget leaves no time "
                "to ask NVML; run `oci-gpu-hook inventory refresh`"
            )
    try:
        inventory = discover(settings, nvml_timeout=nvml_timeout)
    except NvmlError as e:
        if budget is None:
            raise
        stale = "the inventory cache is stale: run `oci-gpu-hook inventory refresh`"
        raise InventoryError(f"{e.message}; {stale}") from None
    try:
        write(settings, inventory, current)
    except OSError:
        pass  # a read-only /run costs speed, not correctness
    return inventory


def refresh(settings: Settings) -> Inventory:
    from oci_gpu_hook.start.discover import discover

    current = fingerprint(settings)
    inventory = discover(settings)
    write(settings, inventory, current)
    return inventory
