"""The GPU cluster's figures for `make bench` (issue 48), on tests/gpuclustercheck.py's cluster: one
control plane and three nodes on this machine (A: 8 A100s, four in MIG mode, on CRI-O; B: 4 T4s on
containerd; C: no GPU), our DaemonSets rolled out onto A and B by `kubectl apply` alone.
- the time from `kubectl apply` of deploy/kubernetes/ to every pod of ours running with every
  container ready, on both GPU nodes (toolkit, node services, labels: six pods);
- per GPU node, the CPU (in cores) and the resident memory of those pods' processes, first idle
  for --seconds, then for --seconds while GPU pods churn on that node (one created, run to its
  end, deleted, and the next).
The CPU is each process's user and system time (/proc/PID/stat), summed over the processes in the
pods' cgroups at the start and end of a window; the memory the sum of their resident sets at the
window's end. Writes the "cluster" part of bench/results.json (the rest kept) and prints them.
"""

import argparse
import datetime
import os
import pathlib
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

import gpuclustercheck  # noqa: E402 - tests/gpuclustercheck.py: the cluster the test runs
import prerequisites  # noqa: E402 - tests/prerequisites.py: what the test requires, by the same rule
import results  # noqa: E402 - bench/results.py

TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def our_pods(api, node: str) -> list:
    ours = gpuclustercheck.DAEMONSETS
    return [p["metadata"]["uid"] for p in api.get("pods", "-n", gpuclustercheck.NS)["items"]
            if p["spec"].get("nodeName") == node and p["metadata"].get("labels", {}).get("app.kubernetes.io/name")
            in ours]  # fmt: skip


def processes_of(uids: list) -> list:
    """The pids whose cgroup is one of the pods' (the kubelet names each pod's cgroup pod<uid>)."""
    marks = [f"pod{uid}" for uid in uids] + [f"pod{uid.replace('-', '_')}" for uid in uids]
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cgroup") as f:
                text = f.read()
        except OSError:
            continue  # gone meanwhile
        if any(mark in text for mark in marks):
            found.append(int(name))
    return found


def cpu_and_memory(pids: list) -> tuple:
    """(CPU seconds so far, resident bytes) summed over pids that still run."""
    seconds, resident = 0.0, 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/statm") as f:
                resident += int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            continue
        seconds += (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime
    return seconds, resident


def window(api, node: str, seconds: float, during=None) -> dict:
    """Our pods' CPU (cores) and memory (MiB) on node over a window; during(): called until it ends."""
    pids = processes_of(our_pods(api, node))
    start_cpu, _ = cpu_and_memory(pids)
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if during is not None:
            during()
        else:
            time.sleep(1)
    elapsed = time.monotonic() - started
    end_cpu, resident = cpu_and_memory(pids)
    return {"cores": round((end_cpu - start_cpu) / elapsed, 4), "rss_mib": round(resident / (1 << 20), 1),
            "processes": len(pids), "seconds": round(elapsed, 1)}  # fmt: skip


def churn(api, node: str, product: str, count: list) -> None:
    """One GPU pod on node: created, run to its end (nvidia-smi -L), deleted."""
    name = f"churn-{count[0]}"
    count[0] += 1
    pod = gpuclustercheck.pod(
        name,
        command="nvidia-smi -L",
        resources={"nvidia.com/gpu": "1"},
        nodeSelector={"nvidia.com/gpu.product": product},
    )
    api.apply(pod)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        phase = api.get("pod", name).get("status", {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(0.5)
    api.kubectl("delete", "pod", name, "--wait=true", "--timeout=60s")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--output", default=os.path.join(HERE, "results.json"))
    args = parser.parse_args()
    # What the test requires (it fails there without them), checked before a cluster is built:
    # one missing would end the run minutes later, in the middle of a node's start.
    lacking = prerequisites.absent(*gpuclustercheck.NEEDS)
    if lacking:
        sys.exit(f"bench/cluster.py: needs {', '.join(lacking)} (run as root, after `make setup`)")
    with tempfile.TemporaryDirectory(prefix="oci-gpu-hook-bench-cluster-", dir="/tmp") as work:
        with gpuclustercheck.gpu_cluster(pathlib.Path(work)) as (cluster, _, rolled_out):
            api = cluster[gpuclustercheck.A]
            nodes = {}
            for node in gpuclustercheck.GPU_NODES:
                product = cluster[node].node()["metadata"]["labels"]["nvidia.com/gpu.product"]
                count = [0]
                idle = window(api, node, args.seconds)
                busy = window(api, node, args.seconds, lambda node=node, product=product, count=count:
                              churn(api, node, product, count))  # fmt: skip
                busy["pods"] = count[0]
                nodes[node] = {"idle": idle, "churn": busy}
    figures = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cluster": "3 nodes: 8 A100 (4 MIG) on CRI-O, 4 T4 on containerd, 1 without GPU; all on this machine",
        "rollout_seconds": round(rolled_out, 1),
        "nodes": nodes,
    }
    results.save_part(args.output, "cluster", figures)
    print(f"kubectl apply to every pod of ours running on both GPU nodes: {rolled_out:.1f} s")
    for node, figures_ in nodes.items():
        for state, f in figures_.items():
            extra = f", {f['pods']} GPU pods" if "pods" in f else ""
            print(f"  {node} {state}: {f['cores']:.3f} cores, {f['rss_mib']:.1f} MiB in {f['processes']} processes "
                  f"over {f['seconds']:.0f} s{extra}")  # fmt: skip


if __name__ == "__main__":
    main()
