"""GetPreferredAllocation's topology choice (plugin_topology.best, through plugin_allocation.preferred)
on topologies written out: NVLinks first, then the nearest PCIe ancestor, must-include kept,
NVML order on ties. (With NVML, on the simulated host and the real kubelet:
tests/e2e/test_kubelet_topology_health.py.)"""

import pytest

from oci_gpu_hook.node import plugin_allocation, plugin_topology
from oci_gpu_hook.node.plugin_devices import Advertised, Resource, Unit
from oci_gpu_hook.node.plugin_topology import NVLINK_SCORE, PCIE_SCORES, Topology

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
    got = plugin_allocation.preferred(resource(8), [GPUS[i] for i in available], [GPUS[i] for i in must], size,
                                      known)  # fmt: skip
    assert got == [GPUS[i] for i in want]


def test_greedy_past_the_set_limit_keeps_the_close_ones_together(monkeypatch):
    monkeypatch.setattr(plugin_topology, "MAX_SETS", 1)  # 8 choose 2 is past it: one GPU at a time
    got = plugin_topology.best(GPUS, [GPUS[6]], 1, topology([(0, 1), (6, 7)]))
    assert got == [GPUS[7]]


def test_numa_node_from_sysfs(tmp_path):
    device = tmp_path / "sys/bus/pci/devices/0000:07:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("1\n")
    assert plugin_topology.numa_node(str(tmp_path), "0000:07:00.0") == 1
    (device / "numa_node").write_text("-1\n")  # a machine without NUMA: none given
    assert plugin_topology.numa_node(str(tmp_path), "0000:07:00.0") is None
    assert plugin_topology.numa_node(str(tmp_path), "0000:0f:00.0") is None
