"""The device plugin's configuration file: the `version: v1` format users know from NVIDIA's
device plugin (flags.migStrategy, flags.plugin.*, sharing.timeSlicing.*), plus one key of ours:
`memoryLimit` on a time-sliced resource. Parsed and checked in full before the plugin starts, so
a mistake is one line naming the file and the key, and a non-zero exit. Pure: no I/O but the read.

Keys NVIDIA's plugin has and this one does not (MPS sharing, per-resource `rename` and `devices`
subsets, GDS and MOFED flags) are refused by name rather than ignored: a configuration that
silently means something else on this node is worse than one that does not start.
"""

from __future__ import annotations

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


# Known keys at each level; the value says what a key NVIDIA's plugin has and we refuse means.
_TOP = {"version": None, "flags": None, "sharing": None}
# failOnInitError is taken and has no effect: this plugin always stops on a configuration error.
_FLAGS = {"migStrategy": None, "failOnInitError": None, "plugin": None,
          "nvidiaDriverRoot": "the driver's root is driver_root in oci-gpu-hook's own configuration",
          "gdsEnabled": "GPUDirect Storage is not set up by oci-gpu-hook",
          "mofedEnabled": "MOFED devices are not set up by oci-gpu-hook",
          "gfd": "labels come from `oci-gpu-hook labels` (node.* settings)"}  # fmt: skip
_PLUGIN = {"passDeviceSpecs": None, "deviceListStrategy": None, "deviceIDStrategy": None,
           "containerDriverRoot": "the hook mounts the driver from driver_root; there is no container driver root",
           "cdiAnnotationPrefix": "the CDI annotations are named cdi.k8s.io/oci-gpu-hook_<resource>",
           "nvidiaCTKPath": "oci-gpu-hook's CDI hooks run oci-gpu-hook itself"}  # fmt: skip
_SHARING = {"timeSlicing": None, "mps": "MPS sharing is not offered by oci-gpu-hook; use timeSlicing"}
_TIME_SLICING = {"renameByDefault": None, "failRequestsGreaterThanOne": None, "resources": None}
_RESOURCE = {"name": None, "replicas": None, "memoryLimit": None,
             "rename": "per-resource rename is not offered; use renameByDefault",
             "devices": "time-slicing a subset of the devices is not offered; each device of the resource "
                        "is shared"}  # fmt: skip


def shown(value) -> str:
    """A value in an error message, in bounded time and space: a scalar as repr() writes it, cut
    short; a list or mapping by its kind only. The document may be hostile: repr() of a YAML alias
    bomb is exponential, of a deeply nested list a RecursionError."""
    if isinstance(value, str):
        text = repr(value[:40]) + ("..." if len(value) > 40 else "")
    elif value is None or isinstance(value, (bool, int, float)):
        text = repr(value) if not isinstance(value, int) or value.bit_length() < 128 else "a very large number"
    else:
        text = {list: "a list", dict: "a mapping"}.get(type(value), f"a {type(value).__name__}")
    return printable(text)


def _fail(where: str, key: str, problem: str):
    raise ConfigError(f"{where}: {key}: {problem}")


def _mapping(value, where: str, key: str, known: dict) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        _fail(where, key or "the document", f"expected a mapping, found {type(value).__name__}")
    for name in value:
        if name not in known:
            _fail(where, f"{key}.{printable(str(name))}" if key else printable(str(name)),
                  f"unknown key; known: {', '.join(k for k in known if not known[k])}")  # fmt: skip
        if known[name]:
            _fail(where, f"{key}.{name}" if key else name, known[name])
    return value


def _bool(value, where: str, key: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        _fail(where, key, f"expected true or false, found {shown(value)}")
    return value


def _choice(value, where: str, key: str, choices: tuple, default: str) -> str:
    if value is None:
        return default
    if value not in choices:
        _fail(where, key, f"{shown(value)} is not one of {', '.join(choices)}")
    return value


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


def _resource(entry, where: str, key: str, seen: set) -> TimeSlicedResource:
    entry = _mapping(entry, where, key, _RESOURCE)
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        _fail(where, f"{key}.name", "missing; give the resource to share, e.g. nvidia.com/gpu")
    check_resource_name(name, where, f"{key}.name")
    if name in seen:
        _fail(where, f"{key}.name", f"{name} is listed twice")
    seen.add(name)
    replicas = entry.get("replicas")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas <= MAX_REPLICAS:
        _fail(where, f"{key}.replicas", f"{shown(replicas)}: expected a whole number from 1 to "
                                        f"{MAX_REPLICAS}")  # fmt: skip
    limit = entry.get("memoryLimit")
    if limit is not None:
        if not isinstance(limit, str) or not limit.strip():
            _fail(where, f"{key}.memoryLimit", f"expected {PER_REPLICA}, a size (4GiB) or a percentage (25%)")
        limit = limit.strip()
        if limit != PER_REPLICA:
            try:
                memory_limit.parse(limit, f"{key}.memoryLimit")
            except RequestError as e:
                _fail(where, f"{key}.memoryLimit", e.message.partition(": ")[2] or e.message)
    return TimeSlicedResource(name, replicas, limit)


def parse(doc, where: str) -> PluginConfig:
    """The configuration from a loaded YAML or JSON document; ConfigError naming where and the key."""
    if doc is None:
        doc = {}
    top = _mapping(doc, where, "", _TOP)
    version = top.get("version", "v1")
    if version != "v1":
        _fail(where, "version", f"{shown(version)}: only v1 is understood")
    flags = _mapping(top.get("flags"), where, "flags", _FLAGS)
    plugin = _mapping(flags.get("plugin"), where, "flags.plugin", _PLUGIN)
    lists = plugin.get("deviceListStrategy", "envvar")
    lists = [lists] if isinstance(lists, str) else lists
    if not isinstance(lists, list) or not lists:
        _fail(where, "flags.plugin.deviceListStrategy", f"expected one of {', '.join(LIST_STRATEGIES)}, or a list")
    for value in lists:
        _choice(value, where, "flags.plugin.deviceListStrategy", LIST_STRATEGIES, "")
    time_slicing = _mapping(_mapping(top.get("sharing"), where, "sharing", _SHARING).get("timeSlicing"), where,
                            "sharing.timeSlicing", _TIME_SLICING)  # fmt: skip
    entries = time_slicing.get("resources")
    entries = [] if entries is None else entries
    if not isinstance(entries, list):
        _fail(where, "sharing.timeSlicing.resources", "expected a list of {name, replicas}")
    seen: set = set()
    resources = tuple(_resource(e, where, f"sharing.timeSlicing.resources[{i}]", seen) for i, e in enumerate(entries))
    mig_strategy = _choice(flags.get("migStrategy"), where, "flags.migStrategy", MIG_STRATEGIES, "none")
    for i, resource in enumerate(resources):
        if resource.name.startswith(MIG_RESOURCE_PREFIX) and mig_strategy != "mixed":
            _fail(where, f"sharing.timeSlicing.resources[{i}].name",
                  f"{resource.name} exists only with flags.migStrategy mixed (it is {mig_strategy})")  # fmt: skip
    return PluginConfig(
        mig_strategy=mig_strategy,
        list_strategies=tuple(dict.fromkeys(lists)),
        id_strategy=_choice(
            plugin.get("deviceIDStrategy"), where, "flags.plugin.deviceIDStrategy", ID_STRATEGIES, "uuid"
        ),
        pass_device_specs=_bool(plugin.get("passDeviceSpecs"), where, "flags.plugin.passDeviceSpecs", False),
        rename_by_default=_bool(
            time_slicing.get("renameByDefault"), where, "sharing.timeSlicing.renameByDefault", False
        ),
        fail_requests_greater_than_one=_bool(
            time_slicing.get("failRequestsGreaterThanOne"),
            where,
            "sharing.timeSlicing.failRequestsGreaterThanOne",
            False,
        ),
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
        doc = settings.load_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML or JSON{line}: {getattr(e, 'problem', None) or e}") from None
    except (ValueError, RecursionError) as e:  # an integer of thousands of digits; nesting past the stack
        raise ConfigError(f"{path}: not valid YAML or JSON: {settings.load_problem(e)}") from None
    settings.check_document_size(doc, path)
    return parse(doc, path)
