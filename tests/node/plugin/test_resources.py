"""What the device plugin advertises (plugin/resources.py): resources and device ids under each MIG
strategy, id strategy and time-slicing option, on a simulated 4-GPU host whose GPU 3 has MIG on
(three profiles), and on hand-made inventories for the layouts the simulator does not build.

Expected ids come from the simulator's summary of the host (its ground truth)."""

import re

import pytest

from oci_gpu_hook.errors import ConfigError
from oci_gpu_hook.node.plugin import config as plugin_config
from oci_gpu_hook.node.plugin import resources as plugin_resources
from oci_gpu_hook.node.plugin.config import PluginConfig, TimeSlicedResource
from oci_gpu_hook.start import memory_limit
from oci_gpu_hook.start.inventory import DeviceNode, GpuInfo, Inventory, MigDevice

pytestmark = pytest.mark.host(gpus=4, mig=[3], needs=("pynvml",))

GIB = 1 << 30
PROFILES = ["1g.5gb", "2g.10gb", "3g.20gb"]  # the simulator's MIG layout, in name order
# Kubernetes' extended resource names: a DNS subdomain prefix, then a qualified name.
QUALIFIED_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def config(strategy="mixed", *shared, **options) -> PluginConfig:
    return PluginConfig(mig_strategy=strategy, time_slicing=tuple(shared), **options)


def by_name(resources) -> dict:
    return {r.name: r for r in resources}


def ids(resource) -> list:
    return [d.id for d in resource.devices]


def full_gpus(host) -> list:
    return [g for g in host["gpus"] if not g["mig"]]


def migs(host, profile) -> list:
    """(gpu, mig) of the host's MIG devices with profile."""
    return [(g, m) for g in host["gpus"] for m in g["mig"] if m["profile"] == profile]


# ---- made-up inventories ------------------------------------------------------------------------


def fake_inventory(layout, nvml=True) -> Inventory:
    """layout: one entry per GPU, a list of MIG profiles (empty: MIG off)."""

    def cap(minor):
        return DeviceNode(f"/dev/nvidia-caps/nvidia-cap{minor}", 510, minor)

    gpus = []  # UUIDs as NVML's, in shape only
    for index, profiles in enumerate(layout):
        mig = tuple(
            MigDevice(index=i, gi=i + 1, ci=0, uuid=f"MIG-{index:04d}{i:04d}-0000-0000-0000-0000" if nvml else None,
                      gi_cap=cap(100 * index + 2 * i), ci_cap=cap(100 * index + 2 * i + 1), gi_access="", ci_access="",
                      profile=profile if nvml else None, memory_total=5 * GIB if nvml else None)
            for i, profile in enumerate(profiles)
        )  # fmt: skip
        gpus.append(GpuInfo(index=index, minor=index, uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000",
                            bus_id=f"0000:{index + 7:02x}:00.0", model="NVIDIA A100-SXM4-40GB", mig=mig,
                            node=DeviceNode(f"/dev/nvidia{index}", 195, index), memory_total=40 * GIB))  # fmt: skip
    return Inventory(driver_version="550.54.15", cuda_version="12.4", nvml=nvml, driver_root="/", dev_root="/",
                     proc_root="/", majors={"nvidia": 195}, gpus=tuple(gpus), control_devices={}, mig_caps={},
                     files=())  # fmt: skip


# ---- MIG strategies ---------------------------------------------------------------------------------


def test_strategy_none_offers_every_gpu_whole(host, inventory):
    (gpu,) = plugin_resources.resources(inventory, config("none"))
    assert gpu.name == "nvidia.com/gpu" and gpu.replicas == 1 and gpu.memory_limit is None
    assert ids(gpu) == [g["uuid"] for g in host["gpus"]]
    assert [d.unit.index for d in gpu.devices] == ["0", "1", "2", "3"]
    assert all(d.replica is None and d.unit.mig is None for d in gpu.devices)
    assert gpu.devices[3].unit.memory_total == 40 * GIB  # the MIG GPU, whole
    (indexed,) = plugin_resources.resources(inventory, config("none", id_strategy="index"))
    assert ids(indexed) == ["0", "1", "2", "3"]


def test_strategy_mixed_offers_full_gpus_and_each_profile(host, inventory):
    resources = plugin_resources.resources(inventory, config("mixed"))
    assert [r.name for r in resources] == ["nvidia.com/gpu"] + [f"nvidia.com/mig-{p}" for p in PROFILES]
    found = by_name(resources)
    assert ids(found["nvidia.com/gpu"]) == [g["uuid"] for g in full_gpus(host)]
    for profile in PROFILES:
        resource = found[f"nvidia.com/mig-{profile}"]
        expected = migs(host, profile)
        assert len(expected) == 1
        assert ids(resource) == [m["uuid"] for _, m in expected]
        (device,) = resource.devices
        assert (device.unit.index, device.unit.gpu.uuid) == (f"3:{expected[0][1]['index']}", host["gpus"][3]["uuid"])
        assert device.unit.memory_total == expected[0][1]["memory_total"]
    indexed = by_name(plugin_resources.resources(inventory, config("mixed", id_strategy="index")))
    assert ids(indexed["nvidia.com/gpu"]) == ["0", "1", "2"]
    assert [ids(indexed[f"nvidia.com/mig-{p}"]) for p in PROFILES] == [["3:2"], ["3:1"], ["3:0"]]


def test_strategy_single_on_a_mixed_node_is_a_config_error(inventory):
    with pytest.raises(ConfigError) as e:
        plugin_resources.resources(inventory, config("single"), "/etc/dp.yaml")
    assert e.value.message == (
        "/etc/dp.yaml: flags.migStrategy single needs MIG on every GPU with one profile; this node has 3 GPUs without "
        "MIG and MIG profiles 1g.5gb, 2g.10gb, 3g.20gb; use mixed"
    )
    with pytest.raises(ConfigError) as e:
        plugin_resources.resources(inventory, config("single"))
    assert e.value.message.startswith("device plugin configuration: flags.migStrategy single")


def test_strategy_single_with_one_profile_offers_the_mig_devices_as_gpus():
    inventory = fake_inventory([["1g.5gb", "1g.5gb"], ["1g.5gb"]])
    (gpu,) = plugin_resources.resources(inventory, config("single"))
    assert gpu.name == "nvidia.com/gpu"
    assert ids(gpu) == [m.uuid for g in inventory.gpus for m in g.mig]
    (indexed,) = plugin_resources.resources(inventory, config("single", id_strategy="index"))
    assert ids(indexed) == ["0:0", "0:1", "1:0"]


@pytest.mark.parametrize(
    "layout, words",
    [([["1g.5gb"], []], "1 GPUs without MIG and MIG profiles 1g.5gb"),
     ([["1g.5gb"], ["2g.10gb"]], "0 GPUs without MIG and MIG profiles 1g.5gb, 2g.10gb")],
)  # fmt: skip
def test_strategy_single_needs_mig_everywhere_with_one_profile(layout, words):
    with pytest.raises(ConfigError) as e:
        plugin_resources.resources(fake_inventory(layout), config("single"), "f.yaml")
    assert words in e.value.message


def test_strategy_single_needs_the_profiles_from_nvml():
    with pytest.raises(ConfigError) as e:
        plugin_resources.resources(fake_inventory([["1g.5gb"], ["1g.5gb"]], nvml=False), config("single"), "f.yaml")
    assert "MIG profiles unknown" in e.value.message


def test_strategy_single_without_mig_offers_the_gpus():
    inventory = fake_inventory([[], []])
    (gpu,) = plugin_resources.resources(inventory, config("single"))
    assert ids(gpu) == [g.uuid for g in inventory.gpus]


def test_strategy_mixed_needs_the_profiles_from_nvml():
    with pytest.raises(ConfigError) as e:
        plugin_resources.resources(fake_inventory([[], ["1g.5gb"]], nvml=False), config("mixed"), "f.yaml")
    assert e.value.message == ("f.yaml: flags.migStrategy mixed needs each MIG device's profile, and NVML did not "
                               "report the profile of MIG device 1:0")  # fmt: skip


def test_strategy_mixed_with_mig_on_every_gpu_offers_no_nvidia_com_gpu():
    """As NVIDIA's v0.20: no nvidia.com/gpu registered with 0 devices (issue 39, item 6)."""
    resources = by_name(plugin_resources.resources(fake_inventory([["1g.5gb"], ["2g.10gb"]]), config("mixed")))
    assert sorted(resources) == ["nvidia.com/mig-1g.5gb", "nvidia.com/mig-2g.10gb"]
    # Under none the GPUs are offered whole, MIG or not.
    assert [r.name for r in plugin_resources.resources(fake_inventory([["1g.5gb"]]), config("none"))] == [
        "nvidia.com/gpu"
    ]


def test_the_same_inventory_gives_the_same_answer(inventory):
    shared = config("mixed", TimeSlicedResource("nvidia.com/gpu", 3, "per-replica"))
    assert plugin_resources.resources(inventory, shared) == plugin_resources.resources(inventory, shared)


# ---- time-slicing -----------------------------------------------------------------------------------


def test_replicas_give_one_id_per_replica(host, inventory):
    resources = by_name(plugin_resources.resources(inventory, config(
        "mixed", TimeSlicedResource("nvidia.com/gpu", 4, None), TimeSlicedResource("nvidia.com/mig-1g.5gb", 2, None),
        fail_requests_greater_than_one=True)))  # fmt: skip
    gpu = resources["nvidia.com/gpu"]
    assert (gpu.replicas, gpu.memory_limit, gpu.fail_requests_greater_than_one) == (4, None, True)
    assert ids(gpu) == [f"{g['uuid']}::{r}" for g in full_gpus(host) for r in range(4)]
    assert [d.replica for d in gpu.devices] == [0, 1, 2, 3] * 3
    assert all(d.unit.uuid == d.id.split("::")[0] for d in gpu.devices)
    ((_, mig),) = migs(host, "1g.5gb")
    assert ids(resources["nvidia.com/mig-1g.5gb"]) == [f"{mig['uuid']}::0", f"{mig['uuid']}::1"]
    unshared = resources["nvidia.com/mig-2g.10gb"]  # not listed in sharing: whole, one id each
    assert (unshared.replicas, unshared.fail_requests_greater_than_one) == (1, False)
    assert ids(unshared) == [m["uuid"] for _, m in migs(host, "2g.10gb")]
    indexed = by_name(plugin_resources.resources(inventory, config(
        "mixed", TimeSlicedResource("nvidia.com/gpu", 2, None), TimeSlicedResource("nvidia.com/mig-3g.20gb", 2, None),
        id_strategy="index")))  # fmt: skip
    assert ids(indexed["nvidia.com/gpu"]) == ["0::0", "0::1", "1::0", "1::1", "2::0", "2::1"]
    assert ids(indexed["nvidia.com/mig-3g.20gb"]) == ["3:0::0", "3:0::1"]


def test_rename_by_default_adds_the_shared_suffix_to_shared_resources_only(inventory):
    resources = plugin_resources.resources(inventory, config(
        "mixed", TimeSlicedResource("nvidia.com/gpu", 2, None), TimeSlicedResource("nvidia.com/mig-1g.5gb", 2, None),
        rename_by_default=True))  # fmt: skip
    assert [r.name for r in resources] == ["nvidia.com/gpu.shared", "nvidia.com/mig-1g.5gb.shared",
                                           "nvidia.com/mig-2g.10gb", "nvidia.com/mig-3g.20gb"]  # fmt: skip
    (none,) = plugin_resources.resources(inventory, config("none", TimeSlicedResource("nvidia.com/gpu", 2, None),
                                                         rename_by_default=True))  # fmt: skip
    assert none.name == "nvidia.com/gpu.shared" and len(none.devices) == 8


@pytest.mark.parametrize("replicas, limit", [(4, "25%"), (3, "33.3333%"), (2, "50%"), (7, "14.2857%"),
                                             (1000, "0.1%"), (1024, "0.0977%")])  # fmt: skip
def test_a_per_replica_memory_limit_is_a_percentage(inventory, replicas, limit):
    (gpu,) = plugin_resources.resources(inventory, config("none", TimeSlicedResource("nvidia.com/gpu", replicas,
                                                                                    "per-replica")))  # fmt: skip
    assert gpu.memory_limit == limit
    memory_limit.parse(gpu.memory_limit, "plugin")  # what the hook will be given, it can read


def test_a_memory_limit_in_other_forms_is_passed_as_given(inventory):
    shared = (TimeSlicedResource("nvidia.com/gpu", 2, "4GiB"), TimeSlicedResource("nvidia.com/mig-3g.20gb", 3, "25%"),
              TimeSlicedResource("nvidia.com/mig-1g.5gb", 2, None))  # fmt: skip
    resources = by_name(plugin_resources.resources(inventory, config("mixed", *shared)))
    assert resources["nvidia.com/gpu"].memory_limit == "4GiB"
    assert resources["nvidia.com/mig-3g.20gb"].memory_limit == "25%"
    assert resources["nvidia.com/mig-1g.5gb"].memory_limit is None
    assert resources["nvidia.com/mig-2g.10gb"].memory_limit is None


def test_a_per_replica_limit_with_one_replica_is_the_whole_device(inventory):
    (gpu,) = plugin_resources.resources(inventory, config("none", TimeSlicedResource("nvidia.com/gpu", 1,
                                                                                    "per-replica")))  # fmt: skip
    assert [d.id for d in gpu.devices] == [g.uuid for g in inventory.gpus]  # not shared: no replica ids
    assert (gpu.replicas, gpu.memory_limit) == (1, "100%")
    memory_limit.parse(gpu.memory_limit, "plugin")


def test_a_size_larger_than_one_of_the_devices_is_a_config_error(host, inventory):
    (mig,) = [m for g in host["gpus"] for m in g["mig"] if m["profile"] == "1g.5gb"]
    shared = config("mixed", TimeSlicedResource("nvidia.com/gpu", 2, "40GiB"),
                    TimeSlicedResource("nvidia.com/mig-1g.5gb", 2, "6GiB"))  # fmt: skip
    with pytest.raises(ConfigError) as e:
        plugin_resources.resources(inventory, shared, "/etc/dp.yaml")
    assert e.value.message == (f"/etc/dp.yaml: sharing.timeSlicing.resources[1].memoryLimit: 6GiB is more than "
                               f"{mig['uuid']}'s 4864 MiB")  # fmt: skip
    with pytest.raises(ConfigError) as e:  # a GPU's whole memory fits; a byte more does not
        plugin_resources.resources(inventory, config("none", TimeSlicedResource("nvidia.com/gpu", 2, "40961MiB")), "f")
    assert e.value.message == (f"f: sharing.timeSlicing.resources[0].memoryLimit: 40961MiB is more than "
                               f"{host['gpus'][0]['uuid']}'s 40960 MiB")  # fmt: skip
    # a percentage fits any device; so does a size where NVML reported no memory
    assert plugin_resources.resources(inventory, config("none", TimeSlicedResource("nvidia.com/gpu", 2, "100%")))
    unknown = fake_inventory([[]], nvml=False)
    unknown = unknown.replace(gpus=(unknown.gpus[0].replace(memory_total=None),))
    (gpu,) = plugin_resources.resources(unknown, config("none", TimeSlicedResource("nvidia.com/gpu", 2, "500GiB")))
    assert gpu.memory_limit == "500GiB"


@pytest.mark.parametrize("node_kind", ["simulated", "no-mig"])
def test_a_shared_mig_profile_this_node_lacks_is_a_config_error(inventory, node_kind):
    node = inventory if node_kind == "simulated" else fake_inventory([[], []])
    shared = config("mixed", TimeSlicedResource("nvidia.com/gpu", 2, None),
                    TimeSlicedResource("nvidia.com/mig-7g.40gb", 2, None))  # fmt: skip
    with pytest.raises(ConfigError) as e:
        plugin_resources.resources(node, shared, "/etc/dp.yaml")
    have = ", ".join(PROFILES) if node_kind == "simulated" else "none"
    assert e.value.message == ("/etc/dp.yaml: sharing.timeSlicing.resources[1].name: unknown MIG profile: no MIG "
                               f"device on this node has profile 7g.40gb (profiles here: {have})")  # fmt: skip


def test_sharing_nvidia_com_gpu_on_a_node_with_mig_everywhere_is_fine():
    inventory = fake_inventory([["1g.5gb"]])
    resources = by_name(plugin_resources.resources(inventory, config("mixed", TimeSlicedResource("nvidia.com/gpu", 2,
                                                                                                None))))  # fmt: skip
    assert "nvidia.com/gpu" not in resources
    assert ids(resources["nvidia.com/mig-1g.5gb"]) == [inventory.gpus[0].mig[0].uuid]


def test_find():
    inventory = fake_inventory([[], []])
    (gpu,) = plugin_resources.resources(inventory, config("none", TimeSlicedResource("nvidia.com/gpu", 2, None)))
    assert gpu.find(f"{inventory.gpus[1].uuid}::1") == gpu.devices[3]
    assert gpu.find(inventory.gpus[1].uuid) is None  # a shared resource knows only its replica ids
    assert gpu.find("") is None


def test_resource_names_from_the_simulated_host_are_valid_kubernetes_names(inventory):
    resources = plugin_resources.resources(inventory, config("mixed", TimeSlicedResource("nvidia.com/gpu", 2, None),
                                                           rename_by_default=True))  # fmt: skip
    for resource in resources:
        assert QUALIFIED_NAME.match(resource.name) and len(resource.name.split("/")[1]) <= 63, resource.name


def test_a_media_extension_profile_gives_a_valid_kubernetes_resource_name():
    resources = plugin_resources.resources(fake_inventory([["1g.10gb+me", "1g.5gb"]]), config("mixed"))
    for resource in resources:
        assert QUALIFIED_NAME.match(resource.name), resource.name


def test_the_config_module_and_this_one_agree_on_names():
    assert plugin_resources.GPU_RESOURCE == plugin_config.GPU_RESOURCE == "nvidia.com/gpu"
    assert plugin_resources.REPLICA_SEPARATOR == "::"
