"""The start server held over time (issue 51): many runc containers started through the pre-filter
and the server, GPU and not, created, started, killed and deleted, and the server looked at while
nothing runs. Shared by bench/soak.py (`make bench`: 10,000 served starts) and
tests/reliability/test_start_server_soak.py (CI: 400, and a server with a leak put in, which the
probe must flag); bench/ imports it from tests/, as it imports hookcheck.

One soak runs in one private mount namespace (unshare, as tests/privatehost.py does): the server,
runc, the pre-filter and the workers, so that the server's mount table holds the soak's mounts
alone (the host's, copied at the start, and the soak's tmpfs), whatever other work mounts on the
host meanwhile. Its work lies on a tmpfs of its own there, and the hook's compiled settings on
another over settings.RUN_DIR: nothing of it outlives the namespace but the results file. runc
keeps its state there too (--root), and every container the soak made is deleted however it ends
(short of its being killed).

The server and the hook run from a copy of the package (their own "install"): the server stops
when the code it serves changes on disk (server.CodeWatch), and a checkout being edited while the
soak runs must not end it.

Starts, in a fixed cycle split between THREADS threads, each with bundles of its own: 1 GPU, 8
GPUs with every capability, a GPU the host does not have (the worker's plan refuses it, and runc
create fails), no GPU (the pre-filter decides alone: never offered), and 1-GPU containers killed
(`runc kill` SIGKILL, then delete) after create or while running. Every `every` served starts
(offered to the server: all but the no-GPU ones), both threads wait, and the server is probed:
its resident size, open descriptors, children and zombies among them, mounts, the hook's journals
left pending and the records of containers that are gone. `python soakcheck.py SPEC` is what runs
inside the namespace.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
THREADS = 2
# One turn of the churn; all but "nongpu" are offered to the server (served starts).
CYCLE = ("gpu1", "nongpu", "gpu8", "gpu1", "refused", "gpu1", "killed running", "nongpu", "gpu8", "gpu1",
         "killed created", "gpu1")  # fmt: skip
ENVS = {
    "gpu1": {"NVIDIA_VISIBLE_DEVICES": "0"},
    "gpu8": {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "all"},
    "refused": {"NVIDIA_VISIBLE_DEVICES": "8"},  # an 8-GPU host: indexes 0 to 7
    "nongpu": {},
    "sleeper": {"NVIDIA_VISIBLE_DEVICES": "0"},  # the killed ones: 1 GPU, a process that waits
}
ARGS = {"sleeper": ["/bin/busybox", "sleep", "600"]}  # the rootfs links no sleep applet
BUNDLE_OF = {"killed running": "sleeper", "killed created": "sleeper"}
GPUS = 8
SETTLE_SECONDS = 0.3  # a worker's exit after its verdict takes milliseconds, more on a loaded machine
# A leak put into a real server (tests: the probe must flag it): each offer taken keeps a
# descriptor and 64 KiB of touched memory.
LEAK = (
    "from oci_gpu_hook.start import server as _server\n"
    "_take, _kept = _server._take, []\n"
    "def _leaky_take(*args):\n"
    "    _kept.append((__import__('os').dup(2), b'x' * 65536))\n"
    "    return _take(*args)\n"
    "_server._take = _leaky_take\n"
)
# The server's garbage, counted without adding to it (bench/soak.py): every TRACE_EVERY offers
# taken, how many objects the collector tracks outside the generation serve() froze (what the
# server made since and still holds) and its generation-0 count (allocations less deallocations of
# tracked objects since the freeze: with the collector disabled, nothing resets it), kept in an
# array (whose numbers the collector does not track); at the server's exit, what a collection finds
# unreachable then (cycles the disabled collector never freed), by type. Standard library only.
TRACE_EVERY = 50
GC_TRACE = (
    "import array as _array, atexit as _atexit, collections as _collections, gc as _gc, json as _json\n"
    "from oci_gpu_hook.start import server as _server\n"
    "_take, _taken, _seen = _server._take, _array.array('q', [0]), _array.array('q')\n"
    "def _counted_take(*args):\n"
    "    done = _take(*args)\n"
    "    _taken[0] += 1\n"
    f"    if _taken[0] % {TRACE_EVERY} == 0:\n"
    "        _seen.extend((_taken[0], len(_gc.get_objects()), _gc.get_count()[0]))\n"
    "    return done\n"
    "_server._take = _counted_take\n"
    "def _garbage():\n"
    "    tracked = len(_gc.get_objects())\n"
    "    _gc.set_debug(_gc.DEBUG_SAVEALL)\n"
    "    found = _gc.collect()\n"
    "    kinds = _collections.Counter(type(o).__name__ for o in _gc.garbage).most_common(12)\n"
    "    with open(GC_TRACE_FILE, 'w') as f:\n"
    "        _json.dump({'offers': _taken[0], 'offers_tracked_gen0': [list(_seen[i : i + 3]) for i in\n"
    "                   range(0, len(_seen), 3)], 'tracked_at_exit': tracked, 'unreachable_at_exit': found,\n"
    "                   'unreachable_kinds': kinds}, f)\n"
    "_atexit.register(_garbage)\n"
)


# --- the probe ------------------------------------------------------------------------------------


def children(pid: int) -> dict:
    """{child pid: its state letter} of the processes whose parent is pid (procfs)."""
    from oci_gpu_hook.start.digits import decimal

    found = {}
    for entry in os.listdir("/proc"):
        if decimal(entry) is None:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if decimal(fields[1]) == pid:
            found[decimal(entry)] = fields[0]
    return found


def probe(pid: int, records_directory: str, pending_directory: str) -> dict:
    """What the server holds now: its resident KiB, open descriptors, children and the zombies
    among them, the lines of its mountinfo; and the hook's journals left pending and the records
    of containers that are gone (container_record's own readers)."""
    from oci_gpu_hook.start import container_record

    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/mountinfo") as f:
        mounts = len(f.read().splitlines())
    kids = children(pid)
    records = container_record.read_all(records_directory)
    pending = os.listdir(pending_directory) if os.path.isdir(pending_directory) else []
    return {
        "rss_kib": rss,
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "children": len(kids),
        "zombies": sum(1 for state in kids.values() if state == "Z"),
        "mounts": mounts,
        "journals": len(pending),
        "gone_records": len(records) - len(container_record.live(records)),
    }


def settled_probe(pid: int, records_directory: str, pending_directory: str, timeout: float = 10) -> dict:
    """probe() once its readings agree in everything but the resident size over SETTLE_SECONDS: a
    worker that has just replied may still be exiting, and the next spare being forked. What
    stays (a zombie, a descriptor, a worker that never exits) is read as it stays."""
    last = probe(pid, records_directory, pending_directory)
    steady = time.monotonic()
    deadline = steady + timeout
    while True:
        time.sleep(0.1)
        now = probe(pid, records_directory, pending_directory)
        if _but_rss(now) != _but_rss(last):
            steady = time.monotonic()
        last = now
        if time.monotonic() - steady >= SETTLE_SECONDS or time.monotonic() > deadline:
            return now


def _but_rss(sample: dict) -> dict:
    return {key: value for key, value in sample.items() if key != "rss_kib"}


def verdicts(samples: list, warmup: int, rss_up: float = 0.05, rss_down: float | None = 0.05,
             records_bound: int | None = None) -> dict:  # fmt: skip
    """{check: {"ok": bool, "why": ...}} over the samples (probe()'s, each with "served"): from the
    first taken at or after warmup served starts (the baseline) on, descriptors, children and
    mounts exactly the baseline's, the resident size within +rss_up and -rss_down of it (None: no
    lower bound); no zombie and no journal in any sample; records of gone containers at most
    records_bound (None: not judged)."""
    base_at = next((i for i, s in enumerate(samples) if s["served"] >= warmup), None)
    if base_at is None or base_at == len(samples) - 1:
        raise ValueError(f"no sample after the warm-up of {warmup} served starts to judge by")
    base, after = samples[base_at], samples[base_at + 1 :]
    checks = {}
    for key in ("fds", "children", "mounts"):
        values = sorted({s[key] for s in after})
        checks[f"{key} flat"] = {"ok": values == [base[key]], "why": f"{base[key]} after warm-up, then {values}"}
    low, high = min(s["rss_kib"] for s in after), max(s["rss_kib"] for s in after)
    growth, shrink = high / base["rss_kib"] - 1, 1 - low / base["rss_kib"]
    within = growth <= rss_up and (rss_down is None or shrink <= rss_down)
    limits = f"+{rss_up:.0%}" + ("" if rss_down is None else f"/-{rss_down:.0%}")
    checks[f"rss within {limits}"] = {"ok": within, "why": f"{base['rss_kib']} KiB after warm-up, then {low} to "
                                      f"{high} KiB ({growth:+.1%} at most)"}  # fmt: skip
    for key in ("zombies", "journals"):
        worst = max(s[key] for s in samples)
        checks[f"no {key}"] = {"ok": worst == 0, "why": f"at most {worst}"}
    if records_bound is not None:
        worst = max(s["gone_records"] for s in samples)
        checks[f"gone records <= {records_bound}"] = {"ok": worst <= records_bound, "why": f"at most {worst}"}
    return checks


def failed(checks: dict) -> list:
    return [f"{name}: {check['why']}" for name, check in checks.items() if not check["ok"]]


def records_bound() -> int:
    """The records of gone containers the hook lets stand: it collects once the directory holds
    more than COLLECT_ABOVE, looked at by one GPU start in CHECK_ONE_IN at random; 12 times
    CHECK_ONE_IN starts in a row without a look happens with a chance of e**-12 (6e-6)."""
    from oci_gpu_hook.start import container_record

    return container_record.COLLECT_ABOVE + 12 * container_record.CHECK_ONE_IN


# --- the soak, from outside -----------------------------------------------------------------------


def soak(work: str, starts: int, every: int, patch: str = "", timeout: float = 3600, progress=None) -> dict:
    """Run a soak of `starts` served starts, probed every `every`, in a private mount namespace;
    work: an empty directory of root's (its results there). patch: Python run in the server's
    process before it starts (LEAK, GC_TRACE). progress(line): told of each probe as it comes.
    Returns {"samples": [...], "errors": [...], "served": n, "starts_run_by_workers": n, ...}."""
    spec = os.path.join(work, "soak-spec.json")
    with open(spec, "w") as f:
        json.dump({"work": work, "starts": starts, "every": every, "patch": patch}, f)
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", sys.executable, "-I",
                             os.path.abspath(__file__), spec], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        for line in proc.stdout:
            if progress:
                progress(line.rstrip("\n"))
        _, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise AssertionError(f"the soak failed ({proc.returncode}): {err.strip()[-3000:]}")
    with open(spec + ".results") as f:
        return json.load(f)


def _delete_containers(runc_root: str) -> None:
    if os.path.isdir(runc_root):
        for cid in os.listdir(runc_root):
            subprocess.run(["runc", "--root", runc_root, "delete", "--force", cid], capture_output=True, timeout=60)


# --- inside the namespace -----------------------------------------------------------------------


class _Starts:
    """One thread's containers: its bundles, and the life cycle each kind of start goes through."""

    def __init__(self, runc: list, ram: str, prefilter: str, config: str, index: int):
        from oci_gpu_hook.toolkit import containers

        self.runc, self.index, self.scratch = runc, index, os.path.join(ram, f"thread{index}")
        os.mkdir(self.scratch)
        self.bundles = {}
        for name, env in ENVS.items():
            bundle = containers.make_bundle(os.path.join(self.scratch, name), args=ARGS.get(name, ["true"]), env=env,
                                            config_file=config)  # fmt: skip
            path = os.path.join(bundle, "config.json")
            with open(path) as f:
                doc = json.load(f)
            doc["hooks"]["prestart"][0].update(path=prefilter, args=[prefilter, "--config", config, "prestart"])
            with open(path, "w") as f:
                json.dump(doc, f)
            self.bundles[name] = bundle

    def run(self, kind: str, cid: str) -> str | None:
        """One container's life cycle; None when it went as its kind should, else what went wrong."""
        from oci_gpu_hook.start.digits import decimal

        bundle = self.bundles[BUNDLE_OF.get(kind, kind)]
        pid_file, errors = os.path.join(self.scratch, "pid"), os.path.join(self.scratch, "errors")
        deleted = False
        try:
            # Not a pipe: the container keeps runc create's descriptors open as long as it runs.
            with open(errors, "w+") as err:
                created = self._runc(["create", "--bundle", bundle, "--pid-file", pid_file, cid], err)
                if kind == "refused":
                    return "runc create of a GPU the host does not have succeeded" if created else None
                if not created:
                    err.seek(0)
                    return f"runc create: {err.read().strip()[-500:]}"
            with open(pid_file) as f:
                pid = decimal(f.read().strip())
            if pid is None:
                return "runc create wrote no pid"
            exited = os.pidfd_open(pid)
            try:
                if kind != "killed created" and not self._runc(["start", cid]):
                    return "runc start failed"
                if kind.startswith("killed") and not self._runc(["kill", cid, "KILL"]):
                    return "runc kill failed"
                if not select.select([exited], [], [], 60)[0]:
                    return "the container did not exit within 60 s"
            finally:
                os.close(exited)
            deleted = self._runc(["delete", cid])
            return None if deleted else "runc delete failed"
        finally:
            if not deleted:  # whatever happened: nothing stays
                self._runc(["delete", "--force", cid])

    def _runc(self, argv: list, stderr=None) -> bool:
        out = subprocess.run([*self.runc, *argv], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=stderr or subprocess.DEVNULL, timeout=120)  # fmt: skip
        return out.returncode == 0


def _install(ram: str, package: str, socket_path: str) -> tuple:
    """(the copy's parent directory, the pre-filter): a copy of package, a launcher of it, and the
    pre-filter built by the copy's own code in front of that launcher, offering to socket_path as
    that code (its version line names it)."""
    from oci_gpu_hook.toolkit import launcher

    site = os.path.join(ram, "site")
    shutil.copytree(package, os.path.join(site, "oci_gpu_hook"), ignore=shutil.ignore_patterns("__pycache__"))
    python_hook = os.path.join(ram, "oci-gpu-hook-python")
    with open(python_hook, "w") as f:
        f.write(launcher.text(sys.executable, site))
    os.chmod(python_hook, 0o755)
    front = os.path.join(ram, "oci-gpu-hook")
    build = (f"import sys\nsys.path.insert(0, {site!r})\nfrom oci_gpu_hook.toolkit import prefilter\n"
             f"prefilter.build({front!r}, {python_hook!r}, start_server={socket_path!r})\n")  # fmt: skip
    subprocess.run([sys.executable, "-I", "-c", build], check=True, stdin=subprocess.DEVNULL)
    return site, front


def _run_batch(threads: list, batch: list) -> list:
    """Run the batch's starts (kind, container id), dealt in turn to the threads; once all are
    done (nothing runs then), what went wrong in any."""
    errors = [[] for _ in threads]

    def share(starts: _Starts, out: list) -> None:
        for kind, cid in batch[starts.index :: len(threads)]:
            try:
                wrong = starts.run(kind, cid)
            except Exception as e:  # told, not lost in the thread
                wrong = f"{type(e).__name__}: {e}"
            if wrong:
                out.append(f"{cid} ({kind}): {wrong}")

    running = [threading.Thread(target=share, args=(t, out)) for t, out in zip(threads, errors)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    return [e for out in errors for e in out]


def _main(spec_path: str) -> None:
    import startservercheck
    import yaml

    from oci_gpu_hook.start import server, settings
    from oci_gpu_hook.start.linux.journal import journal_directory
    from oci_gpu_hook.toolkit.simulate import simulate

    with open(spec_path) as f:
        spec = json.load(f)
    ram = os.path.join(spec["work"], "ram")
    os.mkdir(ram, 0o700)
    os.makedirs(settings.RUN_DIR, mode=0o755, exist_ok=True)  # where the hook makes it at its first start
    for directory, mode in ((ram, "0700"), (settings.RUN_DIR, "0755")):
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"mode={mode}", "ocigpu-soak", directory], check=True)
    host = simulate(os.path.join(ram, "host"), gpus=GPUS)
    config = startservercheck.config(host, ram)
    socket_path = os.path.join(ram, "start.sock")
    site, front = _install(ram, server.PACKAGE, socket_path)
    runc = ["runc", "--root", os.path.join(ram, "runc")]
    threads = [_Starts(runc, ram, front, config, i) for i in range(THREADS)]
    trace = os.path.join(spec["work"], "gc-trace.json")
    code = (f"import sys\nsys.path.insert(0, {site!r})\nGC_TRACE_FILE = {trace!r}\n{spec['patch']}\n"
            "from oci_gpu_hook.hook import main\nsys.exit(main())\n")  # fmt: skip
    command = [sys.executable, "-I", "-c", code, "start-server", "--socket", socket_path]
    records = os.path.join(ram, "records")
    with open(config) as f:
        pending = journal_directory(yaml.safe_load(f)["inventory_cache"])
    results = {"samples": [], "errors": [], "threads": THREADS, "cycle": list(CYCLE), "gpus": GPUS}
    started = time.monotonic()
    served = made = 0
    try:
        with startservercheck.Server(os.path.join(ram, "server.log"), command=command) as running:
            running.wait_listening()
            while True:
                sample = {"served": served, "seconds": round(time.monotonic() - started, 1),
                          **settled_probe(running.pid, records, pending)}  # fmt: skip
                results["samples"].append(sample)
                print(json.dumps(sample), flush=True)  # progress, for whoever waits
                if served >= spec["starts"]:
                    break
                batch = []
                while served < min(spec["starts"], sample["served"] + spec["every"]):
                    kind = CYCLE[made % len(CYCLE)]
                    batch.append((kind, f"ogh-soak-{os.getpid()}-{made}"))
                    made += 1
                    served += kind != "nongpu"
                results["errors"] += _run_batch(threads, batch)
                if running.proc.poll() is not None:
                    results["errors"].append(f"the server exited ({running.proc.returncode})")
                    break
            # Once the server has been idle a while, its spare collects the records of the
            # containers that are gone (server.COLLECT_IDLE_SECONDS): none is left.
            idle = time.monotonic()
            while True:
                left = probe(running.pid, records, pending)["gone_records"]
                if left == 0 or time.monotonic() - idle > server.COLLECT_IDLE_SECONDS + 10:
                    break
                time.sleep(0.1)
            results["gone_records_after_idle"] = left
            results["idle_seconds_to_collect"] = round(time.monotonic() - idle, 2)
            log = running.log()
    finally:
        _delete_containers(runc[-1])
    results["containers"] = made
    results["server_log"] = [line for line in log if not line.startswith(startservercheck.LISTENING)][-20:]
    results["starts_run_by_workers"] = len({r["container"] for r in startservercheck.log_records(config)
                                            if r.get("via") == server.VIA})  # fmt: skip
    results["served"] = served
    results["code"] = server.code_identity(os.path.join(site, "oci_gpu_hook"))  # what was served
    if os.path.exists(trace):  # GC_TRACE's, written as the server exited
        with open(trace) as f:
            results["gc"] = json.load(f)
    with open(spec_path + ".results", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    sys.path.insert(0, HERE)  # startservercheck and hookcheck, beside this file
    _main(sys.argv[1])
