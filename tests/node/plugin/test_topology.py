"""GetPreferredAllocation's topology choice (topology.best, through allocation.preferred)
on topologies written out: NVLinks first, then the nearest PCIe ancestor, must-include kept,
NVML order on ties. (With NVML, on the simulated host and the real kubelet:
tests/e2e/test_kubelet_topology_health.py.)"""

from types import SimpleNamespace

import pytest

from oci_gpu_hook.node.plugin import allocation
from oci_gpu_hook.node.plugin import topology as plugin_topology
from oci_gpu_hook.node.plugin.resources import Advertised, Resource, Unit
from oci_gpu_hook.node.plugin.topology import NVLINK_SCORE, PCIE_SCORES, Topology

GPUS = [f"GPU-{i}" for i in range(8)]


def topology(switches=(), nvlinks=(), numa=(0, 0, 0, 0, 1, 1, 1, 1)) -> Topology:
    """Pairs under one switch score SINGLE, on one NUMA node NODE, else SYSTEM; each NVLink adds."""
    switch = {i: n for n, group in enumerate(switches) for i in group}
    pairs = {}
    for a in range(8):
        for b in range(a + 1, 8):
            if a in switch and switch.get(a) == switch.get(b):
                level = 10
            else:
                level = 40 if numa[a] == numa[b] else 50
            pairs[frozenset((GPUS[a], GPUS[b]))] = PCIE_SCORES[level]
    for a, b in nvlinks:
        pairs[frozenset((GPUS[a], GPUS[b]))] += NVLINK_SCORE
    return Topology({}, pairs)


def resource(n=4) -> Resource:
    units = [Unit(GPUS[i], str(i), None, None) for i in range(n)]
    return Resource("nvidia.com/gpu", tuple(Advertised(u.uuid, u, None) for u in units), 1, None, False)


@pytest.mark.parametrize("switches, nvlinks, available, must, size, want", [
    # GPUs 0+2 and 1+3 share a switch: a pair on one switch, not NVML's first two.
    ([(0, 2), (1, 3)], [], [0, 1, 2, 3], [], 2, [0, 2]),
    ([(0, 2), (1, 3)], [], [1, 2, 3], [], 2, [1, 3]),
    ([(0, 2), (1, 3)], [], [0, 1, 2, 3], [3], 2, [3, 1]),  # must-include first, then its switch mate
    # An NVLink outweighs a shared switch.
    ([(0, 2), (1, 3)], [(0, 1)], [0, 1, 2, 3], [], 2, [0, 1]),
    # Four of eight with GPU 5: its NUMA node's four (4-7), two switch pairs, over any mix.
    ([(0, 1), (2, 3), (4, 5), (6, 7)], [], list(range(8)), [5], 4, [5, 4, 6, 7]),
    # No topology known (NVML failed): NVML order.
    (None, [], [3, 2, 1, 0], [], 2, [0, 1]),
])  # fmt: skip
def test_preferred_by_topology(switches, nvlinks, available, must, size, want):
    known = plugin_topology.EMPTY if switches is None else topology(switches, nvlinks)
    got = allocation.preferred(resource(8), [GPUS[i] for i in available], [GPUS[i] for i in must], size, known)
    assert got == [GPUS[i] for i in want]


def test_greedy_past_the_set_limit_keeps_the_close_ones_together(monkeypatch):
    monkeypatch.setattr(plugin_topology, "MAX_SETS", 1)  # 8 choose 2 is past it: one GPU at a time
    got = plugin_topology.best(GPUS, [GPUS[6]], 1, topology([(0, 1), (6, 7)]))
    assert got == [GPUS[7]]


SWITCH_PAIRS = [(0, 1), (2, 3), (4, 5), (6, 7)]


@pytest.mark.parametrize("nvlinks, must, need, exhaustive, greedy", [
    # Nothing to include: the greedy first pick is a tie (one GPU scores nothing), so NVML's first
    # free GPU, then its switch mate; the whole search finds the NVLinked pair.
    ([(2, 3)], [], 2, [2, 3], [0, 1]),
    # With GPU 4: its switch mate first (a switch outscores one NUMA node), then the first GPU of
    # the other switch on its node; the whole search takes the NVLinked pair 6+7 with it.
    ([(6, 7)], [4], 2, [6, 7], [5, 6]),
])  # fmt: skip
def test_greedy_past_the_set_limit_is_one_gpu_at_a_time(monkeypatch, nvlinks, must, need, exhaustive, greedy):
    """Where the greedy choice and the exhaustive one differ: greedy is what docs/kubernetes.md
    promises past MAX_SETS, each next GPU the free one that adds most to the score of those
    already chosen (the must-include ones among them), NVML order on ties."""
    known = topology(SWITCH_PAIRS, nvlinks)
    candidates = [g for g in GPUS if g not in [GPUS[i] for i in must]]
    fixed = [GPUS[i] for i in must]
    assert plugin_topology.best(candidates, fixed, need, known) == [GPUS[i] for i in exhaustive]
    monkeypatch.setattr(plugin_topology, "MAX_SETS", 1)
    assert plugin_topology.best(candidates, fixed, need, known) == [GPUS[i] for i in greedy]


@pytest.mark.parametrize("switches, nvlinks, must, size", [
    (SWITCH_PAIRS, [], [], 2),
    (SWITCH_PAIRS, [(2, 3)], [], 3),
    ([(0, 1, 2), (3, 4), (5, 6, 7)], [(2, 3), (4, 5), (0, 7)], [], 2),  # bench/preferred_allocation.py's uneven
    ([(0, 1, 2), (3, 4), (5, 6, 7)], [(2, 3), (4, 5), (0, 7)], [5], 4),
    ([], [], [], 2),  # every pair alike: ties all the way
])  # fmt: skip
def test_the_preferred_allocation_does_not_depend_on_the_order_of_the_request(switches, nvlinks, must, size):
    """The kubelet sends the available ids in no set order (a Go map's): the answer is the same
    for every order of them, and of the must-include ones (NVIDIA's best-effort policy breaks ties
    by the order it is given)."""
    import random

    known = topology(switches, nvlinks)
    available, required = list(GPUS), [GPUS[i] for i in must]
    first = allocation.preferred(resource(8), available, required, size, known)
    rng = random.Random(52)
    for _ in range(200):
        rng.shuffle(available)
        rng.shuffle(required)
        assert allocation.preferred(resource(8), available, required, size, known) == first


def test_numa_node_from_sysfs(tmp_path):
    device = tmp_path / "sys/bus/pci/devices/0000:07:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("1\n")
    assert plugin_topology.numa_node(str(tmp_path), "0000:07:00.0") == 1
    (device / "numa_node").write_text("-1\n")  # a machine without NUMA: none given
    assert plugin_topology.numa_node(str(tmp_path), "0000:07:00.0") is None
    (device / "numa_node").write_text("\u0661\n")  # an Arabic-Indic 1, which int() reads as 1: no node
    assert plugin_topology.numa_node(str(tmp_path), "0000:07:00.0") is None
    assert plugin_topology.numa_node(str(tmp_path), "0000:0f:00.0") is None


@pytest.mark.parametrize("policy, want", [("distributed", ["GPU-0::0", "GPU-1::0"]),
                                          ("packed", ["GPU-0::0", "GPU-0::1"])])  # fmt: skip
def test_topology_is_never_applied_to_time_sliced_replicas(policy, want):
    """docs/kubernetes.md: topology chooses among whole, unshared GPUs only; time-sliced replicas go
    by flags.plugin.sharedDevicesAllocationPolicy alone. On GPUs 0+2 and 1+3 under one switch each,
    topology gives a container GPUs 0 and 2; replicas are spread (or packed) as if it were not known."""
    known = topology([(0, 2), (1, 3)])
    assert allocation.preferred(resource(4), GPUS[:4], [], 2, known) == [GPUS[0], GPUS[2]]  # whole GPUs
    units = [Unit(GPUS[i], str(i), SimpleNamespace(uuid=GPUS[i]), None) for i in range(4)]  # packed counts by GPU
    shared = Resource("nvidia.com/gpu", tuple(Advertised(f"{u.uuid}::{r}", u, r) for u in units for r in range(2)),
                      2, None, False)  # fmt: skip
    ids = [d.id for d in shared.devices]
    assert allocation.preferred(shared, ids, [], 2, known, policy) == want
    assert allocation.preferred(shared, ids, [], 2, plugin_topology.EMPTY, policy) == want
