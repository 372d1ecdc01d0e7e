"""The exporter's cost per scrape with every field of DCGM exporter's default list, for `make bench`
(issue 49): the exporter of this checkout against the exporter before that work (BASELINE, taken
from git), on one simulated 8-GPU H100 host (GPM on), with 50 container records whose processes
NVML reports, each process with a utilization sample.

Each exporter runs in a process of its own, built as its `oci-gpu-hook exporter` builds it, and
renders pages by calling its scrape directly (not over HTTP, whose 1 s page reuse would hide the
render): the CPU time of the whole process per page (its XID thread included, for the new one),
and the wall time. Writes the "exporter_fields" part of bench/results.json (the rest kept) and
prints the figures and the issue's goals (at most 2x the baseline's CPU per scrape, under 50 ms).
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

import node  # noqa: E402 - bench/node.py: the records and processes of its exporter figures
import results  # noqa: E402 - bench/results.py

from oci_gpu_hook.toolkit.simulate import control, simulate  # noqa: E402

# The last commit before issue 49's exporter: device series repeated per holder, nine DCGM fields.
BASELINE = "2e0f452"
PYTHON = sys.executable  # the venv's: the exporter needs its packages (pynvml, yaml)

PROBE = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from oci_gpu_hook.node.exporter import Exporter
from oci_gpu_hook.node.nvml_reader import HostReader
from oci_gpu_hook.start import settings as settings_module
settings = settings_module.load(sys.argv[2])
try:  # as its run() builds it: this checkout's reads every field
    reader = HostReader(settings, detail=True, tell=lambda line: None)
except TypeError:  # the baseline's reader takes the settings alone
    reader = HostReader(settings)
exporter = Exporter(reader, settings.records_path)
page = exporter.scrape()  # NVML started, the first GPM samples taken
cpu, wall = [], []
for _ in range(int(sys.argv[3])):
    c, w = time.process_time(), time.perf_counter()
    page = exporter.scrape()
    cpu.append(time.process_time() - c)
    wall.append(time.perf_counter() - w)
lines = [l for l in page.splitlines() if l and not l.startswith("#")]
print(json.dumps({"cpu_ms": sorted(cpu)[len(cpu) // 2] * 1e3, "wall_ms": sorted(wall)[len(wall) // 2] * 1e3,
                  "series": len(lines), "bytes": len(page),
                  "families": sorted({l.split("{")[0].split(" ")[0] for l in lines})}))
"""


def baseline_site(work: str) -> str:
    """The package as it was at BASELINE, unpacked under work."""
    site = os.path.join(work, "baseline")
    os.mkdir(site)
    archive = subprocess.run(["git", "-C", REPO, "archive", BASELINE, "oci_gpu_hook"], check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", site], input=archive, check=True)
    return site


def measure(site: str, config: str, scrapes: int) -> dict:
    out = subprocess.run([PYTHON, "-I", "-c", PROBE, site, config, str(scrapes)], check=True, capture_output=True,
                         text=True).stdout  # fmt: skip
    return json.loads(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=os.path.join(HERE, "results.json"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/exporter_fields.py: run as root (the exporter reads root's records)")
    with tempfile.TemporaryDirectory(prefix="oci-gpu-hook-bench-exporter-") as work:
        host = simulate(os.path.join(work, "host"), gpus=8, model="h100")
        root, records, sleepers, devices = node._processes_on(host, 50)
        try:
            from oci_gpu_hook.start import container_record

            processes, utilization = [], []
            for i, proc in enumerate(sleepers):
                gpu_uuid, _ = devices[i % len(devices)]
                container_record.write(records, node.pod_record(i, proc.pid, gpu_uuid, None, {gpu_uuid: 8 << 30}))
                processes.append((gpu_uuid, proc.pid, (i + 1) << 20))
                utilization.append((gpu_uuid, proc.pid, 20, 10, 0, 0))
            values = {g["uuid"]: {"util_gpu": 50, "temperature": 60, "gpm_tensor_util": 40, "gpm_dram_util": 30}
                      for g in host["gpus"]}  # fmt: skip
            control.write(root, values, processes, process_utilization=utilization)
            config = os.path.join(root, "config.yaml")
            old_site = baseline_site(work)
            rounds = []
            for _ in range(args.rounds):  # alternated, so that load from other work moves both alike
                rounds.append((measure(old_site, config, args.scrapes), measure(REPO, config, args.scrapes)))
        finally:
            for proc in sleepers:
                proc.kill()
                proc.wait()
    old = {k: statistics.median(r[0][k] for r in rounds) for k in ("cpu_ms", "wall_ms", "series", "bytes")}
    new = {k: statistics.median(r[1][k] for r in rounds) for k in ("cpu_ms", "wall_ms", "series", "bytes")}
    ratio = statistics.median(r[1]["cpu_ms"] / r[0]["cpu_ms"] for r in rounds)
    figures = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": "simulated, 8 H100 GPUs (GPM), 50 containers with a GPU process each",
        "baseline": BASELINE,
        "baseline_exporter": old,
        "exporter": new,
        "families": rounds[-1][1]["families"],
        "cpu_ratio": ratio,
        "goals": {"CPU per scrape <= 2x the baseline's": ratio <= 2, "scrape < 50 ms": new["wall_ms"] < 50},
    }
    results.save_part(args.output, "exporter_fields", figures)
    print(f"exporter scrape, 8 H100s, 50 containers: CPU {new['cpu_ms']:.1f} ms against {old['cpu_ms']:.1f} ms before "
          f"({ratio:.2f}x), wall {new['wall_ms']:.1f} ms against {old['wall_ms']:.1f} ms; {new['series']:.0f} series "
          f"against {old['series']:.0f}; {len(figures['families'])} families")  # fmt: skip
    for goal, met in figures["goals"].items():
        print(f"  {goal}: {'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
