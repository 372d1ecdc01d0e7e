"""The device plugin's preferred allocation of whole GPUs, measured against NVIDIA's best-effort
policy (go-gpuallocator, which NVIDIA's device plugin uses) over sequences of requests, on the
simulator's 8-GPU topologies: `python3 bench/preferred_allocation.py` (root, gcc, pynvml; a few
minutes on 2 CPUs). docs/kubernetes.md (Topology and XID health) gives its last figures, and
why the plugin keeps its own policy.

The two policies score a set of GPUs alike (topology.Topology.score: every pair's NVLinks, then
their nearest common PCIe ancestor) and choose differently:
- single: the plugin's (topology.best): the set of the requested size with the highest score;
- partition: NVIDIA's. All the free GPUs are split into groups of the requested size (and one
  short group where they do not divide evenly), the split whose groups score highest together
  is taken, and the best group of that split is given: what stays free stays well joined. Ties
  go to the first found, in NVML order here. NVIDIA's code may give the short group, fewer GPUs
  than asked, when it scores highest; here only a whole group is given.
Each policy runs on its own node through the same random steps: a request for 1, 2 or 4 GPUs
(each equally likely) or, one step in three, the release of a random earlier allocation. A
request that does not fit is dropped (churn), or empties the node first (fill: no releases).
Figures over every request of every sequence: given, the score of what each request got as a
share of the best set of that size on an empty node (given2, given4: of the requests of 2 and 4);
left2, left4: the best set of 2 (4) GPUs left free after each request, as the same share;
differs: the requests where the other policy, from the same state, would have chosen another
set; ms: the mean time of one choice (Python, this machine).

The topologies are the simulator's (`simulate --pcie-switches --nvlink`), read back as the
plugin reads them (topology.read: the simulated NVML's common ancestors and NVLinks):
- pcie: the default, GPUs in pairs under four PCIe switches, two switches per NUMA node;
- nvlink-pairs: the same, and each switch pair joined by an NVLink;
- cube-mesh: DGX-1's hybrid cube mesh of NVLinks (two rings of four, joined across), which has
  no hierarchy (the case NVIDIA's comment gives for splitting every free GPU);
- ring: one ring of NVLinks through all eight;
- uneven, uneven2: switches of three, two and three GPUs (two, four and two), with three NVLinks
  across them: no two groups alike.
"""

import argparse
import itertools
import json
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from oci_gpu_hook.node.plugin import topology  # noqa: E402

TOPOLOGIES = {
    "pcie": {},
    "nvlink-pairs": {"nvlinks": "0+1,2+3,4+5,6+7"},
    "cube-mesh": {"nvlinks": "0+1,0+2,0+3,1+2,1+3,2+3,4+5,4+6,4+7,5+6,5+7,6+7,0+4,1+5,2+6,3+7"},
    "ring": {"nvlinks": "0+1,1+2,2+3,3+4,4+5,5+6,6+7,7+0"},
    "uneven": {"pcie_switches": "0+1+2,3+4,5+6+7", "nvlinks": "2+3,4+5,0+7"},
    "uneven2": {"pcie_switches": "0+1,2+3+4+5,6+7", "nvlinks": "1+2,5+6,3+7"},
}
SIZES = (1, 2, 4)


def _splits(gpus: list, size: int):
    """Every split of gpus into groups of size, and one short group of what is left over where
    they do not divide evenly (any of them: not only the last), each split once."""
    short = len(gpus) % size
    for left_over in itertools.combinations(gpus, short) if short else [()]:
        rest = [g for g in gpus if g not in left_over]
        for groups in _whole_splits(rest, size):
            yield groups + ([list(left_over)] if short else [])


def _whole_splits(gpus: list, size: int):
    """Every split of gpus (a multiple of size) into groups of size: the first GPU left always
    starts the next group, so no split comes twice."""
    if not gpus:
        yield []
        return
    first, rest = gpus[0], gpus[1:]
    for others in itertools.combinations(rest, size - 1):
        left = [g for g in rest if g not in others]
        for split in _whole_splits(left, size):
            yield [[first, *others], *split]


def partition(candidates: list, fixed: list, need: int, known) -> list:
    """NVIDIA's best-effort choice of need GPUs from candidates (uuids, in NVML order) to go with
    fixed (the must-include ones): the best group, holding fixed, of the best split of all of
    them; earlier wins ties, at both steps."""
    if need <= 0 or not candidates:
        return []
    need = min(need, len(candidates))
    size = need + len(fixed)
    best_split, top = None, -1
    for split in _splits(list(fixed) + list(candidates), size):
        if not any(len(g) == size and set(fixed) <= set(g) for g in split):
            continue
        score = sum(known.score(g) for g in split)
        if score > top:
            best_split, top = split, score
    groups = [g for g in best_split if len(g) == size and set(fixed) <= set(g)]
    chosen = max(groups, key=lambda g: (known.score(g), -groups.index(g)))
    return [g for g in chosen if g not in fixed]


def single(candidates: list, fixed: list, need: int, known) -> list:
    """The set of the requested size that scores highest, alone."""
    return topology.best(candidates, fixed, need, known)


def best_score(gpus: list, size: int, known) -> int:
    return max((known.score(c) for c in itertools.combinations(gpus, size)), default=0)


def run_sequence(policy, other, gpus: list, known, steps: list, fill: bool) -> list:
    """[(size, score given, {k: best score of k GPUs left free}, whether other would have chosen
    differently)] for one sequence of steps: ("ask", size) or ("release", a random number). A
    request that does not fit empties the node first (fill) or is dropped (churn)."""
    free, held, out = list(gpus), [], []
    for kind, value in steps:
        if kind == "release":
            if held:
                free += held.pop(int(value * len(held)))
                free.sort(key=gpus.index)
            continue
        if value > len(free):
            if not fill:
                continue
            free, held = list(gpus), []
        started = time.perf_counter()
        given = policy(free, [], value, known)
        spent = time.perf_counter() - started
        assert len(given) == value and len(set(given)) == value and set(given) <= set(free), given
        differs = set(other(free, [], value, known)) != set(given)
        free = [g for g in free if g not in given]
        held.append(given)
        left = {k: best_score(free, k, known) for k in SIZES[1:] if len(free) >= k}
        out.append((value, known.score(given), left, differs, spent))
    return out


def make_steps(rng, count: int, release_share: float) -> list:
    return [("release", rng.random()) if rng.random() < release_share else ("ask", rng.choice(SIZES))
            for _ in range(count)]  # fmt: skip


def read_topology(config: str) -> dict:
    """{"gpus": uuids in NVML order, "pairs": [[uuid, uuid, score]]} of a simulated host, as the
    plugin reads it (topology.read)."""
    from oci_gpu_hook.node.nvml_reader import NvmlReader
    from oci_gpu_hook.start import inventory_cache
    from oci_gpu_hook.start import settings as settings_module

    settings_module.RUN_DIR = os.path.join(os.path.dirname(config), "run")  # compiled settings stay there
    settings = settings_module.load(config)
    inventory = inventory_cache.load(settings)
    reader = NvmlReader(inventory)
    try:
        known = topology.read(inventory, reader, settings.node.sys_root)
    finally:
        reader.close()
    return {"gpus": [g.uuid for g in inventory.gpus], "pairs": [[*sorted(p), s] for p, s in known.pairs.items()]}


def read_topologies(work: str) -> dict:
    """{name: (GPU uuids in NVML order, Topology)} of each simulated host. Each is read in a process
    of its own: NVML's library is loaded once per process, and each host has its own."""
    import subprocess

    from oci_gpu_hook.toolkit.simulate import simulate

    found = {}
    for name, options in TOPOLOGIES.items():
        host = simulate(os.path.join(work, name), gpus=8, **options)
        done = subprocess.run([sys.executable, __file__, "--read-topology", f"{host['root']}/config.yaml"],
                              capture_output=True, text=True, check=True)  # fmt: skip
        doc = json.loads(done.stdout)
        pairs = {frozenset((a, b)): score for a, b, score in doc["pairs"]}
        assert pairs, f"{name}: NVML gave no topology"
        found[name] = (doc["gpus"], topology.Topology({}, pairs))
    return found


SCENARIOS = {"churn": (1 / 3, False), "fill": (0.0, True)}


def measure(topologies: dict, sequences: int, steps: int, seed: int) -> dict:
    """{topology: {scenario: {policy: figures}}}: per request size, the score given as a % of the
    best set of that size on the empty node; per size k, the best set of k left free after each
    request, as the same %; and the requests where the other policy would have chosen otherwise."""
    results = {}
    policies = {"single": (single, partition), "partition": (partition, single)}
    for name, (gpus, known) in topologies.items():
        tops = {size: best_score(gpus, size, known) for size in SIZES}
        results[name] = {}
        for scenario, (release_share, fill) in SCENARIOS.items():
            rng = random.Random(seed)
            plans = [make_steps(rng, steps, release_share) for _ in range(sequences)]
            by_policy = {}
            for policy_name, (policy, other) in policies.items():
                rows = [row for plan in plans for row in run_sequence(policy, other, gpus, known, plan, fill)]
                figures = {
                    "requests": len(rows),
                    "differs": sum(r[3] for r in rows),
                    "given": round(100 * sum(r[1] for r in rows) / sum(tops[r[0]] for r in rows), 2),
                    "ms": round(1000 * sum(r[4] for r in rows) / len(rows), 3),
                }
                for size in SIZES[1:]:
                    mine = [r for r in rows if r[0] == size]
                    figures[f"given{size}"] = round(100 * sum(r[1] for r in mine) / (len(mine) * tops[size]), 2)
                    left = [r[2][size] for r in rows if size in r[2]]
                    figures[f"left{size}"] = round(100 * sum(left) / (len(left) * tops[size]), 2)
                by_policy[policy_name] = figures
            results[name][scenario] = by_policy
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=200)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=52)
    parser.add_argument("--json", help="write the figures there too")
    parser.add_argument("--read-topology", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.read_topology:
        print(json.dumps(read_topology(args.read_topology)))
        return 0
    with tempfile.TemporaryDirectory(prefix="preferred-allocation-") as work:
        topologies = read_topologies(work)
    results = measure(topologies, args.sequences, args.steps, args.seed)
    print(
        f"{args.sequences} sequences of {args.steps} steps per topology and scenario (seed {args.seed}); scores "
        "as % of the best set of that size on an empty node"
    )
    columns = ["requests", "differs", "given", "given2", "given4", "left2", "left4", "ms"]
    print(f"{'topology':13} {'scenario':8} {'policy':9} " + " ".join(f"{c:>8}" for c in columns))
    for name, scenarios in results.items():
        for scenario, by_policy in scenarios.items():
            for policy_name, figures in by_policy.items():
                print(f"{name:13} {scenario:8} {policy_name:9} " + " ".join(f"{figures[c]:>8}" for c in columns))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
