"""The inventory cache: discovery once, not on every container start.

`oci-gpu-hook inventory refresh` (and the hook itself when the cache is stale) writes the
inventory as JSON, atomically, with a fingerprint of what it was built from: the driver version
banner, the GPUs procfs lists, the device nodes and the driver root's ld.so.cache. The hook
recomputes the fingerprint (a few stat calls and two small reads) and uses the cache only when it
still matches. Standard library only: this is on the start path.
"""

from __future__ import annotations

import os

from . import jsonio
from .inventory import Inventory, host_path
from .settings import Settings

FORMAT = 1


def _stat_key(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _read_small(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16).decode("utf-8", "replace")
    except OSError:
        return None


def _nodes(directory: str):
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    nodes = []
    for entry in entries:
        if entry.name.startswith("nvidia"):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            nodes.append([entry.name, st.st_mode, st.st_rdev, st.st_ino])
    return sorted(nodes)


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
    }


def read(settings: Settings, current: dict | None = None) -> Inventory | None:
    """The cached inventory if it is present and still matches the host, else None."""
    try:
        with open(settings.inventory_cache, "rb") as f:
            doc = jsonio.loads(f.read())
        if doc.get("format") != FORMAT:
            return None
        if doc.get("fingerprint") != (current if current is not None else fingerprint(settings)):
            return None
        return Inventory.from_json(doc["inventory"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # absent, torn by hand or from another version: rebuild


def write(settings: Settings, inventory: Inventory, print_=None) -> None:
    """Write atomically: readers see the old file or the new one, never a torn one."""
    import json
    import tempfile

    path = settings.inventory_cache
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o755, exist_ok=True)
    doc = {"format": FORMAT, "fingerprint": print_ or fingerprint(settings), "inventory": inventory.to_json()}
    fd, tmp = tempfile.mkstemp(prefix=".inventory-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load(settings: Settings) -> Inventory:
    """The inventory for the hook: from the cache when fresh, else discovered and cached."""
    from .inventory import discover

    current = fingerprint(settings)
    cached = read(settings, current)
    if cached is not None:
        return cached
    inventory = discover(settings)
    try:
        write(settings, inventory, current)
    except OSError:
        pass  # a read-only /run costs speed, not correctness
    return inventory


def refresh(settings: Settings) -> Inventory:
    from .inventory import discover

    current = fingerprint(settings)
    inventory = discover(settings)
    write(settings, inventory, current)
    return inventory
