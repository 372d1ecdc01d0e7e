"""The node services' figures for `make bench` (bench/run.py calls node_figures):
- the container record: what writing it adds to a GPU container's start (the module's import,
  given what a GPU start has imported already, plus building and writing one record);
- the exporter: one scrape of /metrics with 8 GPUs and 50 container records (each container with
  a GPU process NVML reports), timed over HTTP, and the exporter's resident memory after them.
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

PYTHON = os.path.realpath(sys.executable)

RECORD_PROBE = r"""
import os, sys, time, json
sys.path.insert(0, sys.argv[1])
from oci_gpu_hook.start import apply, inventory_cache, plan, request, report  # a GPU start has these
t = time.perf_counter()
from oci_gpu_hook.start import container_record
imported = time.perf_counter() - t
from oci_gpu_hook.start.state import ContainerState
state = ContainerState("1.0.2", "bench", "creating", os.getpid(), "/b", {})
directory = sys.argv[2]
times = []
for i in range(300):
    t = time.perf_counter()
    record = container_record.build(state.replace(id=f"bench-{i}"), {}, (), 0.1)
    container_record.write(directory, record)
    times.append(time.perf_counter() - t)
print(json.dumps({"import_ms": imported * 1e3, "write_ms": sorted(times)[len(times) // 2] * 1e3}))
"""


def record_cost(site: str) -> dict:
    """Written where the hook writes them by default: a directory in /run (tmpfs on a real host),
    one new file per start, as container ids are new."""
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="oci-gpu-hook-bench-records-", dir="/run")
    try:
        out = subprocess.run([PYTHON, "-I", "-c", RECORD_PROBE, site, os.path.join(directory, "containers")],
                             check=True, capture_output=True, text=True).stdout  # fmt: skip
    finally:
        shutil.rmtree(directory)
    figures = json.loads(out)
    figures["total_ms"] = figures["import_ms"] + figures["write_ms"]
    return figures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _processes_on(host: dict, count: int):
    """(host root, its records directory, count sleeping processes to stand for GPU processes,
    the host's devices as (GPU UUID, MIG UUID or None)); the caller kills the processes."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    root = host["root"]
    records = os.path.join(root, "containers")
    os.makedirs(records, mode=0o700, exist_ok=True)
    sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(count)]
    devices = [(g["uuid"], m["uuid"] if m else None) for g in host["gpus"] for m in (g["mig"] or [None])]
    return root, records, sleepers, devices


def pod_record(i: int, pid: int, gpu_uuid: str, mig_uuid, limit=None) -> dict:
    """The record of bench pod i, holding one device, as the hook writes it."""
    from oci_gpu_hook.start import container_record, pids

    return {"format": container_record.FORMAT, "id": f"bench-{i}", "outcome": "started", "reason": None,
            "devices": [{"gpu_index": 0, "gpu_uuid": gpu_uuid, "mig_index": None, "mig_uuid": mig_uuid}],
            "pid": pid, "pid_start": pids.start_ticks(pid), "cgroup": f"/bench/{i}",
            "kubernetes": {"pod": f"pod-{i}", "namespace": "bench", "container": "c"},
            "gpu_memory_limit": limit, "time": time.time(), "duration_seconds": 0.05}  # fmt: skip


def exporter_figures(launcher: str, host: dict, runs: int) -> dict:
    from oci_gpu_hook.start import container_record
    from oci_gpu_hook.toolkit.simulate import control

    root, records, sleepers, devices = _processes_on(host, 50)
    port = _free_port()
    exporter = None
    try:
        processes = []
        for i, proc in enumerate(sleepers):
            gpu_uuid, mig_uuid = devices[i % len(devices)]
            container_record.write(records, pod_record(i, proc.pid, gpu_uuid, mig_uuid))
            processes.append((mig_uuid or gpu_uuid, proc.pid, (i + 1) << 20))
        control.write(root, {g["uuid"]: {"util_gpu": 50, "temperature": 60} for g in host["gpus"]}, processes)
        command = [launcher, "--config", os.path.join(root, "config.yaml"), "exporter", "--listen", f"127.0.0.1:{port}"]
        exporter = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url, timeout=10).read()
                break
            except OSError:
                if time.monotonic() > deadline or exporter.poll() is not None:
                    raise RuntimeError("the exporter did not start") from None
                time.sleep(0.1)
        times = []
        for _ in range(max(runs, 30)):
            t = time.perf_counter()
            body = urllib.request.urlopen(url, timeout=10).read()
            times.append(time.perf_counter() - t)
        series = body.count(b'pod="pod-')
        times.sort()
        return {
            "scrape_median_ms": statistics.median(times) * 1e3,
            "scrape_p95_ms": times[int(round(0.95 * (len(times) - 1)))] * 1e3,
            "rss_kib": _rss_kib(exporter.pid),
            "series_with_pod": series,
            "bytes": len(body),
        }
    finally:
        if exporter:
            exporter.terminate()
            exporter.wait()
        for proc in sleepers:
            proc.kill()
            proc.wait()
        control.clear(root)


WATCHDOG_PROBE = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from oci_gpu_hook.node.nvml_reader import HostReader
from oci_gpu_hook.node.watchdog import Watchdog
from oci_gpu_hook.start import settings as settings_module
settings = settings_module.load(sys.argv[2])
watchdog = Watchdog(HostReader(settings), settings.records_path, "kill")
watchdog.scan()  # NVML started
cpu = []
for _ in range(int(sys.argv[3])):
    t = time.process_time()
    acted = watchdog.scan()
    cpu.append(time.process_time() - t)
    assert not acted, acted
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
print(json.dumps({"scan_cpu_ms": sorted(cpu)[len(cpu) // 2] * 1e3, "rss_kib": rss}))
"""


def watchdog_figures(site: str, host: dict, runs: int) -> dict:
    """One watchdog scan with 8 GPUs and 100 GPU processes, 50 containers with limits (none over),
    in CPU time (the daemon's own, NVML included), and the daemon's resident memory after it."""
    from oci_gpu_hook.start import container_record, pids
    from oci_gpu_hook.toolkit.simulate import control

    root, records, sleepers, devices = _processes_on(host, 100)
    try:
        processes = []
        for i, proc in enumerate(sleepers):
            gpu_uuid, mig_uuid = devices[i % len(devices)]
            device = mig_uuid or gpu_uuid
            if i < 50:  # a container each, with a limit its process stays under
                record = {"format": container_record.FORMAT, "id": f"bench-wd-{i}", "outcome": "started",
                          "reason": None, "pid": proc.pid, "pid_start": pids.start_ticks(proc.pid),
                          "devices": [{"gpu_index": 0, "gpu_uuid": gpu_uuid, "mig_index": None, "mig_uuid": mig_uuid}],
                          "cgroup": None, "kubernetes": None, "gpu_memory_limit": {device: 4 << 30},
                          "time": time.time(), "duration_seconds": 0.05}  # fmt: skip
                container_record.write(records, record)
            processes.append((device, proc.pid, (i + 1) << 20))
        control.write(root, processes=processes)
        config = os.path.join(root, "config.yaml")
        out = subprocess.run([PYTHON, "-I", "-c", WATCHDOG_PROBE, site, config, str(max(runs, 30))], check=True,
                             capture_output=True, text=True).stdout  # fmt: skip
        return json.loads(out)
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()
        control.clear(root)
        for name in os.listdir(records):
            if name.startswith("bench-wd-"):
                os.unlink(os.path.join(records, name))
