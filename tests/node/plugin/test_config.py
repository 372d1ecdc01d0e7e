"""The device plugin's configuration file (plugin/config.py): NVIDIA's `version: v1` format as its
documentation shows it, our memoryLimit, and every mistake refused with one line that names the
file and the key. Pure: documents in, records or ConfigError out."""

import json

import pytest

from oci_gpu_hook.errors import ConfigError
from oci_gpu_hook.node.plugin import config as pc
from oci_gpu_hook.node.plugin.config import PluginConfig, TimeSlicedResource
from oci_gpu_hook.start.settings import NodeSettings

WHERE = "/etc/oci-gpu-hook/device-plugin.yaml"


def parse(doc):
    return pc.parse(doc, WHERE)


def refused(doc) -> str:
    with pytest.raises(ConfigError) as e:
        parse(doc)
    message = e.value.message
    assert "\n" not in message
    return message


def shared(*resources, **options) -> dict:
    """A sharing.timeSlicing document holding resources ({name, replicas, ...} mappings)."""
    return {"version": "v1", "sharing": {"timeSlicing": {**options, "resources": list(resources)}}}


# ---- defaults and NVIDIA's documented examples -------------------------------------------------


@pytest.mark.parametrize("doc", [None, {}, {"version": "v1"}, {"version": "v1", "flags": None, "sharing": None}])
def test_defaults(doc):
    config = parse(doc)
    assert config == PluginConfig(mig_strategy="none")
    assert (config.list_strategies, config.id_strategy) == (("envvar",), "uuid")
    assert not (config.pass_device_specs or config.rename_by_default or config.fail_requests_greater_than_one)
    assert config.time_slicing == () and config.sharing(pc.GPU_RESOURCE) is None


def test_nvidias_flags_example():
    """The README's example flags that this plugin honours, failOnInitError included (taken, and
    without effect: a configuration error always stops the start)."""
    config = parse({
        "version": "v1",
        "flags": {"migStrategy": "none", "failOnInitError": True,
                  "plugin": {"passDeviceSpecs": False, "deviceListStrategy": "envvar", "deviceIDStrategy": "uuid"}},
    })  # fmt: skip
    assert config == PluginConfig(mig_strategy="none")
    assert parse({"flags": {"failOnInitError": False}}) == PluginConfig(mig_strategy="none")


@pytest.mark.parametrize("strategy", ["none", "single", "mixed"])
def test_mig_strategies(strategy):
    assert parse({"version": "v1", "flags": {"migStrategy": strategy}}).mig_strategy == strategy


@pytest.mark.parametrize(
    "value, expected",
    [("envvar", ("envvar",)), ("volume-mounts", ("volume-mounts",)), ("cdi-annotations", ("cdi-annotations",)),
     ("cdi-cri", ("cdi-cri",)), (["envvar", "cdi-annotations"], ("envvar", "cdi-annotations")),
     (["cdi-cri", "volume-mounts", "cdi-cri"], ("cdi-cri", "volume-mounts"))],  # order kept, repeats once
)  # fmt: skip
def test_device_list_strategy_as_a_string_or_a_list(value, expected):
    assert parse({"flags": {"plugin": {"deviceListStrategy": value}}}).list_strategies == expected


@pytest.mark.parametrize("value", ["uuid", "index"])
def test_device_id_strategy(value):
    assert parse({"flags": {"plugin": {"deviceIDStrategy": value}}}).id_strategy == value


@pytest.mark.parametrize("value", [True, False])
def test_pass_device_specs(value):
    assert parse({"flags": {"plugin": {"passDeviceSpecs": value}}}).pass_device_specs is value


def test_time_slicing_as_nvidia_documents_it():
    config = parse(shared({"name": "nvidia.com/gpu", "replicas": 10}))
    assert config.time_slicing == (TimeSlicedResource("nvidia.com/gpu", 10, None),)
    assert config.sharing("nvidia.com/gpu").replicas == 10
    assert not config.rename_by_default and not config.fail_requests_greater_than_one


def test_time_slicing_with_mig_devices_and_every_option():
    doc = shared({"name": "nvidia.com/gpu", "replicas": 2}, {"name": "nvidia.com/mig-1g.5gb", "replicas": 2},
                 {"name": "nvidia.com/mig-2g.10gb", "replicas": 4}, renameByDefault=True,
                 failRequestsGreaterThanOne=True)  # fmt: skip
    doc["flags"] = {"migStrategy": "mixed"}
    config = parse(doc)
    assert config.rename_by_default and config.fail_requests_greater_than_one
    assert [(r.name, r.replicas) for r in config.time_slicing] == [
        ("nvidia.com/gpu", 2), ("nvidia.com/mig-1g.5gb", 2), ("nvidia.com/mig-2g.10gb", 4)]  # fmt: skip
    assert config.sharing("nvidia.com/mig-2g.10gb").replicas == 4
    assert config.sharing("nvidia.com/mig-3g.20gb") is None


@pytest.mark.parametrize("profile", ["1g.5gb", "3g.20gb", "7g.80gb", "1g.10gb.me", "1g.12gb.me.gfx", "1g.24gb.me.all"])
def test_mig_profiles_in_resource_name_form(profile):
    """NVML's + becomes . in a resource name (Kubernetes allows no +): 1g.10gb+me is mig-1g.10gb.me."""
    doc = shared({"name": f"nvidia.com/mig-{profile}", "replicas": 2})
    doc["flags"] = {"migStrategy": "mixed"}
    assert parse(doc).time_slicing[0].name == f"nvidia.com/mig-{profile}"


@pytest.mark.parametrize("limit", ["per-replica", "4GiB", "512MiB", "25%", " 25% ", "100%"])
def test_memory_limit(limit):
    config = parse(shared({"name": "nvidia.com/gpu", "replicas": 4, "memoryLimit": limit}))
    assert config.time_slicing == (TimeSlicedResource("nvidia.com/gpu", 4, limit.strip()),)


@pytest.mark.parametrize("replicas", [1, 2, pc.MAX_REPLICAS])
def test_replicas_bounds(replicas):
    assert parse(shared({"name": "nvidia.com/gpu", "replicas": replicas})).time_slicing[0].replicas == replicas


def test_an_empty_resource_list_shares_nothing():
    assert parse(shared()).time_slicing == ()
    assert parse({"sharing": {"timeSlicing": {"renameByDefault": True}}}).rename_by_default is True


# ---- every mistake: one line naming the file and the key ---------------------------------------


@pytest.mark.parametrize(
    "doc, key",
    [({"version": "v1", "flagz": {}}, "flagz"),
     ({"flags": {"migstrategy": "none"}}, "flags.migstrategy"),
     ({"flags": {"plugin": {"deviceListStrategies": "envvar"}}}, "flags.plugin.deviceListStrategies"),
     ({"sharing": {"timeslicing": {}}}, "sharing.timeslicing"),
     ({"sharing": {"timeSlicing": {"replicas": 2}}}, "sharing.timeSlicing.replicas"),
     (shared({"name": "nvidia.com/gpu", "replicas": 2, "memory": "4GiB"}), "sharing.timeSlicing.resources[0].memory"),
     (shared({"name": "nvidia.com/gpu", "replicas": 2}, {"name": "nvidia.com/gpu", "Replicas": 2}),
      "sharing.timeSlicing.resources[1].Replicas")],
)  # fmt: skip
def test_unknown_keys_at_each_level(doc, key):
    message = refused(doc)
    assert message.startswith(f"{WHERE}: {key}: unknown key (accepted keys here: "), message


def test_unknown_key_lists_the_known_ones_not_the_refused_ones():
    """In the main configuration's words (settings.describe_error, from the schema)."""
    message = refused({"sharing": {"bogus": 1}})
    assert message == f"{WHERE}: sharing.bogus: unknown key (accepted keys here: mps, timeSlicing)"
    message = refused(shared({"name": "nvidia.com/gpu", "replicas": 2, "x": 1}))
    assert message.endswith("(accepted keys here: devices, memoryLimit, name, replicas)")
    assert refused({"flags": {"x": 1}}).endswith(
        "(accepted keys here: deviceDiscoveryStrategy, failOnInitError, gdrcopyEnabled, migStrategy, mpsRoot, plugin, "
        "useNodeFeatureAPI)")  # fmt: skip
    assert refused({"flags": {"plugin": {"x": 1}}}).endswith("(accepted keys here: deviceIDStrategy, "
                                                             "deviceListStrategy, passDeviceSpecs, "
                                                             "sharedDevicesAllocationPolicy)")  # fmt: skip


def test_unknown_key_that_is_not_text_is_shown_safely():
    message = refused({"flags": {"plugin": {"\x1b[31mred": 1}}})
    assert "\x1b" not in message and "flags.plugin.\\x1b[31mred: unknown key" in message


@pytest.mark.parametrize(
    "doc, key, reason",
    [(shared({"name": "nvidia.com/gpu", "replicas": 2, "rename": "gpu-shared"}),
      "sharing.timeSlicing.resources[0].rename", "per-resource rename is not offered; use renameByDefault"),
     (shared({"name": "nvidia.com/gpu", "replicas": 2, "devices": [0, 1]}),
      "sharing.timeSlicing.resources[0].devices", "sharing a subset of the devices is not offered"),
     ({"flags": {"gdsEnabled": True}}, "flags.gdsEnabled", "GPUDirect Storage is not set up by oci-gpu-hook"),
     ({"flags": {"mofedEnabled": False}}, "flags.mofedEnabled", "MOFED devices are not set up by oci-gpu-hook"),
     ({"flags": {"nvidiaDriverRoot": "/"}}, "flags.nvidiaDriverRoot",
      "the driver's root is driver_root in oci-gpu-hook's own configuration"),
     ({"flags": {"gfd": {"oneshot": False}}}, "flags.gfd", "labels come from `oci-gpu-hook labels`"),
     ({"flags": {"plugin": {"containerDriverRoot": "/driver-root"}}}, "flags.plugin.containerDriverRoot",
      "the hook mounts the driver from driver_root"),
     ({"flags": {"plugin": {"cdiAnnotationPrefix": "cdi.k8s.io/"}}}, "flags.plugin.cdiAnnotationPrefix",
      "the CDI annotations are named cdi.k8s.io/oci-gpu-hook_<resource>"),
     ({"flags": {"plugin": {"nvidiaCTKPath": "/usr/bin/nvidia-ctk"}}}, "flags.plugin.nvidiaCTKPath",
      "oci-gpu-hook's CDI hooks run oci-gpu-hook itself")],
)  # fmt: skip
def test_nvidia_keys_we_do_not_offer_are_refused_with_the_reason(doc, key, reason):
    message = refused(doc)
    assert message.startswith(f"{WHERE}: {key}: {reason}"), message


@pytest.mark.parametrize(
    "doc, key, words",
    [({"flags": "mixed"}, "flags", '"mixed" is not accepted (expected a mapping with the keys migStrategy'),
     ({"flags": {"plugin": ["envvar"]}}, "flags.plugin", "a list is not accepted (expected a mapping"),
     ({"sharing": {"timeSlicing": []}}, "sharing.timeSlicing", "a list is not accepted (expected a mapping"),
     ({"sharing": 3}, "sharing", "3 is not accepted (expected a mapping with the keys timeSlicing, mps)"),
     ({"flags": {"migStrategy": "Mixed"}}, "flags.migStrategy",
      '"Mixed" is not accepted (expected one of none, single, mixed)'),
     ({"flags": {"migStrategy": ["mixed"]}}, "flags.migStrategy", "a list is not accepted (expected one of none"),
     ({"flags": {"plugin": {"deviceListStrategy": "env"}}}, "flags.plugin.deviceListStrategy",
      '"env" is not accepted (expected one of envvar, volume-mounts, cdi-annotations, cdi-cri, or a list of them)'),
     ({"flags": {"plugin": {"deviceListStrategy": ["envvar", "cdi"]}}}, "flags.plugin.deviceListStrategy",
      "a list is not accepted (expected one of envvar"),
     ({"flags": {"plugin": {"deviceListStrategy": []}}}, "flags.plugin.deviceListStrategy", "or a list of them"),
     ({"flags": {"plugin": {"deviceListStrategy": None}}}, "flags.plugin.deviceListStrategy", "or a list of them"),
     ({"flags": {"plugin": {"deviceListStrategy": 3}}}, "flags.plugin.deviceListStrategy", "or a list of them"),
     ({"flags": {"plugin": {"deviceIDStrategy": "serial"}}}, "flags.plugin.deviceIDStrategy",
      '"serial" is not accepted (expected one of uuid, index)'),
     ({"flags": {"plugin": {"passDeviceSpecs": "true"}}}, "flags.plugin.passDeviceSpecs",
      '"true" is not accepted (expected true or false)'),
     ({"sharing": {"timeSlicing": {"renameByDefault": 1}}}, "sharing.timeSlicing.renameByDefault",
      "1 is not accepted (expected true or false)"),
     ({"sharing": {"timeSlicing": {"failRequestsGreaterThanOne": "yes"}}},
      "sharing.timeSlicing.failRequestsGreaterThanOne", "expected true or false"),
     ({"sharing": {"timeSlicing": {"resources": "nvidia.com/gpu"}}}, "sharing.timeSlicing.resources",
      "expected a list of {name, replicas}"),
     (shared("nvidia.com/gpu"), "sharing.timeSlicing.resources[0]", "(expected a mapping with the keys name"),
     (shared({"replicas": 2}), "sharing.timeSlicing.resources[0].name",
      "missing (expected the resource to share: nvidia.com/gpu or nvidia.com/mig-<profile>)"),
     (shared({"name": 5, "replicas": 2}), "sharing.timeSlicing.resources[0].name", "5 is not accepted"),
     (shared({"name": "", "replicas": 2}), "sharing.timeSlicing.resources[0].name", '"" is not accepted')],
)  # fmt: skip
def test_bad_types(doc, key, words):
    message = refused(doc)
    assert message.startswith(f"{WHERE}: {key}: "), message
    assert words in message, message


@pytest.mark.parametrize("replicas", [0, -1, 1025, True, False, "4", 2.5, None])
def test_bad_replicas(replicas):
    entry = {"name": "nvidia.com/gpu"} if replicas is None else {"name": "nvidia.com/gpu", "replicas": replicas}
    message = refused(shared(entry))
    shown = "missing" if replicas is None else f"{json.dumps(replicas)} is not accepted"
    assert message == f"{WHERE}: sharing.timeSlicing.resources[0].replicas: {shown} (expected a whole number from " \
                      "1 to 1024)"  # fmt: skip


def test_a_resource_listed_twice():
    message = refused(shared({"name": "nvidia.com/gpu", "replicas": 2}, {"name": "nvidia.com/gpu", "replicas": 4}))
    assert message == f"{WHERE}: sharing.timeSlicing.resources[1].name: nvidia.com/gpu is listed twice"


@pytest.mark.parametrize("strategy", [None, "none", "single"])
def test_a_mig_resource_needs_the_mixed_strategy(strategy):
    doc = shared({"name": "nvidia.com/gpu", "replicas": 2}, {"name": "nvidia.com/mig-1g.5gb", "replicas": 2})
    if strategy:
        doc["flags"] = {"migStrategy": strategy}
    message = refused(doc)
    assert message == (f"{WHERE}: sharing.timeSlicing.resources[1].name: nvidia.com/mig-1g.5gb exists only with "
                       f"flags.migStrategy mixed (it is {strategy or 'none'})")  # fmt: skip


@pytest.mark.parametrize("profile", ["1gb", "", "1g", "1g.5GB", "0g.5gb", "1g.0gb", "1g.5gb+", "1g.10gb+me",
                                     "1g.5gb.ME", "g.5gb", "1g.5gb ", "100g.5gb"])  # fmt: skip
def test_invalid_mig_profile_syntax(profile):
    doc = shared({"name": f"nvidia.com/mig-{profile}", "replicas": 2})
    doc["flags"] = {"migStrategy": "mixed"}
    message = refused(doc)
    name = f"nvidia.com/mig-{profile}"
    assert message.startswith(f"{WHERE}: sharing.timeSlicing.resources[0].name: {name!r}: unknown MIG profile "
                              f"{profile!r}; "), message  # fmt: skip
    assert "a MIG profile reads like 1g.5gb, 3g.20gb or 1g.10gb.me" in message


@pytest.mark.parametrize("name", ["nvidia.com/gpus", "amd.com/gpu", "gpu", "nvidia.com/gpu.shared", "NVIDIA.COM/GPU",
                                  "nvidia.com/mig"])  # fmt: skip
def test_a_resource_name_that_is_neither(name):
    message = refused(shared({"name": name, "replicas": 2}))
    assert message == (f"{WHERE}: sharing.timeSlicing.resources[0].name: {name!r} is not a resource this plugin "
                       "offers; use nvidia.com/gpu or nvidia.com/mig-<profile>")  # fmt: skip


@pytest.mark.parametrize(
    "limit, words",
    [("lots", "not a GPU memory limit"), ("4GB", "not a GPU memory limit"), ("0GiB", "must be above zero"),
     ("-1GiB", "must be above zero"), ("101%", "cannot exceed 100%"), ("0%", "must be above zero"),
     ("per replica", "not a GPU memory limit"), (4, "expected per-replica, a size (4GiB) or a percentage (25%)"),
     ("", "expected per-replica"), ("  ", "expected per-replica"), (["4GiB"], "expected per-replica")],
)  # fmt: skip
def test_bad_memory_limits(limit, words):
    message = refused(shared({"name": "nvidia.com/gpu", "replicas": 4, "memoryLimit": limit}))
    assert message.startswith(f"{WHERE}: sharing.timeSlicing.resources[0].memoryLimit: "), message
    assert words in message, message


@pytest.mark.parametrize("version", ["v2", "V1", 1, "v1beta1", None])
def test_only_version_v1(version):
    message = refused({"version": version})
    assert message == f"{WHERE}: version: {json.dumps(version)} is not accepted (expected v1, the only version " \
                      "understood)"  # fmt: skip


@pytest.mark.parametrize("doc", [["version", "v1"], "version: v1", 1])
def test_a_document_that_is_not_a_mapping(doc):
    message = refused(doc)
    assert message == f"{WHERE}: the configuration must be a mapping of keys to values"


# ---- load ----------------------------------------------------------------------------------------


def test_load_reads_yaml_and_json(tmp_path):
    path = tmp_path / "plugin.yaml"
    path.write_text("version: v1\nflags:\n  migStrategy: mixed\n  plugin:\n    deviceListStrategy:\n"
                    "    - volume-mounts\n    - cdi-cri\nsharing:\n  timeSlicing:\n    renameByDefault: true\n"
                    "    resources:\n    - name: nvidia.com/mig-1g.5gb\n      replicas: 3\n"
                    "      memoryLimit: per-replica\n")  # fmt: skip
    config = pc.load(str(path), NodeSettings(replicas=8))
    shared = (TimeSlicedResource("nvidia.com/mig-1g.5gb", 3, "per-replica"),)
    assert config == PluginConfig(mig_strategy="mixed", list_strategies=("volume-mounts", "cdi-cri"),
                                  rename_by_default=True, time_slicing=shared)  # fmt: skip
    path.write_text('{"version": "v1", "flags": {"plugin": {"deviceIDStrategy": "index"}}}')
    assert pc.load(str(path), NodeSettings()).id_strategy == "index"  # the node settings play no part
    path.write_text("")
    assert pc.load(str(path), NodeSettings(mig_strategy="mixed", replicas=4)) == PluginConfig(mig_strategy="none")


def test_load_names_the_file_in_its_errors(tmp_path):
    path = tmp_path / "plugin.yaml"
    path.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
                    "      replicas: 0\n")  # fmt: skip
    with pytest.raises(ConfigError) as e:
        pc.load(str(path), NodeSettings())
    assert e.value.message.startswith(f"{path}: sharing.timeSlicing.resources[0].replicas: 0 is not accepted (")


@pytest.mark.parametrize("text", ["flags: [unclosed\n", "version: v1\n  flags: x\n", "a: b: c\n", "{\"version\": \n",
                                  "\tversion: v1\n"])  # fmt: skip
def test_load_invalid_yaml(tmp_path, text):
    path = tmp_path / "plugin.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        pc.load(str(path), NodeSettings())
    assert e.value.message.startswith(f"{path}: not valid YAML or JSON"), e.value.message
    assert "\n" not in e.value.message


def test_load_invalid_utf8_is_one_line(tmp_path):
    path = tmp_path / "plugin.yaml"
    path.write_bytes(b"version: v1\nflags:\n  migStrategy: \xff\xfe\n")
    with pytest.raises(ConfigError) as e:
        pc.load(str(path), NodeSettings())
    assert e.value.message == f"{path}: the device plugin configuration is not UTF-8 text"


def test_load_a_missing_or_unreadable_file(tmp_path):
    with pytest.raises(ConfigError) as e:
        pc.load(str(tmp_path / "absent.yaml"), NodeSettings())
    assert e.value.message == f"{tmp_path}/absent.yaml: cannot read the device plugin configuration: No such file or " \
                              "directory"  # fmt: skip
    with pytest.raises(ConfigError) as e:
        pc.load(str(tmp_path), NodeSettings())
    assert e.value.message == f"{tmp_path}: cannot read the device plugin configuration: not a regular file"


@pytest.mark.parametrize("strategy", ["none", "single", "mixed"])
def test_load_without_a_file_follows_the_node_settings(strategy):
    assert pc.load(None, NodeSettings(mig_strategy=strategy)) == PluginConfig(mig_strategy=strategy)
    config = pc.load(None, NodeSettings(mig_strategy=strategy, replicas=4))
    assert config == PluginConfig(mig_strategy=strategy,
                                  time_slicing=(TimeSlicedResource(pc.GPU_RESOURCE, 4, None),))  # fmt: skip
    assert not config.rename_by_default and config.list_strategies == ("envvar",)


# ---- NVIDIA v0.20's keys: each honoured, or refused by value with its reason (issue 39, item 6) ----


def test_v0_20_keys_with_the_values_this_plugin_follows_are_taken():
    config = parse({
        "version": "v1",
        "flags": {"migStrategy": "none", "mpsRoot": "/run/nvidia/mps", "gdrcopyEnabled": False,
                  "useNodeFeatureAPI": False, "deviceDiscoveryStrategy": "auto",
                  "plugin": {"sharedDevicesAllocationPolicy": "distributed"}},
        "resources": {"gpus": [], "mig": []},
        "imex": {"channelIDs": [0], "required": True},
    })  # fmt: skip
    assert (config.imex_channels, config.imex_required) == ((0,), True)
    assert config.mps == () and config.mps_root is None  # mpsRoot alone shares nothing
    assert config.allocation_policy == "distributed"
    packed = parse({"version": "v1", "flags": {"plugin": {"sharedDevicesAllocationPolicy": "packed"}}})
    assert packed.allocation_policy == "packed"  # was refused; allocation.preferred follows it
    assert parse({"flags": {"deviceDiscoveryStrategy": "nvml"}, "resources": None, "imex": None}) == PluginConfig(
        mig_strategy="none"
    )


def test_mps_sharing_in_nvidias_format():
    config = parse({"version": "v1", "flags": {"mpsRoot": "/var/run/mps/"},
                    "sharing": {"mps": {"renameByDefault": True, "resources": [
                        {"name": "nvidia.com/gpu", "replicas": 10, "devices": "all"}]}}})  # fmt: skip
    assert config.mps == (TimeSlicedResource("nvidia.com/gpu", 10, None),) and config.time_slicing == ()
    assert config.mps_root == "/var/run/mps" and config.rename_by_default
    # As NVIDIA's: an MPS replica is one to a container unless the file says otherwise.
    assert config.fail_requests_greater_than_one and config.sharing_strategy == "mps"
    assert config.sharing("nvidia.com/gpu") == config.mps[0]
    relaxed = parse({"sharing": {"mps": {"failRequestsGreaterThanOne": False,
                                         "resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}})  # fmt: skip
    assert not relaxed.fail_requests_greater_than_one and relaxed.mps_root == pc.DEFAULT_MPS_ROOT
    assert parse(shared({"name": "nvidia.com/gpu", "replicas": 2})).sharing_strategy == "time-slicing"
    assert parse({}).sharing_strategy == "none"


@pytest.mark.parametrize(
    "doc, key, reason",
    [({"flags": {"gdrcopyEnabled": True}}, "flags.gdrcopyEnabled", "true: GDRCopy (/dev/gdrdrv) is not set up"),
     ({"flags": {"useNodeFeatureAPI": True}}, "flags.useNodeFeatureAPI", "true: labels are an NFD feature file"),
     ({"flags": {"deviceDiscoveryStrategy": "tegra"}}, "flags.deviceDiscoveryStrategy",
      "tegra: Tegra's integrated GPUs are not discovered"),
     ({"flags": {"nvidiaDevRoot": "/"}}, "flags.nvidiaDevRoot", "the device nodes' root is dev_root"),
     ({"resources": {"gpus": [{"pattern": "*A100*", "name": "a100"}]}}, "resources",
      "naming resources by GPU model (resources.gpus, resources.mig) is not offered"),
     ({"sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "rename": "x"}]}}},
      "sharing.mps.resources[0].rename", "per-resource rename is not offered"),
     ({"sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": ["0"]}]}}},
      "sharing.mps.resources[0].devices", "sharing a subset of the devices is not offered"),
     ({"sharing": {"mps": {"resources": [{"name": "nvidia.com/mig-1g.5gb", "replicas": 2}]}}},
      "sharing.mps.resources[0].name", "sharing MIG devices through MPS is not supported"),
     ({"sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 1}]}}},
      "sharing.mps.resources[0].replicas", "1: MPS sharing needs at least 2 replicas"),
     ({"sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "memoryLimit": "1GiB"}]}}},
      "sharing.mps.resources[0].memoryLimit", "memoryLimit is for timeSlicing"),
     ({"sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]},
                   "timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}},
      "sharing.mps", "sharing.mps or sharing.timeSlicing, not both"),
     ({"imex": {"channelIDs": [2048]}}, "imex.channelIDs[0]", "2048 is not accepted"),
     ({"imex": {"channelIDs": [1, 1]}}, "imex.channelIDs", "is not accepted"),
     ({"flags": {"mpsRoot": "relative"}}, "flags.mpsRoot", "an absolute host directory")],
)  # fmt: skip
def test_v0_20_values_refused_with_their_reason(doc, key, reason):
    message = refused(doc)
    assert message.startswith(f"{WHERE}: {key}: "), message
    assert reason in message and "unknown key" not in message, message
