"""Each device's health, as ListAndWatch reports it: its device nodes (present, character devices,
the right numbers) and NVML (a device NVML does not list, or NVML failing, is Unhealthy), and the
marks critical XIDs leave (xid_watch.py reports them): a device an XID marked stays Unhealthy
until its GPU goes and comes back (a reset, a driver reload), which NVIDIA's plugin never notices.
"""

from __future__ import annotations

import json
import os

from oci_gpu_hook.errors import NvmlError
from oci_gpu_hook.node.plugin import say
from oci_gpu_hook.node.plugin.xid_watch import describe
from oci_gpu_hook.start.inventory import device_key

# The plugin's verdicts for the exporter (oci_gpu_hook_gpu_health), beside the records directory
# as the watchdog's counts are: the one place both services' containers mount.
HEALTH_FILE = "device-plugin-health.json"


def health_path(records_directory: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(records_directory)), HEALTH_FILE)


def write_health(records_directory: str, health: dict) -> None:
    """The running plugin's {device uuid: None when healthy, else why not}, with its pid: a file
    only root can write (settings.write_trusted). Raises OSError."""
    from oci_gpu_hook.start import pids
    from oci_gpu_hook.start.settings import write_trusted

    # the pid and its start time: a process that reuses the pid later is not the plugin
    doc = {"format": 1, "pid": os.getpid(), "pid_start": pids.start_ticks(os.getpid()), "devices": health}
    write_trusted(health_path(records_directory), json.dumps(doc, sort_keys=True).encode())


def read_health(records_directory: str) -> dict:
    """What write_health wrote, for the exporter; {} when the plugin that wrote it no longer runs
    (its pid gone or reused), or when the file is not one the plugin wrote (settings.read_trusted:
    anyone else's verdicts)."""
    from oci_gpu_hook.start import pids
    from oci_gpu_hook.start.settings import read_trusted

    try:
        doc = json.loads(read_trusted(health_path(records_directory), 1 << 20))
        devices = doc["devices"]
        if not pids.is_same_process(doc["pid"], doc["pid_start"]):
            return {}  # that plugin has stopped (its pid gone, or another process's now)
        if isinstance(devices, dict) and all(v is None or isinstance(v, str) for v in devices.values()):
            return {str(k): v for k, v in devices.items()}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return {}


def device_health(inventory, reader, gone: set | None = None) -> dict:
    """{unit uuid: None when healthy, else why not} for every GPU and MIG device. gone, if given,
    gets the GPUs that are not there themselves (their node, or NVML does not list them), as
    opposed to NVML failing as a whole."""
    from oci_gpu_hook.start.discover import check_node

    def node_problem(node):
        checked = check_node(inventory.dev_root, node.path, node.major, node.minor)
        return f"{node.path}: {checked.problem}" if checked.problem else None

    try:
        listed = {sample.device.uuid for sample in reader.read()}
        nvml_problem = None
    except NvmlError as e:
        listed, nvml_problem = set(), e.message
    health = {}
    for gpu in inventory.gpus:
        gpu_problem = node_problem(gpu.node)
        if gpu_problem is None and nvml_problem is None and gpu.uuid not in listed:
            gpu_problem = "NVML does not list it"
        if gpu_problem is not None and gone is not None:
            gone.add(gpu.uuid)
        gpu_problem = gpu_problem or nvml_problem
        health[gpu.uuid] = gpu_problem
        for mig in gpu.mig:
            uuid = device_key(gpu, mig)
            problem = gpu_problem or node_problem(mig.gi_cap) or node_problem(mig.ci_cap)
            if problem is None and mig.uuid and mig.uuid not in listed:
                problem = "NVML does not list it"
            health[uuid] = problem
    return health


def _keys(gpu) -> list:
    """The unit uuids of a GPU: its own and its MIG devices'."""
    return [gpu.uuid] + [device_key(gpu, m) for m in gpu.mig]


class XidMarks:
    """The devices critical XIDs have marked: {unit uuid: why}, until their GPU is seen gone."""

    def __init__(self):
        self.marks: dict = {}

    def mark(self, inventory, event) -> bool:
        """Mark the devices a critical XID (xid_watch.XidEvent) names; False when it names a GPU
        the inventory does not have (nothing marked)."""
        gpu = next((g for g in inventory.gpus if g.uuid == event.gpu_uuid), None)
        if gpu is None:
            say(f"XID {event.xid} on {describe(event)}, a GPU this plugin does not offer: ignored")
            return False
        why = f"XID {event.xid} (a critical XID: health.criticalXids)"
        if event.gi is None:
            keys = _keys(gpu)
        else:  # a MIG device's instances: that MIG device alone, as NVIDIA's plugin does
            keys = [device_key(gpu, m) for m in gpu.mig if (m.gi, m.ci) == (event.gi, event.ci)]
            if not gpu.mig:
                keys = [gpu.uuid]
        for key in keys:
            self.marks.setdefault(key, why)
        return True

    def forget_not_in(self, inventory) -> None:
        """A re-read inventory: the marks of devices it no longer has go (their GPU went)."""
        kept = {k for g in inventory.gpus for k in _keys(g)}
        for key in [k for k in self.marks if k not in kept]:
            del self.marks[key]
            say(f"{key}: no longer on this node; an XID it had no longer counts")

    def apply(self, inventory, health: dict, gone: set) -> None:
        """The marks onto health (device_health's). A GPU seen gone (its node, or NVML no longer
        lists it) loses its marks and those of its MIG devices: when it is back, it is a GPU that
        came back (reset, driver reloaded), and it is as healthy as its nodes and NVML say."""
        for gpu in inventory.gpus:
            if gpu.uuid in gone:
                for key in _keys(gpu):
                    if self.marks.pop(key, None) is not None:
                        say(f"{key}: its GPU is gone; the XID no longer counts once it is back")
        for key, why in self.marks.items():
            if key in health and health[key] is None:
                health[key] = why
