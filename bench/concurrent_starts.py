"""Concurrent GPU container starts, for `make bench`.

On the Python path (issue 41, kept for history): one `runc run` of each bundle, all started at
once from a thread each; each start's wall time and the round's, over rounds after a warm-up
round. After each round every container is deleted (runc delete --force) and any cgroup left with
its name removed, however the round ended.

Through the start server (issue 51, goal 2; served_load): 32 runc and 16 podman GPU containers,
one GPU each, released at once by one barrier, through the pre-filter and a server of their own
in a private mount namespace (tests/soakcheck.py's load(), which CI's
tests/e2e/test_start_server_load.py runs too; podman reads install's hooks.d document from the
directory its containers.conf names). Every container must list exactly its own GPU before any
time counts. Per start: the hook's time (its container record's duration_seconds, from the
pre-filter's start) and the container's wall time (its runtime's command, to its exit); against a
lone served 1-GPU start of the same runtime measured in the same run. `python
bench/concurrent_starts.py` runs this case alone and writes its part of bench/results.json.

(Not bench/concurrent.py: bench/ comes first on the bench's sys.path, and that name would hide the
standard library's concurrent package.)
"""

import argparse
import datetime
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, wait

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(1, os.path.join(REPO, "tests"))  # hookcheck and soakcheck, shared with the tests

import results  # noqa: E402 - bench/results.py, beside this file
import soakcheck  # noqa: E402
from hookcheck import remove_cgroup, runc_delete  # noqa: E402

CONTAINERS = 50
CGROUP_ROOT = "/sys/fs/cgroup"
# Issue 51, goal 2: under load, the slowest start at most this many times a lone start's median,
# and none given to Python (soakcheck.load_fallbacks).
GOAL_LOAD_X_LONE = 3.0
LONE_STARTS = 10  # of each runtime, spread over the rounds
LOAD_ROUNDS = 3
LATE = re.compile(r"taken too late \((\d+) ms after the server accepted")
WORK_PARENT = "/var/tmp"


def _remove(ids) -> None:
    for container_id in ids:
        runc_delete(container_id)
    # runc puts a container's cgroups under its own, in every hierarchy: look for them by name.
    names = set(ids)
    left = [os.path.join(top, d) for top, dirs, _ in os.walk(CGROUP_ROOT) for d in dirs if d in names]
    for path in sorted(left, key=len, reverse=True):
        remove_cgroup(path)


def rounds(bundles, count: int, timed) -> tuple:
    """(the wall seconds of each round, timed's result of every start) over count rounds;
    timed: bench/run.py's."""
    runc = shutil.which("runc")
    walls, starts = [], []
    with ThreadPoolExecutor(max_workers=len(bundles)) as pool:
        for round_ in range(count + 1):  # round 0 warms up and is not kept
            ids = [f"ocigpu-bench-{os.getpid()}-load{round_}-{i}" for i in range(len(bundles))]
            try:
                started = time.perf_counter()
                futures = [pool.submit(timed, [runc, "run", "--bundle", b, i]) for i, b in zip(ids, bundles)]
                wait(futures)  # every start ends before any failure is raised, and before the cleanup
                wall = time.perf_counter() - started
                results = [f.result() for f in futures]
            finally:
                _remove(ids)
            if round_:
                walls.append(wall)
                starts += results
    return walls, starts


def served_load(work: str, rounds: int = LOAD_ROUNDS, lone: int = LONE_STARTS, trace: bool = False) -> dict:
    """The served load (the module's docstring) in work (an empty directory of root's), after a
    warm-up (a lone start of each runtime and a round); its figures and targets, for
    bench/results.json's "served_load". trace: with the server traced (soakcheck.LOAD_TRACE: where
    an offer's time goes), which adds a write per event to what is timed."""
    result = soakcheck.load(work, rounds=rounds, lone=lone, warmup=True, patch=soakcheck.LOAD_TRACE if trace else "")
    wrong = soakcheck.load_errors(result)
    if wrong:
        raise SystemExit(f"the served load: {len(wrong)} of {result['offers']} starts went wrong: {wrong[:5]}")
    figures = soakcheck.load_figures(result)
    fallbacks = soakcheck.load_fallbacks(result)
    late = [int(m.group(1)) for m in map(LATE.search, result["server_log"]) if m]
    said = [line for line in result["server_log"] if "trace: " not in line]
    containers = {"runc": soakcheck.LOAD_RUNC, "podman": soakcheck.LOAD_PODMAN}
    targets = {f"served load: no start given to Python (of {result['offers']}, warm-up included)":
               not any(fallbacks.values())}  # fmt: skip
    for runtime in containers:
        for part, what in (("hook", "the hook's time"), ("wall", "wall time")):
            x = figures[runtime]["max_x_lone"][part]
            targets[f"served load: slowest {runtime} start <= {GOAL_LOAD_X_LONE:g}x a lone one ({what})"] = (
                x <= GOAL_LOAD_X_LONE
            )
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "containers_at_once": containers,
        "rounds": rounds,
        "lone_starts_per_runtime": lone,
        "cpus": os.cpu_count(),
        "loadavg_before_after_warmup_end": result["loadavg"],
        "how": "runc and podman containers released at once by one barrier, one GPU each, through the pre-filter "
        "and a start server of their own, in a private mount namespace (tests/soakcheck.py load()); podman reads "
        "install's hooks.d document from the directory its containers.conf names; after a warm-up (a lone start "
        "of each runtime, and a round); before each round, its share of the lone starts of each runtime, one at a "
        "time. hook: the container record's duration_seconds (from the pre-filter's start); wall: the runtime's "
        "command to its exit. max_x_lone: the rounds' slowest start over the lone starts' median, same runtime",
        "figures": figures,
        "fallbacks": fallbacks,
        "offers": result["offers"],
        "server_counts": result["counts"],
        "taken_too_late_ms": late,
        "server_log": said[-20:],
        **({"trace": soakcheck.load_trace(result["server_log"])} if trace else {}),
        "targets": targets,
    }


def describe(load: dict) -> list:
    """The served load's lines for the bench's printout."""
    at_once = " + ".join(f"{n} {runtime}" for runtime, n in load["containers_at_once"].items())
    lines = [f"served load, {at_once} at once, {load['rounds']} rounds ({load['cpus']} CPUs, load average "
             f"{load['loadavg_before_after_warmup_end'][0][0]:.2f} before):"]  # fmt: skip
    for name, figures in load["figures"].items():
        for part, spread in figures.items():
            if part == "max_x_lone":
                continue
            lines.append(f"  {name:12} {part:4} p50 {spread['p50_ms']:7.1f} ms, p95 {spread['p95_ms']:7.1f} ms, "
                         f"max {spread['max_ms']:7.1f} ms ({spread['n']} starts)")  # fmt: skip
        if "max_x_lone" in figures:
            x = figures["max_x_lone"]
            lines.append(f"  {name:12} slowest x{x['hook']:.1f} a lone start (hook), x{x['wall']:.1f} (wall)")
    late = load["taken_too_late_ms"]
    told = f"; taken too late {min(late)}-{max(late)} ms after the server's accept" if late else ""
    lines.append(f"  given to Python: {load['fallbacks']} of {load['offers']} starts{told}")
    for name, spread in load.get("trace", {}).items():
        lines.append(f"  trace {name:7} p50 {spread['p50_ms']:7.1f} ms, p95 {spread['p95_ms']:7.1f} ms, "
                     f"max {spread['max_ms']:7.1f} ms ({spread['n']})")  # fmt: skip
    return lines


def main():
    parser = argparse.ArgumentParser(description="the served load alone (bench/run.py runs it too)")
    parser.add_argument("--rounds", type=int, default=LOAD_ROUNDS)
    parser.add_argument("--lone", type=int, default=LONE_STARTS, help="lone starts of each runtime")
    parser.add_argument("--trace", action="store_true", help="trace where an offer's time goes in the server")
    parser.add_argument("--output", default=os.path.join(HERE, "results.json"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the served load needs root (runc, podman, a mount namespace)")
    work = tempfile.mkdtemp(prefix="oci-gpu-hook-load-", dir=WORK_PARENT)
    try:
        load = served_load(work, args.rounds, args.lone, args.trace)
    finally:
        shutil.rmtree(work)
    results.save_part(args.output, "served_load", {"command": " ".join(["bench/concurrent_starts.py", *sys.argv[1:]]),
                                                   **load})  # fmt: skip
    print("\n".join(describe(load)))
    for target, met in load["targets"].items():
        print(f"{'met ' if met else 'MISSED'} {target}")
    print(f"wrote the served load to {args.output}")


if __name__ == "__main__":
    main()
