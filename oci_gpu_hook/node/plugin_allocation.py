"""The device plugin's answers to the kubelet, as plain data: which ids to prefer for a container
(GetPreferredAllocation), and what the runtime must be told so that the container gets exactly
the allocated GPUs (Allocate). Pure; device_plugin.py turns these into the API's messages.

Allocate's answer, by `flags.plugin.deviceListStrategy` (any of them, together):
- envvar: NVIDIA_VISIBLE_DEVICES=<ids>; the hook reads it.
- volume-mounts: /dev/null mounted at /var/run/nvidia-container-devices/<id> and the variable set
  to that directory; the hook reads the mounts (its accept_volume_mounts setting), and a pod
  cannot forge or remove them the way it can override the variable.
- cdi-annotations: cdi.k8s.io/oci-gpu-hook_<resource> = <kind>=<id>,... for runtimes that read
  CDI annotations (and the hook, with accept_cdi_annotations).
- cdi-cri: the CDI device names in the answer's CDI field (containerd 1.7+, CRI-O 1.28+).
With only CDI strategies, NVIDIA_VISIBLE_DEVICES is set to void, so that an image's own
NVIDIA_VISIBLE_DEVICES=all cannot widen the allocation through the hook.

A GPU memory limit on a time-sliced resource travels twice: as OCI_GPU_HOOK_GPU_MEMORY_LIMIT, for
the program to read, and as a mount at /var/run/oci-gpu-hook/gpu-memory-limit/<limit>, which the
pod cannot remove. The hook takes the smallest limit it is given (memory_limit.py), so a pod may
lower its share but not raise it; the watchdog enforces what the hook recorded.
"""

from __future__ import annotations

from oci_gpu_hook.record import Record
from oci_gpu_hook.start import memory_limit
from oci_gpu_hook.start.inventory import host_path
from oci_gpu_hook.start.request import CDI_ANNOTATION_PREFIX, VISIBLE_DEVICES
from oci_gpu_hook.start.spec import VOLUME_MOUNT_DIR

CDI_ANNOTATION_NAME = "oci-gpu-hook_"


class AllocationError(Exception):
    """The kubelet asked for something this resource cannot give: the gRPC call fails with it."""


class ContainerAllocation(Record):
    __slots__ = ("envs", "mounts", "devices", "annotations", "cdi_devices")
    envs: dict
    mounts: tuple  # (container path, host path, read only)
    devices: tuple  # (container path, host path, permissions)
    annotations: dict
    cdi_devices: tuple  # fully qualified CDI names


def preferred(resource, available, must_include, size: int) -> list:
    """size ids from available, must_include first. The rest spread the container over distinct
    GPUs, then over the GPUs with the most replicas still free: time-sliced pods land on the
    least shared GPU, and a container asking for two gets two GPUs where it can."""
    chosen = [i for i in dict.fromkeys(must_include) if resource.find(i) is not None][:size]
    free: dict = {}
    for device_id in available:
        device = resource.find(device_id)
        if device is not None and device_id not in chosen:
            free.setdefault(device.unit.uuid, []).append(device_id)
    used = {resource.find(i).unit.uuid for i in chosen}
    order = {d.unit.uuid: n for n, d in enumerate(resource.devices)}  # inventory order breaks ties
    while len(chosen) < size and any(free.values()):
        uuid = min((u for u in free if free[u]), key=lambda u: (u in used, -len(free[u]), order.get(u, 0)))
        chosen.append(free[uuid].pop(0))
        used.add(uuid)
    return chosen


def _units(resource, ids) -> list:
    units = []
    for device_id in ids:
        device = resource.find(device_id)
        if device is None:
            raise AllocationError(f"{resource.name}: unknown device id {device_id[:80]!r}")
        units.append(device.unit)
    if resource.replicas > 1 and resource.fail_requests_greater_than_one and len(ids) > 1:
        raise AllocationError(f"{resource.name}: a container may ask for 1 time-sliced GPU, not {len(ids)} "
                              "(sharing.timeSlicing.failRequestsGreaterThanOne is set)")  # fmt: skip
    return list({u.uuid: u for u in units}.values())  # two replicas of one GPU are that GPU


def _device_specs(inventory, units) -> tuple:
    """The /dev/nvidia* nodes the container needs, for runtimes that make them (passDeviceSpecs)."""
    nodes = [u.gpu.node for u in units]
    nodes += [n for key, n in sorted(inventory.control_devices.items()) if key in ("nvidiactl", "nvidia-uvm",
                                                                                   "nvidia-uvm-tools")]  # fmt: skip
    for unit in units:
        if unit.mig is not None:
            nodes += [unit.mig.gi_cap, unit.mig.ci_cap]
    seen, specs = set(), []
    for node in nodes:
        if node.path not in seen and node.problem is None:
            seen.add(node.path)
            host = host_path(inventory.dev_root, node.path)
            specs.append((node.path, host, "rw"))
    return tuple(specs)


def allocate(resource, ids, config, inventory, cdi_kind: str) -> ContainerAllocation:
    """What the runtime is told for one container given ids of resource; AllocationError for an
    id this resource does not have, or a count it refuses."""
    units = _units(resource, ids)
    names = [u.uuid if config.id_strategy == "uuid" else u.index for u in units]
    envs, mounts, annotations, cdi = {}, [], {}, ()
    strategies = config.list_strategies
    if "envvar" in strategies:
        envs[VISIBLE_DEVICES] = ",".join(names)
    if "volume-mounts" in strategies:
        envs[VISIBLE_DEVICES] = VOLUME_MOUNT_DIR
        mounts += [(f"{VOLUME_MOUNT_DIR}/{name}", "/dev/null", True) for name in names]
    if "cdi-annotations" in strategies:
        key = CDI_ANNOTATION_PREFIX + CDI_ANNOTATION_NAME + resource.name.replace("/", "_")
        annotations[key] = ",".join(f"{cdi_kind}={name}" for name in names)
    if "cdi-cri" in strategies:
        cdi = tuple(f"{cdi_kind}={name}" for name in names)
    if VISIBLE_DEVICES not in envs:
        envs[VISIBLE_DEVICES] = "void"
    if resource.memory_limit:
        envs[memory_limit.ENV] = resource.memory_limit
        mounts.append((f"{memory_limit.MOUNT_DIR}/{resource.memory_limit}", "/dev/null", True))
    devices = _device_specs(inventory, units) if config.pass_device_specs else ()
    return ContainerAllocation(envs, tuple(mounts), devices, annotations, cdi)
