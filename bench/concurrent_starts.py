"""Concurrent GPU container starts under runc, for `make bench`: one `runc run` of each bundle, all
started at once from a thread each; each start's wall time and the round's, over rounds after a
warm-up round. After each round every container is deleted (runc delete --force) and any cgroup
left with its name removed, however the round ended.

(Not bench/concurrent.py: bench/ comes first on the bench's sys.path, and that name would hide the
standard library's concurrent package.)
"""

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor, wait

from hookcheck import remove_cgroup, runc_delete

CONTAINERS = 50
CGROUP_ROOT = "/sys/fs/cgroup"


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
