"""The device plugin's answers (allocation.py): what Allocate tells the runtime under each
device list strategy, what it refuses, the device specs and the memory limit it passes, and which
ids GetPreferredAllocation picks. On a simulated 4-GPU host whose GPU 3 has MIG on; the expected
values come from the simulator's summary. Where the hook reads an answer back (volume mounts,
the memory limit mount), the hook's own parser checks it."""

import os
import stat

import pytest

from oci_gpu_hook.node.plugin import resources as plugin_resources
from oci_gpu_hook.node.plugin.allocation import AllocationError, allocate, preferred
from oci_gpu_hook.node.plugin.config import PluginConfig, TimeSlicedResource
from oci_gpu_hook.start import memory_limit
from oci_gpu_hook.start.plan import SelectedDevice
from oci_gpu_hook.start.spec import Mount, volume_mount_device

pytestmark = pytest.mark.host(gpus=4, mig=[3], needs=("pynvml",))

VISIBLE = "NVIDIA_VISIBLE_DEVICES"
KIND = "example.com/gpu"  # settings.cdi_kind, not the default, to see that it is the one used


def make_config(*shared, **options) -> PluginConfig:
    return PluginConfig(**{"mig_strategy": "mixed", "time_slicing": tuple(shared), **options})


def resource_of(inventory, config, name="nvidia.com/gpu"):
    return {r.name: r for r in plugin_resources.resources(inventory, config)}[name]


def uuids(host, *indices) -> list:
    return [host["gpus"][i]["uuid"] for i in indices]


def mig_of(host, profile) -> dict:
    (mig,) = [m for g in host["gpus"] for m in g["mig"] if m["profile"] == profile]
    return mig


def answer(inventory, ids, name="nvidia.com/gpu", *shared, **options):
    config = make_config(*shared, **options)
    return allocate(resource_of(inventory, config, name), ids, config, inventory, KIND)


# ---- device list strategies -------------------------------------------------------------------------


def test_envvar(host, inventory):
    got = answer(inventory, uuids(host, 0, 2))
    assert got.envs == {VISIBLE: ",".join(uuids(host, 0, 2))}
    assert (got.mounts, got.devices, got.annotations, got.cdi_devices) == ((), (), {}, ())


def test_envvar_with_index_ids(host, inventory):
    assert answer(inventory, ["2", "0"], id_strategy="index").envs == {VISIBLE: "2,0"}
    assert answer(inventory, ["3:1"], "nvidia.com/mig-2g.10gb", id_strategy="index").envs == {VISIBLE: "3:1"}
    mig = mig_of(host, "2g.10gb")
    assert answer(inventory, [mig["uuid"]], "nvidia.com/mig-2g.10gb").envs == {VISIBLE: mig["uuid"]}


@pytest.mark.parametrize("id_strategy", ["uuid", "index"])
def test_volume_mounts(host, inventory, id_strategy):
    ids = uuids(host, 1, 2) if id_strategy == "uuid" else ["1", "2"]
    got = answer(inventory, ids, list_strategies=("volume-mounts",), id_strategy=id_strategy)
    assert got.envs == {VISIBLE: "/var/run/nvidia-container-devices"}
    assert got.mounts == tuple((f"/var/run/nvidia-container-devices/{i}", "/dev/null", True) for i in ids)
    # the hook reads the same ids back from the mounts
    assert [volume_mount_device(c) for c, _, _ in got.mounts] == ids
    assert (got.annotations, got.cdi_devices) == ({}, ())


def test_volume_mounts_with_envvar_set_the_variable_to_the_directory(host, inventory):
    got = answer(inventory, uuids(host, 0), list_strategies=("envvar", "volume-mounts"))
    assert got.envs == {VISIBLE: "/var/run/nvidia-container-devices"}
    assert got.mounts == ((f"/var/run/nvidia-container-devices/{uuids(host, 0)[0]}", "/dev/null", True),)


def test_cdi_annotations(host, inventory):
    got = answer(inventory, uuids(host, 0, 1), list_strategies=("cdi-annotations",))
    assert got.annotations == {"cdi.k8s.io/oci-gpu-hook_nvidia.com_gpu": ",".join(f"{KIND}={u}" for u in
                                                                                  uuids(host, 0, 1))}  # fmt: skip
    assert got.envs == {VISIBLE: "void"}  # only CDI: an image's NVIDIA_VISIBLE_DEVICES=all cannot widen it
    assert (got.mounts, got.cdi_devices) == ((), ())
    mig = answer(inventory, ["3:2"], "nvidia.com/mig-1g.5gb", list_strategies=("cdi-annotations",),
                 id_strategy="index")  # fmt: skip
    assert mig.annotations == {"cdi.k8s.io/oci-gpu-hook_nvidia.com_mig-1g.5gb": f"{KIND}=3:2"}


def test_cdi_cri(host, inventory):
    got = answer(inventory, uuids(host, 2, 0), list_strategies=("cdi-cri",))
    assert got.cdi_devices == tuple(f"{KIND}={u}" for u in uuids(host, 2, 0))
    assert got.envs == {VISIBLE: "void"}
    assert (got.mounts, got.annotations) == ((), {})


def test_both_cdi_strategies_and_cdi_with_envvar(host, inventory):
    ids = uuids(host, 1)
    both = answer(inventory, ids, list_strategies=("cdi-annotations", "cdi-cri"))
    assert both.envs == {VISIBLE: "void"} and both.cdi_devices == (f"{KIND}={ids[0]}",) and both.annotations
    with_env = answer(inventory, ids, list_strategies=("cdi-cri", "envvar"))
    assert with_env.envs == {VISIBLE: ids[0]} and with_env.cdi_devices == (f"{KIND}={ids[0]}",)


# ---- what is refused, what is merged ---------------------------------------------------------------


def test_two_replicas_of_one_gpu_are_that_gpu(host, inventory):
    gpu0, gpu1 = uuids(host, 0, 1)
    got = answer(inventory, [f"{gpu0}::0", f"{gpu0}::3", f"{gpu1}::1"], "nvidia.com/gpu",
                 TimeSlicedResource("nvidia.com/gpu", 4, None), list_strategies=("envvar", "cdi-cri"))  # fmt: skip
    assert got.envs == {VISIBLE: f"{gpu0},{gpu1}"}
    assert got.cdi_devices == (f"{KIND}={gpu0}", f"{KIND}={gpu1}")
    indexed = answer(inventory, ["1::1", "1::0"], "nvidia.com/gpu", TimeSlicedResource("nvidia.com/gpu", 2, None),
                     id_strategy="index")  # fmt: skip
    assert indexed.envs == {VISIBLE: "1"}


@pytest.mark.parametrize("bad", ["GPU-nope", "", "0", "0::0"])
def test_an_unknown_id_is_refused(host, inventory, bad):
    with pytest.raises(AllocationError) as e:
        answer(inventory, [uuids(host, 0)[0], bad])
    assert str(e.value) == f"nvidia.com/gpu: unknown device id {bad!r}"


def test_an_id_of_another_resource_is_unknown_here(host, inventory):
    mig = mig_of(host, "1g.5gb")["uuid"]
    with pytest.raises(AllocationError, match="nvidia.com/gpu: unknown device id"):
        answer(inventory, [mig])
    with pytest.raises(AllocationError, match="nvidia.com/mig-2g.10gb: unknown device id"):
        answer(inventory, [mig], "nvidia.com/mig-2g.10gb")
    with pytest.raises(AllocationError, match="unknown device id 'x{80}'$"):
        answer(inventory, ["x" * 500])  # a long id is cut short


def test_fail_requests_greater_than_one(host, inventory):
    shared = TimeSlicedResource("nvidia.com/gpu", 2, None)
    gpu0, gpu1 = uuids(host, 0, 1)
    for ids in ([f"{gpu0}::0", f"{gpu1}::0"], [f"{gpu0}::0", f"{gpu0}::1"]):  # two GPUs, or one GPU twice
        with pytest.raises(AllocationError) as e:
            answer(inventory, ids, "nvidia.com/gpu", shared, fail_requests_greater_than_one=True)
        assert str(e.value) == ("nvidia.com/gpu: a container may ask for 1 time-sliced GPU, not 2 "
                                "(sharing.timeSlicing.failRequestsGreaterThanOne is set)")  # fmt: skip
    one = answer(inventory, [f"{gpu1}::1"], "nvidia.com/gpu", shared, fail_requests_greater_than_one=True)
    assert one.envs == {VISIBLE: gpu1}
    two = answer(inventory, [f"{gpu0}::0", f"{gpu1}::0"], "nvidia.com/gpu", shared)  # the flag off
    assert two.envs == {VISIBLE: f"{gpu0},{gpu1}"}
    # on a resource that is not shared, the flag has nothing to refuse
    whole = answer(inventory, [gpu0, gpu1], "nvidia.com/gpu", TimeSlicedResource("nvidia.com/mig-1g.5gb", 2, None),
                   fail_requests_greater_than_one=True)  # fmt: skip
    assert whole.envs == {VISIBLE: f"{gpu0},{gpu1}"}


# ---- device specs -----------------------------------------------------------------------------------


def check_spec_numbers(spec, major, minor):
    _, host_path, permissions = spec
    st = os.stat(host_path)
    assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor), spec
    assert permissions == "rw"


def test_pass_device_specs_for_gpus(host, inventory):
    root = host["root"]
    assert answer(inventory, uuids(host, 0)).devices == ()  # off by default
    got = answer(inventory, uuids(host, 2, 0), pass_device_specs=True)
    gpu2, gpu0 = host["gpus"][2], host["gpus"][0]
    assert got.devices == (
        (f"/dev/nvidia{gpu2['minor']}", f"{root}/dev/nvidia{gpu2['minor']}", "rw"),
        (f"/dev/nvidia{gpu0['minor']}", f"{root}/dev/nvidia{gpu0['minor']}", "rw"),
        ("/dev/nvidia-uvm", f"{root}/dev/nvidia-uvm", "rw"),
        ("/dev/nvidia-uvm-tools", f"{root}/dev/nvidia-uvm-tools", "rw"),
        ("/dev/nvidiactl", f"{root}/dev/nvidiactl", "rw"),
    )
    check_spec_numbers(got.devices[0], 195, gpu2["minor"])
    check_spec_numbers(got.devices[2], host["uvm_major"], 0)
    check_spec_numbers(got.devices[4], 195, 255)
    assert got.envs == {VISIBLE: f"{gpu2['uuid']},{gpu0['uuid']}"}  # the list strategy's answer all the same


def test_pass_device_specs_for_a_mig_device(host, inventory):
    root, gpu3 = host["root"], host["gpus"][3]
    mig = mig_of(host, "3g.20gb")
    got = answer(inventory, [mig["uuid"]], "nvidia.com/mig-3g.20gb", pass_device_specs=True)
    caps = [f"/dev/nvidia-caps/nvidia-cap{mig['gi_cap_minor']}", f"/dev/nvidia-caps/nvidia-cap{mig['ci_cap_minor']}"]
    assert [c for c, _, _ in got.devices] == [f"/dev/nvidia{gpu3['minor']}", "/dev/nvidia-uvm",
                                              "/dev/nvidia-uvm-tools", "/dev/nvidiactl", *caps]  # fmt: skip
    assert all(h == root + c for c, h, _ in got.devices)
    check_spec_numbers(got.devices[0], 195, gpu3["minor"])
    check_spec_numbers(got.devices[4], host["caps_major"], mig["gi_cap_minor"])
    check_spec_numbers(got.devices[5], host["caps_major"], mig["ci_cap_minor"])


def test_pass_device_specs_leaves_out_a_node_that_cannot_be_trusted(host, inventory):
    gpus = list(inventory.gpus)
    gpus[1] = gpus[1].replace(node=gpus[1].node.replace(problem="missing"))
    damaged = inventory.replace(gpus=tuple(gpus))
    config = make_config(pass_device_specs=True)
    got = allocate(resource_of(damaged, config), uuids(host, 0, 1), config, damaged, KIND)
    assert [c for c, _, _ in got.devices] == [f"/dev/nvidia{host['gpus'][0]['minor']}", "/dev/nvidia-uvm",
                                              "/dev/nvidia-uvm-tools", "/dev/nvidiactl"]  # fmt: skip


def test_device_specs_on_a_host_rooted_at_slash(host, inventory):
    """dev_root / (a real host): the host path of /dev/nvidia0 is /dev/nvidia0."""
    real = inventory.replace(dev_root="/")
    config = make_config(pass_device_specs=True)
    got = allocate(resource_of(real, config), uuids(host, 0), config, real, KIND)
    assert [(c, h) for c, h, _ in got.devices][0] == (f"/dev/nvidia{host['gpus'][0]['minor']}",) * 2
    assert all(c == h for c, h, _ in got.devices)


# ---- the memory limit -------------------------------------------------------------------------------


def test_a_memory_limit_travels_as_env_and_mount(host, inventory):
    gpu1 = uuids(host, 1)[0]
    got = answer(inventory, [f"{gpu1}::2"], "nvidia.com/gpu", TimeSlicedResource("nvidia.com/gpu", 4, "per-replica"),
                 list_strategies=("volume-mounts",))  # fmt: skip
    assert got.envs == {VISIBLE: "/var/run/nvidia-container-devices", memory_limit.ENV: "25%"}
    assert got.mounts == ((f"/var/run/nvidia-container-devices/{gpu1}", "/dev/null", True),
                          ("/var/run/oci-gpu-hook/gpu-memory-limit/25%", "/dev/null", True))  # fmt: skip
    # what the hook makes of it: a pod raising the variable does not raise the limit the mount sets
    mounts = [Mount(destination=c, source=h, type="bind") for c, h, _ in got.mounts]
    assert memory_limit.mounted_limits(mounts) == [("25%", f"mount {memory_limit.MOUNT_DIR}/25%")]
    (gpu,) = [g for g in inventory.gpus if g.uuid == gpu1]
    limits = memory_limit.resolve({**got.envs, memory_limit.ENV: "90%"}, {}, None, 1, (SelectedDevice(gpu),), mounts)
    assert limits == {gpu1: gpu.memory_total // 4}


def test_a_memory_limit_on_a_mig_resource(host, inventory):
    mig = mig_of(host, "1g.5gb")
    got = answer(inventory, [f"{mig['uuid']}::0"], "nvidia.com/mig-1g.5gb",
                 TimeSlicedResource("nvidia.com/mig-1g.5gb", 2, "1GiB"), list_strategies=("cdi-cri",))  # fmt: skip
    assert got.envs == {VISIBLE: "void", memory_limit.ENV: "1GiB"}
    assert got.mounts == (("/var/run/oci-gpu-hook/gpu-memory-limit/1GiB", "/dev/null", True),)


def test_no_memory_limit_no_env_and_no_mount(host, inventory):
    shared = TimeSlicedResource("nvidia.com/gpu", 2, None)
    got = answer(inventory, [f"{uuids(host, 0)[0]}::0"], "nvidia.com/gpu", shared)
    assert memory_limit.ENV not in got.envs and got.mounts == ()


# ---- preferred allocation -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(inventory):
    """nvidia.com/gpu with 4 replicas of GPUs 0, 1 and 2 (GPU 3 is MIG): 12 ids."""
    return resource_of(inventory, make_config(TimeSlicedResource("nvidia.com/gpu", 4, None)))


def gpu_of(resource, device_id) -> str:
    return resource.find(device_id).unit.uuid


def test_preferred_spreads_over_distinct_gpus(shared):
    available = [d.id for d in shared.devices]
    got = preferred(shared, available, [], 3)
    assert len(got) == 3 and len({gpu_of(shared, i) for i in got}) == 3
    assert got == [shared.devices[0].id, shared.devices[4].id, shared.devices[8].id]  # inventory order breaks ties
    four = preferred(shared, available, [], 4)
    assert four[:3] == got and len(set(four)) == 4  # the fourth shares a GPU: there are three


def test_preferred_takes_must_include_first(shared):
    available = [d.id for d in shared.devices]
    must = shared.devices[5].id  # a replica of GPU 1
    got = preferred(shared, available, [must], 3)
    assert got[0] == must
    assert {gpu_of(shared, i) for i in got} == {d.unit.uuid for d in shared.devices}  # then the other two GPUs
    assert preferred(shared, available, [must, must], 1) == [must]
    assert preferred(shared, available, [shared.devices[1].id, must], 1) == [shared.devices[1].id]  # size honoured


def test_preferred_picks_the_least_shared_gpu(shared):
    devices = shared.devices
    # free: GPU 0 one replica, GPU 1 all four, GPU 2 two
    available = [devices[3].id, *[d.id for d in devices[4:8]], devices[9].id, devices[11].id]
    (got,) = preferred(shared, available, [], 1)
    assert gpu_of(shared, got) == devices[4].unit.uuid and got == devices[4].id
    two = preferred(shared, available, [], 2)
    assert [gpu_of(shared, i) for i in two] == [devices[4].unit.uuid, devices[9].unit.uuid]
    # with one replica of GPU 1 already taken, the next goes elsewhere
    assert gpu_of(shared, preferred(shared, available, [devices[5].id], 2)[1]) == devices[9].unit.uuid


@pytest.mark.parametrize("size", [0, 1, 2, 5, 12, 20])
def test_preferred_returns_only_available_ids_and_at_most_size(shared, size):
    available = [d.id for d in shared.devices][::3] + ["GPU-unknown::0", "nvidia.com/gpu"]
    got = preferred(shared, available, [], size)
    assert len(got) == min(size, 4) and len(set(got)) == len(got)
    assert set(got) <= set(available) - {"GPU-unknown::0", "nvidia.com/gpu"}


def test_preferred_with_whole_gpus(host, inventory):
    whole = resource_of(inventory, make_config())
    assert preferred(whole, uuids(host, 2, 1, 0), [], 2) == uuids(host, 0, 1)  # inventory order, not the kubelet's
    got = preferred(whole, uuids(host, 2, 1, 0), [uuids(host, 1)[0]], 2)
    assert got[0] == uuids(host, 1)[0] and len(got) == 2 and set(got) <= set(uuids(host, 0, 1, 2))
    assert preferred(whole, uuids(host, 2), [], 2) == uuids(host, 2)
    assert preferred(whole, [], [], 1) == []


# ---- sharedDevicesAllocationPolicy: packed ----------------------------------------------------------
# NVIDIA's meaning (v0.20, its preferred allocation for shared and MIG devices): distributed puts a
# container on the GPUs with the fewest of their devices already allocated, packed on those with the
# most, so that shared devices fill as few GPUs as they can and the rest stay free for whole GPUs.


def test_packed_fills_one_gpu_before_the_next(shared):
    devices = shared.devices
    available = [d.id for d in devices]
    assert preferred(shared, available, [], 3, policy="packed") == [d.id for d in devices[:3]]
    assert preferred(shared, available, [], 6, policy="packed") == [d.id for d in devices[:6]]  # then GPU 1
    # The container's own must-include replica counts as allocated: the rest join it on GPU 1.
    assert preferred(shared, available, [devices[5].id], 3, policy="packed") == [devices[i].id for i in (5, 4, 6)]


def test_packed_picks_the_most_shared_gpu(shared):
    devices = shared.devices
    # free: GPU 0 one replica (three allocated), GPU 1 all four (none), GPU 2 two (two)
    available = [devices[3].id, *[d.id for d in devices[4:8]], devices[9].id, devices[11].id]
    got = preferred(shared, available, [], 4, policy="packed")
    assert got == [devices[i].id for i in (3, 9, 11, 4)]
    assert preferred(shared, available, [], 1) == [devices[4].id]  # distributed: the least shared, GPU 1


@pytest.mark.parametrize("size", [0, 1, 2, 5, 12, 20])
def test_packed_returns_only_available_ids_and_at_most_size(shared, size):
    available = [d.id for d in shared.devices][1::2] + ["GPU-unknown::0", "nvidia.com/gpu"]
    got = preferred(shared, available, [], size, policy="packed")
    assert len(got) == min(size, 6) and len(set(got)) == len(got)
    assert set(got) <= set(available) - {"GPU-unknown::0", "nvidia.com/gpu"}


def test_packed_counts_a_mig_device_for_its_gpu(simulated_host):
    """On physical GPUs, as packing is for: MIG devices of one resource on two GPUs (as seven
    1g.5gb of an A100 each are one resource), one of GPU 1's taken: the next is another of GPU 1's,
    where counting each MIG device alone ties them all and takes GPU 0's first."""
    from oci_gpu_hook.start import inventory_cache, settings

    host = simulated_host(gpus=2, mig=[0, 1])
    inventory = inventory_cache.load(settings.load(f"{host['root']}/config.yaml"))
    migs = [r for r in plugin_resources.resources(inventory, make_config()) if r.name.startswith("nvidia.com/mig-")]
    devices = tuple(sorted((d for r in migs for d in r.devices), key=lambda d: d.unit.index))
    resource = migs[0].replace(name="nvidia.com/mig-all", devices=devices)
    assert [d.unit.index for d in devices] == ["0:0", "0:1", "0:2", "1:0", "1:1", "1:2"]
    available = [d.id for d in devices if d.unit.index != "1:0"]
    assert preferred(resource, available, [], 2, policy="packed") == [devices[4].id, devices[5].id]
    assert preferred(resource, available, [], 2) == [devices[0].id, devices[1].id]  # distributed


def test_the_policy_comes_from_the_configuration(host, inventory):
    """flags.plugin.sharedDevicesAllocationPolicy: packed was refused; it is honoured now, and
    distributed stays the default. (The plugin passes config.allocation_policy to preferred.)"""
    from oci_gpu_hook.errors import ConfigError
    from oci_gpu_hook.node.plugin import config as plugin_config

    def config(policy):
        plugin = {} if policy is None else {"sharedDevicesAllocationPolicy": policy}
        doc = {"version": "v1", "flags": {"plugin": plugin},
               "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}}}  # fmt: skip
        return plugin_config.parse(doc, "p.yaml")

    assert [config(p).allocation_policy for p in (None, "distributed", "packed")] == ["distributed"] * 2 + ["packed"]
    resource = resource_of(inventory, config("packed"))
    available = [d.id for d in resource.devices]
    two = preferred(resource, available, [], 2, policy=config("packed").allocation_policy)
    assert len({resource.find(i).unit.uuid for i in two}) == 1
    with pytest.raises(ConfigError) as e:
        config("spread")
    assert e.value.message.startswith("p.yaml: flags.plugin.sharedDevicesAllocationPolicy") and "\n" not in (
        e.value.message
    )
