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

The load (issue 51, goal 2; load()): 32 runc and 16 podman GPU containers released at once by one
barrier, each with one GPU, through the same pre-filter and a server of the same install, in a
namespace of its own likewise (a tmpfs over /run and /dev/shm besides: runc's and podman's state,
podman's locks). podman reads install's hooks.d document from the directory a containers.conf of
the load's own names (CONTAINERS_CONF), and keeps its storage in the load's tmpfs
(CONTAINERS_STORAGE_CONF). Shared by bench/concurrent_starts.py (`make bench`) and
tests/e2e/test_start_server_load.py; `python soakcheck.py --load SPEC` runs inside the namespace.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import statistics
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
    return _in_namespace("the soak", [spec], timeout, progress)


def _in_namespace(what: str, args: list, timeout: float, progress=None) -> dict:
    """Run this file with args (a spec's path last) in a private mount namespace; what it wrote
    beside the spec (SPEC.results). progress(line): told of each line it prints."""
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", sys.executable, "-I",
                             os.path.abspath(__file__), *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
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
        raise AssertionError(f"{what} failed ({proc.returncode}): {err.strip()[-3000:]}")
    with open(args[-1] + ".results") as f:
        return json.load(f)


def _delete_containers(runc_root: str) -> None:
    if os.path.isdir(runc_root):
        for cid in os.listdir(runc_root):
            subprocess.run(["runc", "--root", runc_root, "delete", "--force", cid], capture_output=True, timeout=60)


# --- inside the namespace -----------------------------------------------------------------------


class _Starts:
    """One thread's containers: its bundles, and the life cycle each kind of start goes through."""

    def __init__(self, runc: list, ram: str, prefilter: str, config: str, index: int):
        self.runc, self.index, self.scratch = runc, index, os.path.join(ram, f"thread{index}")
        os.mkdir(self.scratch)
        self.bundles = {name: hooked_bundle(os.path.join(self.scratch, name), env, ARGS.get(name, ["true"]),
                                            prefilter, config) for name, env in ENVS.items()}  # fmt: skip

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


def hooked_bundle(path: str, env: dict, args: list, prefilter: str, config: str) -> str:
    """A bundle at path running args, whose prestart hook is prefilter (as install wires it)."""
    from oci_gpu_hook.toolkit import containers

    bundle = containers.make_bundle(path, args=args, env=env, config_file=config)
    with open(os.path.join(bundle, "config.json")) as f:
        doc = json.load(f)
    doc["hooks"]["prestart"][0].update(path=prefilter, args=[prefilter, "--config", config, "prestart"])
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(doc, f)
    return bundle


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


def _server_command(site: str, socket_path: str, preamble: str = "") -> list:
    """The server of the copy in site, on socket_path, preamble (Python) run in its process first."""
    code = f"import sys\nsys.path.insert(0, {site!r})\n{preamble}from oci_gpu_hook.hook import main\nsys.exit(main())\n"
    import startservercheck

    command = [sys.executable, "-I", "-c", code, "start-server", "--socket", socket_path]
    return startservercheck.as_its_unit_runs(command)


def _stale_records(directory: str) -> int:
    """Records of gone containers written over KEEP_FOR_READERS_SECONDS ago."""
    from oci_gpu_hook.start import container_record

    records = container_record.read_all(directory)
    running = container_record.live(records)
    since = time.time() - container_record.KEEP_FOR_READERS_SECONDS
    old = 0
    for name in records:
        try:
            old += name not in running and os.lstat(os.path.join(directory, name)).st_mtime < since
        except FileNotFoundError:
            pass
    return old


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
    command = _server_command(site, socket_path, f"GC_TRACE_FILE = {trace!r}\n{spec['patch']}\n")
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
            # Once the server has been idle a while (server.COLLECT_IDLE_SECONDS), its spare
            # collects the records of the containers that are gone, those written long enough ago
            # for the exporter to have counted them: none of those is left (a soak shorter than
            # container_record.KEEP_FOR_READERS_SECONDS has none to collect).
            idle = time.monotonic()
            while True:
                stale = _stale_records(records)
                if stale == 0 or time.monotonic() - idle > server.COLLECT_IDLE_SECONDS + 10:
                    break
                time.sleep(0.1)
            results["stale_records_after_idle"] = stale
            results["gone_records_after_idle"] = probe(running.pid, records, pending)["gone_records"]
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


# --- the load: many served starts at once (issue 51, goal 2) --------------------------------------

LOAD_RUNC = 32
LOAD_PODMAN = 16
LOAD_ARGS = ["nvidia-smi", "-L"]  # each container lists the GPUs it sees
LOAD_IMAGE = "localhost/ocigpu-load:latest"
# The hook's own time: its container record's duration_seconds (from the pre-filter's start). A
# server's idle spare removes the records of containers that are gone (prestart.collect_records),
# which a round's are well before it ends: they are read as they come, this often.
RECORD_POLL_SECONDS = 0.05
START_TIMEOUT_SECONDS = 300  # a hang guard
RUNC_ROOT = "/run/runc"  # runc's default, podman's too: a tmpfs of the load's own (/run)
PODMAN_STORAGE = "/run/ocigpu-load"
# Where an offer's time goes in the server under load (bench/concurrent_starts.py --trace): a line
# in its log for each accept() round (connections taken, ms), each offer given to a worker (ms from
# its accept until then, and how long the giving took), each fork of a worker (ms, in the server),
# each worker's first moment (ms from its offer's accept), each spare's warming (ms). Standard
# library only; a write per event.
LOAD_TRACE = (
    "import os as _os, time as _time\n"
    "from oci_gpu_hook.start import prestart as _prestart, server as _server\n"
    "def _say(*words):\n"
    "    _os.write(2, ('trace: ' + ' '.join(map(str, words)) + '\\n').encode())\n"
    "def _ms(since):\n"
    "    return round((_time.monotonic() - since) * 1e3, 1)\n"
    "_accept, _take, _fork, _work, _warm = (_server._accept, _server._take, _server._fork_worker, _server.work,\n"
    "                                      _prestart.warm)\n"
    "def _traced_accept(listener, pending, *rest):\n"
    "    began, before = _time.monotonic(), len(pending)\n"
    "    done = _accept(listener, pending, *rest)\n"
    "    _say('accept', len(pending) - before, _ms(began))\n"
    "    return done\n"
    "def _traced_take(listener, conn, accepted, *rest):\n"
    "    began = _time.monotonic()\n"
    "    done = _take(listener, conn, accepted, *rest)\n"
    "    _say('take', round((began - accepted) * 1e3, 1), _ms(began))\n"
    "    return done\n"
    "def _traced_fork(*args):\n"
    "    began = _time.monotonic()\n"
    "    done = _fork(*args)\n"
    "    _say('fork', _ms(began))\n"
    "    return done\n"
    "def _traced_work(conn, offer):\n"
    "    _say('worker', _ms(offer.accepted))\n"
    "    return _work(conn, offer)\n"
    "def _traced_warm(*args):\n"
    "    began = _time.monotonic()\n"
    "    try:\n"
    "        return _warm(*args)\n"
    "    finally:\n"
    "        _say('warm', _ms(began))\n"
    "_server._accept, _server._take, _server._fork_worker, _server.work, _prestart.warm = (\n"
    "    _traced_accept, _traced_take, _traced_fork, _traced_work, _traced_warm)\n"
)
# The server's counts of offers it did not serve (server.Counts); in a load, whose every offer is
# root's, a "stranger" is a pre-filter that had given up before the server accepted its connection.
FALLBACK_COUNTS = ("late", "no_offer", "no_worker", "too_many", "stranger")


def load(work: str, runc: int = LOAD_RUNC, podman: int = LOAD_PODMAN, rounds: int = 1, lone: int = 0,
         warmup: bool = False, patch: str = "", timeout: float = 1800) -> dict:  # fmt: skip
    """`runc` runc and `podman` podman GPU containers (the i-th of each runtime with GPU i % GPUS),
    all released by one barrier, `rounds` times, through the pre-filter and a start server, in a
    private mount namespace; before each round its share of `lone` served 1-GPU starts of each
    runtime, one at a time; warmup: one lone start of each and a round first. patch: Python run in
    the server's process before it starts (LOAD_TRACE). work: an empty directory of root's.
    Returns {"rounds": [[start, ...], ...], "lone": {runtime: [start, ...]}, "warmup": [start,
    ...], "counts": the server's answer to QUERY at the end (server.ask_status), "offers": every
    GPU start made, "server_log": its lines, "loadavg": /proc/loadavg's three figures before
    anything, after the warm-up and at the end}; a start: {"runtime", "name", "gpu", "uuid": its GPU's, "listed":
    the GPU UUIDs nvidia-smi listed in it, "rc", "error", "wall_s": from its runtime's command to
    that command's exit, "record": its container record's via, outcome and duration_seconds, or
    None}."""
    spec = os.path.join(work, "load-spec.json")
    with open(spec, "w") as f:
        json.dump({"work": work, "runc": runc, "podman": podman, "rounds": rounds, "lone": lone, "warmup": warmup,
                   "patch": patch}, f)  # fmt: skip
    before = _loadavg()
    result = _in_namespace("the load", ["--load", spec], timeout)
    result["loadavg"].insert(0, before)
    return result


def load_starts(result: dict) -> list:
    """Every start of a load's result, the warm-up's included."""
    return [*result["warmup"], *(s for starts in result["lone"].values() for s in starts),
            *(s for starts in result["rounds"] for s in starts)]  # fmt: skip


def load_errors(result: dict) -> list:
    """What went wrong in a load, whatever the times: a container that failed, that did not list
    exactly its own GPU, or whose start left no record of a start."""
    wrong = []
    for start in load_starts(result):
        what = f"{start['name']} ({start['runtime']}, GPU {start['gpu']})"
        if start["rc"] != 0:
            wrong.append(f"{what}: exit {start['rc']}: {start['error']}")
        elif start["listed"] != [start["uuid"]]:
            wrong.append(f"{what}: nvidia-smi listed {start['listed']}, not its GPU {start['uuid']}")
        elif (start["record"] or {}).get("outcome") != "started":
            wrong.append(f"{what}: no container record of a start ({start['record']})")
    return wrong


def load_fallbacks(result: dict) -> dict:
    """Starts the server did not run: those whose record does not say so (Python's, after the
    pre-filter's wait for "taken"), and the server's own counts (FALLBACK_COUNTS) of offers taken
    too late, left unread past that wait, without a worker, over its pending bound, or given up
    before they were accepted."""
    from oci_gpu_hook.start import server

    counts = result["counts"]
    return {"not_via_server": sum(1 for s in load_starts(result) if (s["record"] or {}).get("via") != server.VIA),
            **{name: counts.get(name) for name in FALLBACK_COUNTS}}  # fmt: skip


def spread(seconds: list) -> dict:
    """p50, p95 (nearest rank, as bench/run.py's summary) and max, in ms, and how many."""
    ordered = sorted(seconds)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    return {"p50_ms": statistics.median(ordered) * 1e3, "p95_ms": p95 * 1e3, "max_ms": ordered[-1] * 1e3,
            "n": len(ordered)}  # fmt: skip


def load_figures(result: dict) -> dict:
    """By runtime: the spread of the hook's time (its record's duration_seconds) and of the
    container's wall time over the rounds' starts; with lone starts, theirs, and the slowest of
    the rounds against the median of a lone start ("max_x_lone"). Only for a load without
    load_errors (every start has its record)."""
    figures = {}
    for runtime in ("runc", "podman"):
        starts = [s for starts in result["rounds"] for s in starts if s["runtime"] == runtime]
        if not starts:
            continue
        figures[runtime] = under = {"hook": spread([s["record"]["duration_seconds"] for s in starts]),
                                    "wall": spread([s["wall_s"] for s in starts])}  # fmt: skip
        lone = result["lone"].get(runtime)
        if lone:
            alone = {"hook": spread([s["record"]["duration_seconds"] for s in lone]),
                     "wall": spread([s["wall_s"] for s in lone])}  # fmt: skip
            figures[f"lone {runtime}"] = alone
            under["max_x_lone"] = {part: under[part]["max_ms"] / alone[part]["p50_ms"] for part in ("hook", "wall")}
    starts = [s for starts in result["rounds"] for s in starts]
    figures["all"] = {"hook": spread([s["record"]["duration_seconds"] for s in starts])}
    return figures


def load_trace(server_log: list) -> dict:
    """LOAD_TRACE's lines in a load's server log, as spreads (spread()) of ms: "accept" (an accept()
    round), "queued" (from an offer's accept until the server gave it to a worker), "give" (the
    giving: a spare's hand or a fork), "fork" (a fork alone), "worker" (from the accept until the
    worker ran: it says "taken" next), "warm" (a spare's warming, which an offer handed to it waits
    for)."""
    found = {}
    for line in server_log:
        words = line.split("trace: ", 1)[-1].split() if "trace: " in line else []
        if words and words[0] in ("accept", "fork", "worker", "warm"):
            found.setdefault(words[0], []).append(float(words[-1]) / 1e3)
        elif words and words[0] == "take":
            found.setdefault("queued", []).append(float(words[1]) / 1e3)
            found.setdefault("give", []).append(float(words[2]) / 1e3)
    return {name: spread(seconds) for name, seconds in found.items()}


class _RecordWatch:
    """The container records, kept as they are written (RECORD_POLL_SECONDS), by id."""

    def __init__(self, directory: str):
        self.directory, self.seen, self.stopped = directory, {}, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while True:
            self.read()
            if self.stopped.wait(RECORD_POLL_SECONDS):
                return

    def read(self) -> None:
        from oci_gpu_hook.start import container_record

        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return  # before the first start
        for name in names:
            if name in self.seen:
                continue
            try:
                with open(os.path.join(self.directory, name), "rb") as f:
                    record = container_record.parse(f.read())
            except OSError:
                continue  # collected meanwhile
            if record is not None:
                self.seen[name] = record

    def record(self, container_id: str) -> dict | None:
        """What a start's record says of how it went."""
        from oci_gpu_hook.start import container_record

        record = self.seen.get(container_record.file_name(container_id))
        return None if record is None else {k: record.get(k) for k in ("via", "outcome", "duration_seconds")}

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.read()


class _Load:
    """Inside the namespace: the bundles, the image and podman's private configuration, and how a
    start is made, at once with others or alone."""

    def __init__(self, ram: str, prefilter: str, config: str, host: dict, runc: int):
        from oci_gpu_hook.toolkit import containers, install

        self.ram, self.uuids, self.made = ram, [g["uuid"] for g in host["gpus"]], 0
        self.bundles = [hooked_bundle(os.path.join(ram, f"runc{i}"), {"NVIDIA_VISIBLE_DEVICES": str(i % GPUS)},
                                      LOAD_ARGS, prefilter, config) for i in range(max(runc, 1))]  # fmt: skip
        # podman reads the hooks.d directory its containers.conf names (CONTAINERS_CONF: that file
        # alone), holding the document install writes for the pre-filter; its storage is the
        # load's own (CONTAINERS_STORAGE_CONF), in the load's /run: under a longer directory (a
        # test's tmp_path) each podman run waited 20 s for its container's exit (conmon's paths).
        hooks = install.write_hooks_dir(os.path.join(ram, "hooks.d"), [prefilter, "--config", config])
        conf, storage = os.path.join(ram, "containers.conf"), os.path.join(ram, "storage.conf")
        with open(conf, "w") as f:
            f.write(f'[engine]\nhooks_dir = ["{hooks}"]\n')
        with open(storage, "w") as f:
            f.write(f'[storage]\ndriver = "vfs"\ngraphroot = "{PODMAN_STORAGE}"\nrunroot = "{PODMAN_STORAGE}-run"\n')
        self.env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
        self.podman_env = {**self.env, "HOME": "/root", "CONTAINERS_CONF": conf, "CONTAINERS_STORAGE_CONF": storage}
        self.podman = ["podman", "--runtime", "runc"]
        rootfs = containers.make_rootfs(os.path.join(ram, "rootfs"))
        tar = subprocess.Popen(["tar", "-C", rootfs, "-cf", "-", "."], stdout=subprocess.PIPE)
        subprocess.run([*self.podman, "import", "-", LOAD_IMAGE], stdin=tar.stdout, env=self.podman_env, check=True,
                       capture_output=True)  # fmt: skip
        tar.stdout.close()
        if tar.wait():
            raise RuntimeError(f"tar of {rootfs} failed")

    def plan(self, tag: str, runtime: str, index: int) -> tuple:
        """(runtime, name, GPU, argv, env) of a start: runc's bundle index or podman's index-th."""
        self.made += 1
        name, gpu = f"ogh-load-{os.getpid()}-{self.made}-{tag}", index % GPUS
        if runtime == "runc":
            return runtime, name, gpu, ["runc", "run", "--bundle", self.bundles[index], name], self.env
        from oci_gpu_hook.toolkit import containers

        argv = [*self.podman, "run", *containers.PODMAN_RUN_OPTIONS, "--name", name, "-e",
                f"NVIDIA_VISIBLE_DEVICES={gpu}", LOAD_IMAGE, *LOAD_ARGS]  # fmt: skip
        return runtime, name, gpu, argv, self.podman_env

    def run(self, plans: list, watch: _RecordWatch) -> list:
        """The planned starts at once (a thread each, released by one barrier); their results once
        all have ended and their containers are removed."""
        barrier = threading.Barrier(len(plans))
        results = [None] * len(plans)

        def one(i: int, plan: tuple) -> None:
            barrier.wait()
            results[i] = self._start(*plan)

        threads = [threading.Thread(target=one, args=(i, plan)) for i, plan in enumerate(plans)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return self._finish(results, watch)

    def alone(self, plan: tuple, watch: _RecordWatch) -> dict:
        return self._finish([self._start(*plan)], watch)[0]

    def _start(self, runtime: str, name: str, gpu: int, argv: list, env: dict) -> dict:
        from hookcheck import listed_uuids

        began = time.perf_counter()
        try:
            out = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                 timeout=START_TIMEOUT_SECONDS)  # fmt: skip
            rc, stdout, error = out.returncode, out.stdout, out.stderr.strip()[-500:]
        except subprocess.TimeoutExpired:
            rc, stdout, error = None, "", f"did not end within {START_TIMEOUT_SECONDS} s"
        wall = time.perf_counter() - began
        return {"runtime": runtime, "name": name, "gpu": gpu, "uuid": self.uuids[gpu], "rc": rc, "error": error,
                "listed": listed_uuids(stdout, ("GPU",)), "wall_s": round(wall, 6)}  # fmt: skip

    def _finish(self, results: list, watch: _RecordWatch) -> list:
        """Each start's container record (by its container's id: podman's, from its name), then its
        container removed."""
        names = [r["name"] for r in results if r["runtime"] == "podman"]
        ids = {}
        if names:
            listed = subprocess.run([*self.podman, "ps", "--all", "--no-trunc", "--format", "{{.Names}} {{.ID}}"],
                                    env=self.podman_env, capture_output=True, text=True, check=True)  # fmt: skip
            ids = dict(line.split(" ", 1) for line in listed.stdout.splitlines() if " " in line)
            subprocess.run([*self.podman, "rm", "--force", *names], env=self.podman_env, capture_output=True,
                           timeout=START_TIMEOUT_SECONDS)  # fmt: skip
        _delete_containers(RUNC_ROOT)  # runc run deletes its own: any left by a failure
        watch.read()  # the last ones, if the watch has not read them yet
        for result in results:
            result["record"] = watch.record(ids.get(result["name"], result["name"]))
        return results

    def close(self) -> None:
        """Every container of the load removed, however it ended."""
        subprocess.run([*self.podman, "rm", "--all", "--force"], env=self.podman_env, capture_output=True,
                       timeout=START_TIMEOUT_SECONDS)  # fmt: skip
        _delete_containers(RUNC_ROOT)


def _loadavg() -> list:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def _load_main(spec_path: str) -> None:
    import startservercheck

    from oci_gpu_hook.start import server, settings
    from oci_gpu_hook.toolkit.simulate import simulate

    with open(spec_path) as f:
        spec = json.load(f)
    ram = os.path.join(spec["work"], "ram")
    os.mkdir(ram, 0o700)
    # /run of its own: runc's and podman's state and the hook's compiled settings (settings.RUN_DIR);
    # /dev/shm: podman's locks, which another podman on the host takes by the same name.
    for directory, mode in ((ram, "0700"), ("/run", "0755"), ("/dev/shm", "1777")):
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"mode={mode}", "ocigpu-load", directory], check=True)
    os.makedirs(settings.RUN_DIR, mode=0o755)
    host = simulate(os.path.join(ram, "host"), gpus=GPUS)
    config = startservercheck.config(host, ram)
    # The inventory cache, as a node's refresh unit makes it at boot and on each driver change:
    # the starts find it fresh, as on a node in service (48 starts that each found none would each
    # ask NVML at once, on 2 CPUs past the budget NVML gets).
    from oci_gpu_hook.toolkit import containers

    subprocess.run([*containers.hook_command(config), "inventory", "refresh"], check=True, stdout=subprocess.DEVNULL)
    socket_path = os.path.join(ram, "start.sock")
    site, front = _install(ram, server.PACKAGE, socket_path)
    load_at_once = [("runc", i) for i in range(spec["runc"])] + [("podman", i) for i in range(spec["podman"])]
    results = {"warmup": [], "lone": {"runc": [], "podman": []}, "rounds": []}
    command = _server_command(site, socket_path, spec["patch"])
    starts = _Load(ram, front, config, host, spec["runc"])
    watch = _RecordWatch(os.path.join(ram, "records"))
    try:
        with startservercheck.Server(os.path.join(ram, "server.log"), command=command) as running:
            running.wait_listening()
            if spec["warmup"]:
                for runtime in ("runc", "podman"):
                    results["warmup"].append(starts.alone(starts.plan("warmup", runtime, 0), watch))
                results["warmup"] += starts.run([starts.plan("warmup", *s) for s in load_at_once], watch)
            results["loadavg"] = [_loadavg()]
            for round_ in range(spec["rounds"]):
                share = spec["lone"] // spec["rounds"] + (round_ < spec["lone"] % spec["rounds"])
                for runtime in ("runc", "podman"):
                    for _ in range(share):
                        results["lone"][runtime].append(starts.alone(starts.plan("lone", runtime, 0), watch))
                results["rounds"].append(starts.run([starts.plan(f"round{round_}", *s) for s in load_at_once],
                                                    watch))  # fmt: skip
            results["loadavg"].append(_loadavg())
            served = sum(1 for s in load_starts(results) if (s["record"] or {}).get("via") == server.VIA)
            results["offers"] = len(load_starts(results))
            results["counts"] = startservercheck.counted(socket_path, served=served)
            log = running.log()
    finally:
        watch.stop()
        starts.close()
    results["server_log"] = [line for line in log if not line.startswith(startservercheck.LISTENING)]
    with open(spec_path + ".results", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    sys.path.insert(0, HERE)  # startservercheck and hookcheck, beside this file
    if sys.argv[1] == "--load":
        _load_main(sys.argv[2])
    else:
        _main(sys.argv[1])
