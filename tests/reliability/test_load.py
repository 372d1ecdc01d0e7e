"""Load: 50 runc containers started at once on a simulated 8-GPU host, each with the hook and its
own set of GPUs (named by index, UUID or PCI bus id), while `inventory refresh` rewrites the cache
the hooks read, again and again, from several processes. Every container must start and see
exactly its GPUs; the cache must never be seen torn. The wall time is reported at the end of the
run ('measurements').
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hookcheck import listed_uuids

from oci_gpu_hook.start.inventory_cache import FORMAT

pytestmark = pytest.mark.host(gpus=8, mig=[1], needs=("runc", "busybox"))

CONTAINERS = 50
REFRESHERS = 4
REFRESH_ROUNDS = 3


def gpu_sets(count: int):
    """count distinct GPU sets: every single GPU, every pair, then triples."""
    sets = [c for size in (1, 2, 3) for c in itertools.combinations(range(8), size)]
    return sets[:count]


def device_value(host, gpus, salt: int) -> str:
    """NVIDIA_VISIBLE_DEVICES for gpus, each named one of three ways."""
    names = []
    for k, index in enumerate(gpus):
        gpu = host["gpus"][index]
        names.append([str(index), gpu["uuid"], gpu["bus_id"]][(salt + k) % 3])
    return ",".join(names)


def cache_reader(path: str, stop: threading.Event, seen: dict) -> None:
    """Read the cache as the hook does, as fast as possible, until stopped; count what was seen."""
    while not stop.is_set():
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            seen["missing"] += 1
            continue
        try:
            doc = json.loads(data)
            assert doc["format"] == FORMAT and len(doc["inventory"]["gpus"]) == 8
            seen["whole"] += 1
        except (ValueError, KeyError, AssertionError):
            seen["torn"] += 1


def test_50_concurrent_containers_each_see_exactly_their_gpus(host, tmp_path, hook_cli, report_measurement):
    from oci_gpu_hook.toolkit import containers

    config = f"{host['root']}/config.yaml"
    out = hook_cli("--config", config, "inventory", "refresh")
    assert out.returncode == 0, out.stderr
    cache = f"{host['root']}/inventory-cache.json"

    sets = gpu_sets(CONTAINERS)
    assert len(set(sets)) == CONTAINERS
    bundles = []
    for i, gpus in enumerate(sets):
        env = {"NVIDIA_VISIBLE_DEVICES": device_value(host, gpus, i)}
        bundles.append(containers.make_bundle(str(tmp_path / f"c{i}"), args=["sh", "-c", "nvidia-smi -L"], env=env,
                                        config_file=config))  # fmt: skip

    stop, seen = threading.Event(), {"whole": 0, "torn": 0, "missing": 0}
    reader = threading.Thread(target=cache_reader, args=(cache, stop, seen))
    refresh = [*containers.hook_command(config), "inventory", "refresh"]
    rounds = " && ".join([" ".join(refresh)] * REFRESH_ROUNDS)
    refreshers = [subprocess.Popen(["sh", "-c", rounds], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                  for _ in range(REFRESHERS)]  # fmt: skip
    reader.start()
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=CONTAINERS) as pool:

            def run(ib):
                return containers.runc_run(ib[1], f"ocigpu-load-{os.getpid()}-{ib[0]}", timeout=240)

            results = list(pool.map(run, enumerate(bundles)))
        wall = time.monotonic() - started
        refresh_errors = [p.communicate(timeout=240)[1] for p in refreshers]
    finally:
        stop.set()
        reader.join()
        for p in refreshers:
            p.kill()
            p.wait()

    failed = [(i, r.returncode, r.stderr.strip()[-300:]) for i, r in enumerate(results) if r.returncode != 0]
    assert not failed, f"{len(failed)} of {CONTAINERS} containers did not start: {failed[:3]}"
    for i, (gpus, result) in enumerate(zip(sets, results)):
        listed = listed_uuids(result.stdout, ("GPU",))
        assert listed == [host["gpus"][g]["uuid"] for g in gpus], f"container {i} ({sets[i]}): {result.stdout}"
    assert all(p.returncode == 0 for p in refreshers), refresh_errors
    assert seen["torn"] == 0 and seen["missing"] == 0, seen
    assert seen["whole"] > 0
    report_measurement(
        f"load: {CONTAINERS} runc containers with the hook, started concurrently on a simulated 8-GPU host "
        f"({os.cpu_count()} CPUs), alongside {REFRESHERS * REFRESH_ROUNDS} `inventory refresh` runs: "
        f"all started in {wall:.1f} s wall; the cache was read whole {seen['whole']} times, torn 0 times"
    )
