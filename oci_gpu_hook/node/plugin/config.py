"""The device plugin's configuration file: the `version: v1` format users know from NVIDIA's
device plugin (flags.migStrategy, flags.plugin.*, sharing.timeSlicing.*), plus one key of ours:
`memoryLimit` on a time-sliced resource. Parsed and checked in full before the plugin starts, so
a mistake is one line naming the file and the key, and a non-zero exit. Pure: no I/O but the read.

Keys NVIDIA's plugin has and this one does not (per-resource `rename` and `devices` subsets, GDS
and MOFED flags, ...) are refused by name, and values it has that this one does not (Tegra
discovery, GDRCopy, ...) by value, each with its reason, rather than ignored: a
configuration that silently means something else on this node is worse than one that does not
start. `sharing.mps` (MPS replicas, mps.py) and `imex` (IMEX channels) are honoured.
"""

from __future__ import annotations

import os
import re

from oci_gpu_hook.errors import ConfigError, RequestError, printable
from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.start import memory_limit, settings

MIG_STRATEGIES = ("none", "single", "mixed")
# How Allocate tells the runtime which GPUs to give (docs/kubernetes.md, "Allocate answers").
LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
ID_STRATEGIES = ("uuid", "index")
GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
SHARED_SUFFIX = ".shared"
# A MIG profile in a resource name: <compute slices>g.<memory>gb, then attributes, which NVML
# writes with + (1g.10gb+me) and resource names with . (Kubernetes allows no +).
MIG_PROFILE = re.compile(r"^[1-9][0-9]?g\.[1-9][0-9]{0,3}gb(\.[a-z][a-z0-9]*)*$")


def mig_resource(profile: str) -> str:
    """nvidia.com/mig-1g.10gb.me for NVML's profile 1g.10gb+me."""
    return MIG_RESOURCE_PREFIX + profile.replace("+", ".")


PER_REPLICA = memory_limit.PER_REPLICA  # the same word as the hook's shared_gpu_memory_limit
MAX_REPLICAS = 1024


class TimeSlicedResource(Frozen):
    __slots__ = ("name", "replicas", "memory_limit")
    name: str  # nvidia.com/gpu or nvidia.com/mig-<profile>, before any .shared rename
    replicas: int
    memory_limit: str | None  # per-replica, or a memory_limit.py size or percentage


# XID health (xid_watch.py): which XIDs make a GPU Unhealthy. NVIDIA's plugin counts every XID
# but these, which its source calls application errors (the GPU itself is fine): 13 graphics engine
# exception, 31 GPU memory page fault, 43 GPU stopped processing, 45 preemptive cleanup, 68 video
# processor exception, 109 context switch timeout.
ALL_XIDS = "all"
APPLICATION_XIDS = (13, 31, 43, 45, 68, 109)


def _xid_health(doc: dict) -> dict:
    """PluginConfig's XID fields from the `health` section (schema-checked before)."""
    health = doc.get("health") or {}
    critical = health.get("criticalXids", ALL_XIDS)
    ignored = health.get("ignoredXids")
    return {
        "critical_xids": critical if critical == ALL_XIDS else tuple(sorted(set(critical or ()))),
        "ignored_xids": APPLICATION_XIDS if ignored is None else tuple(sorted(set(ignored))),
    }


class PluginConfig(Frozen):
    __slots__ = ("mig_strategy", "list_strategies", "id_strategy", "pass_device_specs", "rename_by_default",
                 "fail_requests_greater_than_one", "time_slicing", "mps", "mps_root", "imex_channels",
                 "imex_required", "critical_xids", "ignored_xids", "allocation_policy")  # fmt: skip
    _defaults = {"list_strategies": ("envvar",), "id_strategy": "uuid", "pass_device_specs": False,
                 "rename_by_default": False, "fail_requests_greater_than_one": False, "time_slicing": (),
                 "mps": (), "mps_root": None, "imex_channels": (), "imex_required": False,
                 "critical_xids": ALL_XIDS, "ignored_xids": APPLICATION_XIDS,
                 "allocation_policy": "distributed"}  # fmt: skip
    mig_strategy: str
    list_strategies: tuple  # of LIST_STRATEGIES, in the order given
    id_strategy: str
    pass_device_specs: bool
    rename_by_default: bool
    fail_requests_greater_than_one: bool
    time_slicing: tuple  # TimeSlicedResource
    mps: tuple  # TimeSlicedResource (memory_limit None): the resources shared through MPS
    mps_root: str | None  # flags.mpsRoot: the host directory of the MPS daemons' pipe and log directories
    imex_channels: tuple  # imex.channelIDs: the IMEX channel numbers every container is given
    imex_required: bool  # imex.required: a missing channel stops the start rather than being skipped
    critical_xids: object  # health.criticalXids: ALL_XIDS, or a tuple of the XIDs that make a GPU Unhealthy
    ignored_xids: tuple  # health.ignoredXids: XIDs that never do (default: NVIDIA's application XIDs)
    allocation_policy: str  # flags.plugin.sharedDevicesAllocationPolicy: distributed or packed

    def sharing(self, name: str) -> TimeSlicedResource | None:
        return next((r for r in self.time_slicing + self.mps if r.name == name), None)

    @property
    def sharing_strategy(self) -> str:
        """GFD's word for it (the gpu.sharing-strategy label): mps, time-slicing or none."""
        if self.mps:
            return "mps"
        return "time-slicing" if any(r.replicas > 1 for r in self.time_slicing) else "none"


# Keys NVIDIA's plugin has that this one refuses, each with what it would mean here, by where they
# sit (the schema, schemas/device-plugin.schema.json, knows the keys that are taken). Checked
# first: a refused key gets its reason, not "unknown key".
_REFUSED = {
    ("flags",): {"nvidiaDriverRoot": "the driver's root is driver_root in oci-gpu-hook's own configuration",
                 "nvidiaDevRoot": "the device nodes' root is dev_root in oci-gpu-hook's own configuration",
                 "gdsEnabled": "GPUDirect Storage is not set up by oci-gpu-hook",
                 "mofedEnabled": "MOFED devices are not set up by oci-gpu-hook",
                 "gfd": "labels come from `oci-gpu-hook labels` (node.* settings)"},
    ("flags", "plugin"): {
        "containerDriverRoot": "the hook mounts the driver from driver_root; there is no container driver root",
        "cdiAnnotationPrefix": "the CDI annotations are named cdi.k8s.io/oci-gpu-hook_<resource>",
        "nvidiaCTKPath": "oci-gpu-hook's CDI hooks run oci-gpu-hook itself"},
    ("sharing", "timeSlicing", "resources", 0): {"rename": "per-resource rename is not offered; use renameByDefault"},
    ("sharing", "mps", "resources", 0): {
        "rename": "per-resource rename is not offered; use renameByDefault",
        "memoryLimit": "MPS pins each client's memory to the GPU's memory / replicas itself; memoryLimit is for "
                       "timeSlicing"},
}  # fmt: skip
# Values of keys NVIDIA's v0.20 has that this plugin refuses, each with its reason: (where, the
# value that is refused, why). Other values of these keys are what this plugin does anyway.
_REFUSED_VALUES = (
    (("flags", "gdrcopyEnabled"), True, "GDRCopy (/dev/gdrdrv) is not set up by oci-gpu-hook"),
    (("flags", "useNodeFeatureAPI"), True,
     "labels are an NFD feature file written by `oci-gpu-hook labels`; NFD's NodeFeature API is not used"),
    (("flags", "deviceDiscoveryStrategy"), "tegra",
     "Tegra's integrated GPUs are not discovered by oci-gpu-hook (auto and nvml are: procfs and NVML)"),
)  # fmt: skip
DEFAULT_MPS_ROOT = "/run/nvidia/mps"  # NVIDIA's Helm chart's mpsRoot
MAX_IMEX_CHANNEL = 2047  # the driver makes 2048 IMEX channels (NVreg_ImexChannelCount's default)
SCHEMA_PATH = os.path.join(settings.SCHEMAS_DIR, "device-plugin.schema.json")


def _fail(where: str, key: str, problem: str):
    raise ConfigError(f"{where}: {key}: {problem}")


def _refused(doc: dict, where: str) -> None:
    """ConfigError for the first key NVIDIA's plugin has and this one refuses."""

    def at(node, keys):
        for key in keys:
            if isinstance(key, int):
                if not isinstance(node, list):
                    return []
                return [(i, item) for i, item in enumerate(node) if isinstance(item, dict)]
            node = node.get(key) if isinstance(node, dict) else None
        return [(None, node)] if isinstance(node, dict) else []

    for keys, reasons in _REFUSED.items():
        for index, node in at(doc, keys):
            for name in node:
                if name in reasons:
                    path = [k if not isinstance(k, int) else index for k in keys] + [name]
                    _fail(where, settings.key_path(path), reasons[name])


def _refused_values(doc: dict, where: str) -> None:
    """ConfigError for the first value NVIDIA's plugin takes that this one refuses (the keys of
    v0.20 that this plugin knows but does not follow in every value)."""

    def get(keys):
        node = doc
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        return node

    for keys, value, reason in _REFUSED_VALUES:
        found = get(keys)
        if found is value or (isinstance(value, str) and found == value):
            _fail(where, settings.key_path(list(keys)), f"{value if isinstance(value, str) else 'true'}: {reason}")
    resources = doc.get("resources")
    if resources not in (None, {}, []) and not (isinstance(resources, dict) and not any(resources.values())):
        # NVIDIA's v0.20 ignores it with a warning (renaming resources is disabled there too).
        _fail(where, "resources", "naming resources by GPU model (resources.gpus, resources.mig) is not offered; "
                                  "the resources are nvidia.com/gpu and nvidia.com/mig-<profile>")  # fmt: skip
    for strategy in ("timeSlicing", "mps"):
        entries = get(("sharing", strategy, "resources"))
        for i, entry in enumerate(entries if isinstance(entries, list) else ()):
            if isinstance(entry, dict) and "devices" in entry and entry["devices"] != "all":
                _fail(where, f"sharing.{strategy}.resources[{i}].devices",
                      "sharing a subset of the devices is not offered; each device of the resource is shared "
                      "(devices: all)")  # fmt: skip


def _mps(doc: dict, where: str, time_slicing: tuple) -> tuple:
    """The MPS-shared resources: nvidia.com/gpu only (NVIDIA's plugin refuses MPS on MIG devices),
    at least 2 replicas, and never beside time-slicing (NVIDIA's silently prefers MPS)."""
    mps = (doc.get("sharing") or {}).get("mps") or {}
    seen: set = set()
    resources = tuple(_resource(e, where, f"sharing.mps.resources[{i}]", seen)
                      for i, e in enumerate(mps.get("resources") or ()))  # fmt: skip
    for i, resource in enumerate(resources):
        key = f"sharing.mps.resources[{i}]"
        if resource.name != GPU_RESOURCE:
            _fail(where, f"{key}.name", f"{resource.name}: MPS shares whole GPUs ({GPU_RESOURCE}); "
                                        "sharing MIG devices through MPS is not supported")  # fmt: skip
        if resource.replicas < 2:
            _fail(where, f"{key}.replicas", f"{resource.replicas}: MPS sharing needs at least 2 replicas")
    if resources and time_slicing:
        _fail(where, "sharing.mps", "a node shares its GPUs one way: sharing.mps or sharing.timeSlicing, not both")
    return resources


def check_resource_name(name: str, where: str, key: str) -> None:
    """nvidia.com/gpu, or nvidia.com/mig-<profile> with a profile in NVML's form."""
    if name == GPU_RESOURCE:
        return
    if name.startswith(MIG_RESOURCE_PREFIX):
        profile = name[len(MIG_RESOURCE_PREFIX) :]
        if MIG_PROFILE.match(profile):
            return
        _fail(where, key, f"{printable(name[:80])!r}: unknown MIG profile {printable(profile[:40])!r}; "
                          "a MIG profile reads like 1g.5gb, 3g.20gb or 1g.10gb.me")  # fmt: skip
    _fail(where, key, f"{printable(name[:80])!r} is not a resource this plugin offers; use {GPU_RESOURCE} "
                      f"or {MIG_RESOURCE_PREFIX}<profile>")  # fmt: skip


def _resource(entry: dict, where: str, key: str, seen: set) -> TimeSlicedResource:
    name = entry["name"]
    check_resource_name(name, where, f"{key}.name")
    if name in seen:
        _fail(where, f"{key}.name", f"{name} is listed twice")
    seen.add(name)
    limit = entry.get("memoryLimit")
    if limit is not None:
        limit = limit.strip()
        if limit != PER_REPLICA:
            try:
                memory_limit.parse(limit, f"{key}.memoryLimit")
            except RequestError as e:
                _fail(where, f"{key}.memoryLimit", e.message.partition(": ")[2] or e.message)
    return TimeSlicedResource(name, entry["replicas"], limit)


def parse(doc, where: str) -> PluginConfig:
    """The configuration from a loaded YAML or JSON document; ConfigError naming where and the key,
    in the main configuration's words (settings.describe_error, against the schema)."""
    if doc is None:
        doc = {}
    if isinstance(doc, dict):
        _refused(doc, where)
        _refused_values(doc, where)
    settings.validate(doc, where, SCHEMA_PATH)
    flags = doc.get("flags") or {}
    plugin = flags.get("plugin") or {}
    time_slicing = (doc.get("sharing") or {}).get("timeSlicing") or {}
    lists = plugin.get("deviceListStrategy", "envvar")
    lists = [lists] if isinstance(lists, str) else lists
    seen: set = set()
    resources = tuple(_resource(e, where, f"sharing.timeSlicing.resources[{i}]", seen)
                      for i, e in enumerate(time_slicing.get("resources") or ()))  # fmt: skip
    mig_strategy = flags.get("migStrategy") or "none"
    for i, resource in enumerate(resources):
        if resource.name.startswith(MIG_RESOURCE_PREFIX) and mig_strategy != "mixed":
            _fail(where, f"sharing.timeSlicing.resources[{i}].name",
                  f"{resource.name} exists only with flags.migStrategy mixed (it is {mig_strategy})")  # fmt: skip
    mps = _mps(doc, where, resources)
    mps_options = (doc.get("sharing") or {}).get("mps") or {}
    imex = doc.get("imex") or {}
    sharing_options = mps_options if mps else time_slicing
    # As NVIDIA's: MPS replicas refuse a request for more than one unless the file says otherwise.
    fail_greater = sharing_options.get("failRequestsGreaterThanOne")
    return PluginConfig(
        mig_strategy=mig_strategy,
        list_strategies=tuple(dict.fromkeys(lists)),
        id_strategy=plugin.get("deviceIDStrategy") or "uuid",
        pass_device_specs=bool(plugin.get("passDeviceSpecs")),
        rename_by_default=bool(sharing_options.get("renameByDefault")),
        fail_requests_greater_than_one=bool(mps) if fail_greater is None else bool(fail_greater),
        time_slicing=resources,
        mps=mps,
        mps_root=os.path.normpath(flags.get("mpsRoot") or DEFAULT_MPS_ROOT) if mps else None,
        imex_channels=tuple(dict.fromkeys(imex.get("channelIDs") or ())),
        imex_required=bool(imex.get("required")),
        allocation_policy=plugin.get("sharedDevicesAllocationPolicy") or "distributed",
        **_xid_health(doc),
    )


def source(path: str | None) -> str:
    """Where the configuration load(path, ...) gives comes from, as its messages name it."""
    return path or "node settings (node.mig_strategy, node.replicas)"


def load(path: str | None, node_settings) -> PluginConfig:
    """The file's configuration; with no file, the node settings' mig_strategy and replicas (the
    values the labels use), so plugin and labels agree by default."""
    if path is None:
        sharing = ()
        if node_settings.replicas > 1:
            sharing = (TimeSlicedResource(GPU_RESOURCE, node_settings.replicas, None),)
        return PluginConfig(mig_strategy=node_settings.mig_strategy, time_slicing=sharing)
    text = settings.read_config_file(path, "the device plugin configuration")
    import yaml

    try:
        doc = settings.load_yaml(text, path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML or JSON{line}: {getattr(e, 'problem', None) or e}") from None
    except (ValueError, RecursionError) as e:  # an integer of thousands of digits; (a backstop) nesting
        raise ConfigError(f"{path}: not valid YAML or JSON: {settings.load_problem(e)}") from None
    settings.check_document_size(doc, path)
    return parse(doc, path)
