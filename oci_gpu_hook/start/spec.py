"""The container's configuration (bundle/config.json): the parts the hook reads.

Only data: rootfs location, environment, capabilities, mounts, device nodes, annotations, SELinux
mount label. Paths inside the rootfs are never resolved here (see rootfs.py); this module does no
I/O except reading config.json itself.
"""

from __future__ import annotations

import os

from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.start import files
from oci_gpu_hook.start.prefilter_rule import VOLUME_MOUNT_DIR
from oci_gpu_hook.start.state import StateError, load_json

MAX_CONFIG_BYTES = 16 << 20


class Mount(Frozen):
    __slots__ = ("destination", "source", "type")


def name_under(destination: str, directory: str) -> str | None:
    """The name a mount destination gives directly under directory, or None. Normalised first, so
    that /var/run/./dir/0 and //var/run/dir/0/ count: the one rule for every such channel."""
    parent, name = os.path.split("/" + os.path.normpath(destination).lstrip("/"))
    return name if parent == directory and name not in ("", ".", "..") else None


def volume_mount_device(destination: str) -> str | None:
    """The device id a mount destination names in NVIDIA's volume-mount device list (/dev/null
    mounted at /var/run/nvidia-container-devices/<id>), or None: the one rule for the hook's fast
    path and for the request."""
    return name_under(destination, VOLUME_MOUNT_DIR)


class Spec(Frozen):
    __slots__ = ("rootfs", "env", "bounding_capabilities", "mounts", "annotations", "mount_label", "devices")
    _defaults = {"devices": ()}
    rootfs: str  # absolute host path of the container's root
    env: dict
    bounding_capabilities: frozenset
    mounts: tuple
    annotations: dict
    mount_label: str | None
    devices: tuple  # linux.devices as config.json has it: read only where the hook may stand down


def environment(entries) -> dict:
    """process.env as a dict; a later duplicate wins, as in the process it becomes."""
    env = {}
    for entry in entries:
        if isinstance(entry, str):
            key, sep, value = entry.partition("=")
            if sep and key:
                env[key] = value
    return env


def _dict(doc: dict, key: str) -> dict:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def _list(doc: dict, key: str) -> list:
    value = doc.get(key)
    return value if isinstance(value, list) else []


def parse(doc, bundle: str) -> Spec:
    if not isinstance(doc, dict):
        raise StateError(f"{bundle}/config.json is not a JSON object")
    root = _dict(doc, "root")
    root_path = root.get("path")
    if not isinstance(root_path, str) or not root_path or "\0" in root_path:
        raise StateError(f"{bundle}/config.json has no valid root.path")
    process = _dict(doc, "process")
    mounts = tuple(
        Mount(m["destination"], m.get("source") or "", m.get("type") or "")
        for m in _list(doc, "mounts")
        if isinstance(m, dict)
        and isinstance(m.get("destination"), str)
        and isinstance(m.get("source", ""), str)
        and isinstance(m.get("type", ""), str)
    )
    annotations = {k: v for k, v in _dict(doc, "annotations").items() if isinstance(k, str) and isinstance(v, str)}
    linux = _dict(doc, "linux")
    label = linux.get("mountLabel")
    return Spec(
        rootfs=os.path.normpath(os.path.join(bundle, root_path)),
        env=environment(_list(process, "env")),
        bounding_capabilities=frozenset(
            c for c in _list(_dict(process, "capabilities"), "bounding") if isinstance(c, str)
        ),
        mounts=mounts,
        annotations=annotations,
        mount_label=label if isinstance(label, str) and label else None,
        devices=tuple(_list(linux, "devices")),
    )


def load(bundle: str) -> Spec:
    path = os.path.join(bundle, "config.json")
    try:
        # nofollow: the bundle belongs to the runtime, but a config.json symlink is never expected.
        data = files.read_bounded(path, MAX_CONFIG_BYTES, nofollow=True, regular=True)
    except OSError as e:
        raise StateError(f"{path}: cannot read the container configuration: {e.strerror}") from None
    return parse(load_json(data, path, MAX_CONFIG_BYTES), bundle)
