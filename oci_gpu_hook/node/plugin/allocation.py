"""The device plugin's answers to the kubelet, as plain data: which ids to prefer for a container
(GetPreferredAllocation), and what the runtime must be told so that the container gets exactly
the allocated GPUs (Allocate). Pure; service.py turns these into the API's messages.

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

A resource shared through MPS adds its daemon's directories and the client's limits (mps.py).
IMEX channels (the configuration's imex.channelIDs) go to every container, as NVIDIA's plugin
gives them: NVIDIA_IMEX_CHANNELS=<n,...> with envvar, /var/run/nvidia-container-devices/imex/<n>
mounts with volume-mounts (the hook reads both), and the channel device nodes themselves
(/dev/nvidia-caps-imex-channels/channel<n>) with passDeviceSpecs or when only CDI strategies are
set, for the runtime to create.

A GPU memory limit on a time-sliced resource travels twice: as OCI_GPU_HOOK_GPU_MEMORY_LIMIT, for
the program to read, and as a mount at /var/run/oci-gpu-hook/gpu-memory-limit/<limit>, which the
pod cannot remove. The hook takes the smallest limit it is given (memory_limit.py), so a pod may
lower its share but not raise it; the watchdog enforces what the hook recorded.
"""

from __future__ import annotations

from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.start import memory_limit
from oci_gpu_hook.start.inventory import host_path
from oci_gpu_hook.start.request import CDI_ANNOTATION_PREFIX, IMEX_CHANNELS, IMEX_VOLUME_MOUNT_DIR, VISIBLE_DEVICES
from oci_gpu_hook.start.spec import VOLUME_MOUNT_DIR

CDI_ANNOTATION_NAME = "oci-gpu-hook_"


class AllocationError(Exception):
    """The kubelet asked for something this resource cannot give: the gRPC call fails with it."""


class ContainerAllocation(Frozen):
    __slots__ = ("envs", "mounts", "devices", "annotations", "cdi_devices")
    envs: dict
    mounts: tuple  # (container path, host path, read only)
    devices: tuple  # (container path, host path, permissions)
    annotations: dict
    cdi_devices: tuple  # fully qualified CDI names


def preferred(resource, available, must_include, size: int, topology=None, policy: str = "distributed") -> list:
    """size ids from available, must_include first. Whole GPUs (not shared, not MIG) then go by
    topology (topology.best: NVLinks, then the nearest common PCIe ancestor, with the
    must-include ones). The rest by policy (flags.plugin.sharedDevicesAllocationPolicy), as
    NVIDIA's plugin means it:
    - distributed: spread the container over distinct GPUs, then over the GPUs with the most
      replicas still free: time-sliced pods land on the least shared GPU, and a container asking
      for two gets two GPUs where it can.
    - packed: the GPU with the most of its devices already allocated (to other containers, or
      just now to this one) first, so that shared devices fill as few GPUs as they can and the
      others stay free for whole-GPU work. A MIG device counts for its GPU: packing is onto
      physical GPUs."""
    chosen = [i for i in dict.fromkeys(must_include) if resource.find(i) is not None][:size]
    packed = policy == "packed"
    free: dict = {}
    total: dict = {}  # packed: each GPU's devices in this resource, allocated or not
    for device in resource.devices:
        key = _gpu_key(device, packed)
        total[key] = total.get(key, 0) + 1
    for device_id in available:
        device = resource.find(device_id)
        if device is not None and device_id not in chosen:
            free.setdefault(_gpu_key(device, packed), []).append(device_id)
    used = {_gpu_key(resource.find(i), packed) for i in chosen}
    order: dict = {}  # inventory order breaks ties
    for device in resource.devices:
        order.setdefault(_gpu_key(device, packed), len(order))
    if topology is not None and resource.replicas == 1 and all(d.unit.mig is None for d in resource.devices):
        from oci_gpu_hook.node.plugin.topology import best

        candidates = sorted((u for u in free if free[u] and u not in used), key=lambda u: order.get(u, 0))
        for uuid in best(candidates, sorted(used), size - len(chosen), topology):
            chosen.append(free[uuid].pop(0))
            used.add(uuid)

    def rank(u):
        if packed:  # the most allocated first: what is not free (taken, chosen, or not offered)
            return -(total[u] - len(free[u])), order.get(u, 0)
        return u in used, -len(free[u]), order.get(u, 0)

    while len(chosen) < size and any(free.values()):
        uuid = min((u for u in free if free[u]), key=rank)
        chosen.append(free[uuid].pop(0))
        used.add(uuid)
    return chosen


def _gpu_key(device, physical: bool) -> str:
    """What the policy counts devices by: their physical GPU (packed), or the unit they give."""
    return device.unit.gpu.uuid if physical else device.unit.uuid


def _units(resource, ids) -> list:
    units = []
    for device_id in ids:
        device = resource.find(device_id)
        if device is None:
            raise AllocationError(f"{resource.name}: unknown device id {device_id[:80]!r}")
        units.append(device.unit)
    if resource.replicas > 1 and resource.fail_requests_greater_than_one and len(ids) > 1:
        if resource.mps_root:  # the key's default is true for MPS (config.parse)
            raise AllocationError(f"{resource.name}: a container may ask for 1 MPS replica, not {len(ids)} "
                                  "(sharing.mps.failRequestsGreaterThanOne, true unless set false)")  # fmt: skip
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
    if resource.mps_root:
        from oci_gpu_hook.node.plugin import mps

        mps_envs, mps_mounts = mps.client_answer(resource, sorted(units, key=lambda u: u.index))
        envs.update(mps_envs)
        mounts += mps_mounts
    devices = _device_specs(inventory, units) if config.pass_device_specs else ()
    channels = imex_nodes(config, inventory)
    if channels:
        numbers = [str(n) for n, _ in channels]
        if "envvar" in strategies:
            envs[IMEX_CHANNELS] = ",".join(numbers)
        if "volume-mounts" in strategies:
            mounts += [(f"{IMEX_VOLUME_MOUNT_DIR}/{n}", "/dev/null", True) for n in numbers]
        if config.pass_device_specs or not {"envvar", "volume-mounts"} & set(strategies):
            devices += tuple((node.path, host_path(inventory.dev_root, node.path), "rw") for _, node in channels)
    return ContainerAllocation(envs, tuple(mounts), devices, annotations, cdi)


def imex_nodes(config, inventory, where: str | None = None) -> tuple:
    """((channel number, DeviceNode)) of the configured IMEX channels this host has; a channel
    it lacks is left out, or with imex.required and where given (the plugin's start), refused."""
    from oci_gpu_hook.errors import ConfigError

    found = []
    for number in config.imex_channels:
        node = inventory.imex_channels.get(str(number))
        problem = "missing" if node is None else node.problem
        if problem is None:
            found.append((number, node))
        elif config.imex_required and where is not None:
            raise ConfigError(f"{where}: imex.channelIDs: IMEX channel {number} "
                              f"(/dev/nvidia-caps-imex-channels/channel{number}): {problem}; it is required "
                              "(imex.required); create it with nvidia-modprobe -i " + str(number))  # fmt: skip
    return tuple(found)
