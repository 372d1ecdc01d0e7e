"""The start server under load (issue 51, goal 2): 32 runc and 16 podman GPU containers released at
once by one barrier, one GPU each (the i-th of each runtime GPU i % 8 of a simulated 8-GPU host),
through the compiled pre-filter and a real server (tests/soakcheck.py load(): a private mount
namespace with its own /run, the server and the hook from a copy of the package, podman reading
install's hooks.d document from the directory its own containers.conf names, as bench/
concurrent_starts.py runs it for `make bench`).

Every container lists exactly its own GPU, every start's container record says the server's worker
ran it, and the server counts 48 served and nothing taken too late, left unread, without a worker,
over its bound or given up before it accepted it, and logs no "not taken". The times (the hook's,
from its records, and each container's wall time) are reported at the end of the run ('measurements'),
never judged here: bench/concurrent_starts.py judges them against a lone start.
"""

import os

import pytest
import soakcheck

from oci_gpu_hook.start import server

STARTS = soakcheck.LOAD_RUNC + soakcheck.LOAD_PODMAN


@pytest.fixture(scope="module")
def loaded(require, tmp_path_factory):
    require("root", "runc", "podman", "gcc", "busybox", "unshare", "tar")
    return soakcheck.load(str(tmp_path_factory.mktemp("load")), timeout=600)


def test_every_container_lists_exactly_its_own_gpu(loaded):
    assert soakcheck.load_errors(loaded) == []
    (starts,) = loaded["rounds"]
    planned = [(runtime, i % 8) for runtime, n in (("runc", soakcheck.LOAD_RUNC), ("podman", soakcheck.LOAD_PODMAN))
               for i in range(n)]  # fmt: skip
    assert sorted((s["runtime"], s["gpu"]) for s in starts) == sorted(planned)


def test_every_start_ran_in_the_servers_worker(loaded):
    told = [line for line in loaded["server_log"] if "not taken" in line or "taken too late" in line]
    python = [s["name"] for s in loaded["rounds"][0] if (s["record"] or {}).get("via") != server.VIA]
    assert python == [], (soakcheck.load_fallbacks(loaded), told[:5])
    counts = loaded["counts"]
    assert counts["served"] == STARTS == loaded["offers"], counts
    assert {name: counts[name] for name in soakcheck.FALLBACK_COUNTS} == dict.fromkeys(soakcheck.FALLBACK_COUNTS, 0)
    assert told == [], told


def test_times_are_reported(loaded, report_measurement):
    figures = soakcheck.load_figures(loaded)
    for runtime in ("runc", "podman"):
        hook, wall = figures[runtime]["hook"], figures[runtime]["wall"]
        report_measurement(
            f"start server load, {soakcheck.LOAD_RUNC} runc + {soakcheck.LOAD_PODMAN} podman at once, {runtime} "
            f"({hook['n']}): hook p50 {hook['p50_ms']:.0f} / p95 {hook['p95_ms']:.0f} / max {hook['max_ms']:.0f} "
            f"ms, wall p50 {wall['p50_ms']:.0f} / p95 {wall['p95_ms']:.0f} / max {wall['max_ms']:.0f} ms "
            f"(load average {loaded['loadavg'][0][0]:.2f} before, {os.cpu_count()} CPUs; "
            f"given to Python: {soakcheck.load_fallbacks(loaded)})"
        )
    assert figures["all"]["hook"]["n"] == STARTS
