"""What the device plugin advertises: from the inventory and the plugin's configuration, the
Kubernetes resources (nvidia.com/gpu, nvidia.com/gpu.shared, nvidia.com/mig-<profile>) and the
device ids the kubelet sees for each, one per GPU or MIG device, or one per replica when the
resource is shared. Pure: the same inventory and configuration give the same answer, which is
how a re-read after a driver change is compared with what was advertised. The node's labels
describe these same resources (node/features.py), so that the labels and the plugin never
disagree on what the node offers, nor on which configurations it refuses.

MIG strategies, as NVIDIA's plugin has them: `none` offers every GPU whole; `single` offers the
MIG devices as nvidia.com/gpu (every GPU must have MIG on with one profile; with MIG on nowhere it
offers the GPUs); `mixed` offers the GPUs without MIG as nvidia.com/gpu and each MIG profile as
nvidia.com/mig-<profile>.
"""

from __future__ import annotations

from oci_gpu_hook.errors import ConfigError
from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.node.plugin import config as plugin_config
from oci_gpu_hook.node.plugin.config import GPU_RESOURCE, MIG_RESOURCE_PREFIX, SHARED_SUFFIX
from oci_gpu_hook.start.inventory import device_key

REPLICA_SEPARATOR = "::"


class Unit(Frozen):
    """One GPU or MIG device: what a container gets for one of its ids."""

    __slots__ = ("uuid", "index", "gpu", "mig")
    uuid: str  # GPU-... or MIG-... (for a MIG device without NVML: <gpu uuid>/gi<n>)
    index: str  # NVIDIA_VISIBLE_DEVICES form: "2", or "0:1" for a MIG device
    gpu: object  # inventory.GpuInfo (the parent, for a MIG device)
    mig: object  # inventory.MigDevice or None

    @property
    def memory_total(self):
        return self.mig.memory_total if self.mig is not None else self.gpu.memory_total


class Advertised(Frozen):
    """One device id the kubelet sees."""

    __slots__ = ("id", "unit", "replica")
    id: str
    unit: Unit
    replica: int | None  # 0.. for a time-sliced resource


class Resource(Frozen):
    __slots__ = ("name", "devices", "replicas", "memory_limit", "fail_requests_greater_than_one", "mps_root",
                 "renamed")  # fmt: skip
    _defaults = {"mps_root": None, "renamed": False}
    name: str
    devices: tuple  # Advertised
    replicas: int
    memory_limit: str | None  # memory_limit.py text passed to each container, or None
    fail_requests_greater_than_one: bool
    mps_root: str | None  # shared through MPS: flags.mpsRoot, where its daemon's directories are (mps.py)
    renamed: bool  # name has the SHARED_SUFFIX that renameByDefault adds

    def find(self, device_id: str) -> Advertised | None:
        return next((d for d in self.devices if d.id == device_id), None)

    @property
    def configured_name(self) -> str:
        """The name the configuration knows it by: nvidia.com/gpu or nvidia.com/mig-<profile>."""
        return self.name[: -len(SHARED_SUFFIX)] if self.renamed else self.name

    @property
    def units(self) -> tuple:
        """Each GPU or MIG device once, in the order advertised (a replica's is its unit's)."""
        return tuple({d.unit.uuid: d.unit for d in self.devices}.values())

    @property
    def sharing_strategy(self) -> str:
        """GFD's word for how it is shared: none, time-slicing or mps."""
        if self.replicas == 1:
            return "none"
        return "mps" if self.mps_root else "time-slicing"


def _gpu_unit(gpu) -> Unit:
    return Unit(gpu.uuid, str(gpu.index), gpu, None)


def _mig_unit(gpu, mig) -> Unit:
    return Unit(device_key(gpu, mig), f"{gpu.index}:{mig.index}", gpu, mig)


def _groups(inventory, strategy: str, where: str) -> dict:
    """{base resource name: [Unit]} under the MIG strategy."""
    gpus = list(inventory.gpus)
    if strategy == "none":
        return {GPU_RESOURCE: [_gpu_unit(g) for g in gpus]}
    if strategy == "single":
        migs = [(g, m) for g in gpus for m in g.mig]
        if not migs:
            return {GPU_RESOURCE: [_gpu_unit(g) for g in gpus]}
        profiles = {m.profile for _, m in migs}
        if any(not g.mig for g in gpus) or len(profiles) != 1 or None in profiles:
            found = ", ".join(sorted(p or "unknown" for p in profiles))
            raise ConfigError(f"{where}: flags.migStrategy single needs MIG on every GPU with one profile; "
                              f"this node has {sum(1 for g in gpus if not g.mig)} GPUs without MIG and "
                              f"MIG profiles {found}; use mixed")  # fmt: skip
        return {GPU_RESOURCE: [_mig_unit(g, m) for g, m in migs]}
    groups = {GPU_RESOURCE: [_gpu_unit(g) for g in gpus if not g.mig]}
    for gpu in gpus:
        for mig in gpu.mig:
            if mig.profile is None:
                raise ConfigError(f"{where}: flags.migStrategy mixed needs each MIG device's profile, and NVML "
                                  f"did not report the profile of MIG device {gpu.index}:{mig.index}")  # fmt: skip
            groups.setdefault(plugin_config.mig_resource(mig.profile), []).append(_mig_unit(gpu, mig))
    return groups


def _id(unit: Unit, id_strategy: str, replica: int | None) -> str:
    base = unit.uuid if id_strategy == "uuid" else unit.index
    return base if replica is None else f"{base}{REPLICA_SEPARATOR}{replica}"


def resources(inventory, config, where: str = "device plugin configuration") -> tuple:
    """The Resources to register, by name; ConfigError when the configuration does not fit this
    node (a MIG strategy its GPUs cannot follow, a shared MIG profile it does not have)."""
    groups = _groups(inventory, config.mig_strategy, where)
    for i, shared in enumerate(config.time_slicing):
        if shared.name.startswith(MIG_RESOURCE_PREFIX) and shared.name not in groups:
            have = ", ".join(sorted(n[len(MIG_RESOURCE_PREFIX) :] for n in groups if n != GPU_RESOURCE)) or "none"
            raise ConfigError(f"{where}: sharing.timeSlicing.resources[{i}].name: unknown MIG profile: no MIG "
                              f"device on this node has profile {shared.name[len(MIG_RESOURCE_PREFIX):]} "
                              f"(profiles here: {have})")  # fmt: skip
    if config.mps and config.mig_strategy == "single" and any(u.mig for u in groups.get(GPU_RESOURCE, ())):
        raise ConfigError(f"{where}: sharing.mps: under flags.migStrategy single this node's {GPU_RESOURCE} are "
                          "MIG devices, and sharing MIG devices through MPS is not supported")  # fmt: skip
    out = []
    for name in sorted(groups):
        units = groups[name]
        # Under mixed, a node whose GPUs all have MIG on offers no nvidia.com/gpu at all (as
        # NVIDIA's plugin does), rather than registering it with no devices.
        if not units and (name != GPU_RESOURCE or config.mig_strategy == "mixed"):
            continue
        shared = config.sharing(name)
        limit = _limit(shared, units, where, config.time_slicing.index(shared) if shared in config.time_slicing else 0)
        if shared is None or shared.replicas == 1:
            devices = tuple(Advertised(_id(u, config.id_strategy, None), u, None) for u in units)
            out.append(Resource(name, devices, 1, limit, False))
            continue
        devices = tuple(Advertised(_id(u, config.id_strategy, r), u, r) for u in units for r in range(shared.replicas))
        mps_root = config.mps_root if shared in config.mps else None
        renamed = config.rename_by_default
        out.append(Resource(name + (SHARED_SUFFIX if renamed else ""), devices, shared.replicas, limit,
                            config.fail_requests_greater_than_one, mps_root, renamed))  # fmt: skip
    return tuple(out)


def _limit(shared, units, where: str, position: int) -> str | None:
    """The memory limit text each container of the resource gets: per-replica as a percentage of
    its device (the hook applies it to whichever device it gets); a size larger than one of the
    resource's devices is refused here, as the hook would refuse every container given it."""
    if shared is None or shared.memory_limit is None:
        return None
    if shared.memory_limit == plugin_config.PER_REPLICA:
        return f"{100 / shared.replicas:.4f}".rstrip("0").rstrip(".") + "%"
    from oci_gpu_hook.start import memory_limit

    kind, amount = memory_limit.parse(shared.memory_limit, "memoryLimit")
    for unit in units:
        if kind == "bytes" and unit.memory_total is not None and amount > unit.memory_total:
            raise ConfigError(f"{where}: sharing.timeSlicing.resources[{position}].memoryLimit: "
                              f"{shared.memory_limit} is more than {unit.uuid}'s "
                              f"{unit.memory_total >> 20} MiB")  # fmt: skip
    return shared.memory_limit
