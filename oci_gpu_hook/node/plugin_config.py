"""The device plugin's configuration file: the `version: v1` format users know from NVIDIA's
device plugin (flags.migStrategy, flags.plugin.*, sharing.timeSlicing.*), plus one key of ours:
`memoryLimit` on a time-sliced resource. Parsed and checked in full before the plugin starts, so
a mistake is one line naming the file and the key, and a non-zero exit. Pure: no I/O but the read.

Keys NVIDIA's plugin has and this one does not (MPS sharing, per-resource `rename` and `devices`
subsets, GDS and MOFED flags) are refused by name rather than ignored: a configuration that
silently means something else on this node is worse than one that does not start.
"""

from __future__ import annotations

import os
import re

from oci_gpu_hook.errors import ConfigError, RequestError, printable
from oci_gpu_hook.record import Record
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


class TimeSlicedResource(Record):
    __slots__ = ("name", "replicas", "memory_limit")
    name: str  # nvidia.com/gpu or nvidia.com/mig-<profile>, before any .shared rename
    replicas: int
    memory_limit: str | None  # per-replica, or a memory_limit.py size or percentage


class PluginConfig(Record):
    __slots__ = ("mig_strategy", "list_strategies", "id_strategy", "pass_device_specs", "rename_by_default",
                 "fail_requests_greater_than_one", "time_slicing")  # fmt: skip
    _defaults = {"list_strategies": ("envvar",), "id_strategy": "uuid", "pass_device_specs": False,
                 "rename_by_default": False, "fail_requests_greater_than_one": False, "time_slicing": ()}  # fmt: skip
    mig_strategy: str
    list_strategies: tuple  # of LIST_STRATEGIES, in the order given
    id_strategy: str
    pass_device_specs: bool
    rename_by_default: bool
    fail_requests_greater_than_one: bool
    time_slicing: tuple  # TimeSlicedResource

    def sharing(self, name: str) -> TimeSlicedResource | None:
        return next((r for r in self.time_slicing if r.name == name), None)


# Keys NVIDIA's plugin has that this one refuses, each with what it would mean here, by where they
# sit (the schema, schemas/device-plugin.schema.json, knows the keys that are taken). Checked
# first: a refused key gets its reason, not "unknown key".
_REFUSED = {
    ("flags",): {"nvidiaDriverRoot": "the driver's root is driver_root in oci-gpu-hook's own configuration",
                 "gdsEnabled": "GPUDirect Storage is not set up by oci-gpu-hook",
                 "mofedEnabled": "MOFED devices are not set up by oci-gpu-hook",
                 "gfd": "labels come from `oci-gpu-hook labels` (node.* settings)"},
    ("flags", "plugin"): {
        "containerDriverRoot": "the hook mounts the driver from driver_root; there is no container driver root",
        "cdiAnnotationPrefix": "the CDI annotations are named cdi.k8s.io/oci-gpu-hook_<resource>",
        "nvidiaCTKPath": "oci-gpu-hook's CDI hooks run oci-gpu-hook itself"},
    ("sharing",): {"mps": "MPS sharing is not offered by oci-gpu-hook; use timeSlicing"},
    ("sharing", "timeSlicing", "resources", 0): {
        "rename": "per-resource rename is not offered; use renameByDefault",
        "devices": "time-slicing a subset of the devices is not offered; each device of the resource is shared"},
}  # fmt: skip
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
    return PluginConfig(
        mig_strategy=mig_strategy,
        list_strategies=tuple(dict.fromkeys(lists)),
        id_strategy=plugin.get("deviceIDStrategy") or "uuid",
        pass_device_specs=bool(plugin.get("passDeviceSpecs")),
        rename_by_default=bool(time_slicing.get("renameByDefault")),
        fail_requests_greater_than_one=bool(time_slicing.get("failRequestsGreaterThanOne")),
        time_slicing=resources,
    )


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
