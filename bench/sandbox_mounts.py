"""ldconfig's sandbox by fork, against the count of mounts in the namespace it is forked from, for
`make bench` (issue 51): copying that namespace (the hook's own process, as before) against
copying the empty mount namespace a start server holds (`ldconfig.hold_empty_namespace`).

Runs in a child with a private mount namespace of its own, which adds N small tmpfs mounts in
steps (the host's table is not touched). Each figure is the median of --runs sandboxes on a
one-library image (`ldconfig.Sandbox(...).result()`), the better of two rounds, the two ways
taking turns. Root is needed. Writes the "sandbox_mounts" part of bench/results.json (the rest
kept) and prints the figures.
"""

import argparse
import ast
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

import results  # noqa: E402 - bench/results.py

from oci_gpu_hook.start.linux import _linux, ldconfig  # noqa: E402
from oci_gpu_hook.start.linux.rootfs import Rootfs  # noqa: E402
from oci_gpu_hook.toolkit import containers  # noqa: E402

STEPS = (0, 500, 2000)  # mounts added


def _sandbox_ms(rootfs: Rootfs, runs: int) -> float:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        ldconfig.Sandbox(rootfs.fd, "/opt/lib\n", [], timeout=20).result()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def _mount_count() -> int:
    with open("/proc/self/mountinfo") as f:
        return len(f.read().splitlines())


def measure(runs: int, workdir: str) -> list:
    """In the calling process, which must have a private mount namespace of its own."""
    root = os.path.join(workdir, "rootfs")
    os.makedirs(os.path.join(root, "etc"))
    os.makedirs(os.path.join(root, "opt", "lib"))
    shutil.copy(os.path.realpath(containers._host_libc()), os.path.join(root, "opt", "lib", "libc.so.6"))
    rootfs = Rootfs(root)
    many = os.path.join(workdir, "many")
    os.mkdir(many)
    _linux.mount("tmpfs", many, "tmpfs", 0, "size=1m")
    ldconfig.hold_empty_namespace()
    empty = ldconfig._empty
    if empty is None:
        raise SystemExit("sandbox_mounts: no empty mount namespace could be made here")
    rows, added = [], 0
    for target in STEPS:
        while added < target:
            where = os.path.join(many, str(added))
            os.mkdir(where)
            _linux.mount("tmpfs", where, "tmpfs", 0, "size=4k")
            added += 1
        best = {}
        for _ in range(2):
            for way, held in (("copying_ms", None), ("empty_namespace_ms", empty)):
                ldconfig._empty = held
                figure = _sandbox_ms(rootfs, runs)
                best[way] = min(best.get(way, figure), figure)
        ldconfig._empty = empty
        rows.append({"mounts": _mount_count(), **{k: round(v, 2) for k, v in best.items()}})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="sandboxes per figure (default 30)")
    parser.add_argument("--output", default=os.path.join(HERE, "results.json"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("sandbox_mounts: needs root (mounts and ldconfig's sandbox)", file=sys.stderr)
        return 2
    # Removed here, once the child is gone: its mounts went with its namespace.
    with tempfile.TemporaryDirectory(prefix="oci-gpu-hook-bench-") as workdir:
        reader, writer = os.pipe()
        child = os.fork()
        if child == 0:  # the mounts live and die with this child's namespace
            code = 1
            try:
                os.close(reader)
                _linux.unshare(_linux.CLONE_NEWNS)
                _linux.mount(None, "/", None, _linux.MS_REC | _linux.MS_PRIVATE)
                os.write(writer, repr(measure(args.runs, workdir)).encode())
                code = 0
            except BaseException as e:
                os.write(2, f"sandbox_mounts: {e}\n".encode())
            finally:
                os._exit(code)
        os.close(writer)
        with os.fdopen(reader) as f:
            said = f.read()
        _, status = os.waitpid(child, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return 1
    rows = ast.literal_eval(said)
    for row in rows:
        print(f"{row['mounts']:>5} mounts: copying {row['copying_ms']:.2f} ms, "
              f"the held empty namespace {row['empty_namespace_ms']:.2f} ms")  # fmt: skip
    part = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "runs": args.runs, "rows": rows}  # fmt: skip
    results.save_part(args.output, "sandbox_mounts", part)
    return 0


if __name__ == "__main__":
    sys.exit(main())
