"""Where the GPUs sit, for the device plugin: each GPU's NUMA node (from sysfs, as the kubelet's
topology manager takes it in ListAndWatch), and how closely each pair of GPUs is joined (from
NVML: the NVLinks between them and their PCIe common ancestor), which GetPreferredAllocation uses
to give a container GPUs that talk to each other fast.

The preference: among the sets of the requested size that hold the must-include devices, the one
whose pairs score highest, NVLinks counting most, then the nearer PCIe ancestor (the pair scores
of NVIDIA's best-effort policy); ties go to NVML order, never to the order of the request. NVIDIA's
policy gives instead the best group of the best split of every free GPU into groups of the size;
bench/preferred_allocation.py measures both (docs/kubernetes.md has the figures, and why this
one). When NVML cannot tell (no NVML, a GPU it does not list), the pair scores nothing and NVML
order decides.
"""

from __future__ import annotations

import itertools

from oci_gpu_hook.errors import NvmlError
from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.start.digits import decimal
from oci_gpu_hook.start.inventory import host_path

# A pair's score by NVML's nvmlGpuTopologyLevel_t: INTERNAL (one board), SINGLE (one PCIe switch),
# MULTIPLE (several switches), HOSTBRIDGE, NODE (one CPU), SYSTEM (across CPUs). An NVLink is
# worth more than any PCIe path.
PCIE_SCORES = {0: 60, 10: 50, 20: 40, 30: 30, 40: 20, 50: 10}
NVLINK_SCORE = 100
# Past this many candidate sets the choice is made greedily, one GPU at a time (C(16, 8) = 12870
# sets is the most a 16-GPU node asks for).
MAX_SETS = 20000


class Topology(Frozen):
    __slots__ = ("numa", "pairs")
    numa: dict  # GPU uuid -> NUMA node, for the GPUs sysfs names one for
    pairs: dict  # frozenset({uuid, uuid}) -> score

    def score(self, uuids) -> int:
        return sum(self.pairs.get(frozenset(p), 0) for p in itertools.combinations(uuids, 2))


EMPTY = Topology({}, {})


def numa_node(sys_root: str, bus_id: str) -> int | None:
    """The NUMA node sysfs gives the PCI device (/sys/bus/pci/devices/<bus id>/numa_node); None
    where there is none (-1: a machine with one node) or the file cannot be read."""
    try:
        with open(host_path(sys_root, f"/sys/bus/pci/devices/{bus_id.lower()}/numa_node"), errors="replace") as f:
            return decimal(f.read(64).strip())
    except OSError:
        return None


def _bus_key(bus_id: str):
    """(domain, bus, device, function) of 0000:07:00.0 or NVML's 00000000:07:00.0."""
    try:
        domain, bus, rest = bus_id.strip().split(":")
        device, function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)
    except ValueError:
        return None


def read(inventory, reader, sys_root: str) -> Topology:
    """The inventory's GPUs' topology; NVML's part is left empty when NVML fails."""
    numa = {g.uuid: n for g in inventory.gpus if (n := numa_node(sys_root, g.bus_id)) is not None}
    try:
        pairs = _nvml_pairs(inventory, reader)
    except NvmlError:
        pairs = {}
    return Topology(numa, pairs)


def _nvml_pairs(inventory, reader) -> dict:
    nvml = reader.module()
    call = reader._call
    by_bus = {_bus_key(g.bus_id): g.uuid for g in inventory.gpus}
    handles = {}
    for gpu in inventory.gpus:
        try:
            handles[gpu.uuid] = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid.encode())
        except nvml.NVMLError:
            continue  # a GPU NVML does not list: no score, and its health says why
    pairs: dict = {}
    for (a, ha), (b, hb) in itertools.combinations(handles.items(), 2):
        level = call(nvml.nvmlDeviceGetTopologyCommonAncestor, ha, hb)
        if level is not None:
            pairs[frozenset((a, b))] = PCIE_SCORES.get(level, 0)
    for uuid, handle in handles.items():
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                    continue
                peer = by_bus.get(_bus_key(_text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)))
            except nvml.NVMLError_NotSupported:
                continue  # no such link on this part (or no NVLink at all)
            except nvml.NVMLError:
                break  # past nvml.h's NVML_NVLINK_MAX_LINKS (INVALID_ARGUMENT)
            # Each end reports the link: half a link's score from each keeps one link one NVLINK_SCORE.
            if peer is not None and peer != uuid:
                key = frozenset((uuid, peer))
                pairs[key] = pairs.get(key, 0) + NVLINK_SCORE // 2
    return pairs


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def best(candidates: list, fixed: list, need: int, topology: Topology) -> list:
    """need of candidates (uuids, in NVML order) that with fixed score highest; earlier wins ties.
    Past MAX_SETS sets, one at a time: each the candidate that adds most to the score of fixed
    and those chosen (so with nothing fixed, the first candidate first)."""
    if need <= 0 or not candidates:
        return []
    need = min(need, len(candidates))
    if _count(len(candidates), need) <= MAX_SETS:
        chosen, top = None, -1
        for combo in itertools.combinations(candidates, need):
            score = topology.score(list(fixed) + list(combo))
            if score > top:
                chosen, top = list(combo), score
        return chosen
    chosen: list = []
    rest = list(candidates)
    while len(chosen) < need:
        pick = max(rest, key=lambda u: (topology.score(list(fixed) + chosen + [u]), -rest.index(u)))
        chosen.append(pick)
        rest.remove(pick)
    return chosen


def _count(n: int, k: int) -> int:
    from math import comb

    return comb(n, k)
