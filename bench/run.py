"""Benchmark the container start path: `make bench` (root, runc, gcc, busybox-static).

Interleaved, repeated runs in one invocation (a warm-up round first), each round in a new, seeded
order, so drift in the machine's state and what ran just before hit every case alike:
- floor: `python -I -c pass` with the interpreter the hook runs on;
- runc run of a trivial container without the hook, and with it for a non-GPU container, 1 GPU
  (utility+compute), 8 GPUs with all capabilities, and a MIG device, on a simulated 8-GPU host;
- the hook alone for the same cases: the non-GPU case from its state, the GPU cases against a
  fresh live container each time (a process in its own mount namespace and devices cgroup;
  setting it up is not timed);
- the same with the compiled pre-filter in front of the launcher (toolkit/prefilter.py), as
  install wires it where a C compiler is found: runc with it for no GPU and 1 GPU, and it alone;
- runc life cycles (issue 41), the figure the goals are judged by: `runc create`, `runc start`,
  wait for the container to exit, `runc delete`, each from a pristine copy of its bundle (the
  copy is not timed), for the plain bundle, the same with a no-op prestart hook (/bin/true: what
  runc itself spends on running any hook), and with the pre-filter in front of the launcher for
  no GPU, 1 GPU and 8 GPUs. Each is reported as a ratio to the plain cycle of the same round
  (the median of the per-round ratios: the machine's load hits both sides of a pair alike);
- the start server (issue 41): the same life cycles at 1 and 8 GPUs with the pre-filter offering
  its starts to a start server (`oci-gpu-hook start-server`, the command its unit runs) on a
  socket of the bench's own (and 8 GPUs with the 1-GPU case's capabilities: gpu8same), and the
  hook alone through it; the pre-filter cases above are built
  the same way with a socket nothing listens on (the Python path, as where no server runs);
- the 1-GPU case with the hook installed the other ways (bench/install_ways.py): a venv and
  `pip install --user`, each wired by its own `oci-gpu-hook install`, as podman's hooks.d file and
  Docker's nvidia-container-runtime-hook run it, and the venv's console script for comparison.
The hook runs from a regular install (not the developer's editable one, whose import hook costs
every Python start ~15 ms), launched like an installed /usr/bin/oci-gpu-hook: `python3 -IS`.
Then, each in rounds of its own after a warm-up round:
- `docker run` with and without `--gpus 1` with Debian's dockerd (bench/docker.py; --docker-runs);
- 50 GPU containers started at once under runc: each start's time and the whole's
  (bench/concurrent_starts.py; --concurrent-rounds);
- the served load (issue 51, goal 2): 32 runc and 16 podman GPU containers at once through the
  pre-filter and a start server, against a lone served start of each runtime, and the starts
  given to Python (bench/concurrent_starts.py served_load; --load-rounds, --lone-starts).
Writes bench/results.json and prints a table; docs/performance.md explains the results.
"""

import argparse
import json
import math
import os
import platform
import random
import resource
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(1, os.path.join(REPO, "tests"))  # tests/dockercheck.py runs dockerd

import breakdown  # noqa: E402
import concurrent_starts  # noqa: E402
import docker  # noqa: E402
import hookcheck  # noqa: E402
import install_ways  # noqa: E402
import leftovers  # noqa: E402
import node  # noqa: E402
import startservercheck  # noqa: E402

from oci_gpu_hook.start import prefilter_rule  # noqa: E402
from oci_gpu_hook.start.server import code_identity  # noqa: E402
from oci_gpu_hook.toolkit import containers, launcher, prefilter  # noqa: E402
from oci_gpu_hook.toolkit.simulate import simulate  # noqa: E402

PYTHON = os.path.realpath(sys.executable)  # the interpreter itself, not a venv's wrapper
CGROUP_ROOT = "/sys/fs/cgroup/devices"
WORK_PARENT = "/var/tmp"
# NVIDIA's legacy path (nvidia-container-runtime-hook, then nvidia-container-cli, built from source)
# as a ratio to a plain runc cycle. Taken from issue 41, measured elsewhere: NVIDIA's toolkit is not
# built on this machine, so these figures are never mixed with this run's.
NVIDIA_LEGACY = {
    "source": "taken from issue 41, measured elsewhere (100 paired runc cycles beside the project on one "
    "simulated 8-GPU host); not measured on this machine",
    "x_runc_cycle": {"gpu1": 1.60, "nongpu": 1.08},
}
HOW = (
    "every case in each of the rounds, in a new seeded order per round; the runc cycles' ratios are paired (the "
    "median of the per-round ratios to the plain cycle), so that load from other work on the machine, which moves "
    "whole rounds, hits both sides of each ratio alike; their CPU time (user and system of runc and everything it "
    "waited for) is given beside the wall time"
)
# Issue 51's goals for what install sets up by default (the start server), as ratios to the plain
# runc cycle measured in the same run; issue 41's, for the pre-filter where no server listens.
GOAL_GPU1_X_RUNC = 1.30  # half of NVIDIA legacy's added time (its 1.60x, taken from issue 41)
GOAL_GPU8_X_GPU1 = 1.10
GOAL_NONGPU_X_RUNC = 1.02  # runc's own floor for running any hook (the pre-filter answers these, server or not)
GOAL_DOCKER_X_PLAIN = 1.05
PYTHON_GPU1_X_RUNC = 1.45  # issue 41: 0.75x NVIDIA legacy's added time
PYTHON_GPU8_X_GPU1 = 1.15


def install(work: str) -> str:
    """A regular install of the project and its dependencies under work/site; returns a launcher.

    Built from a copy of what the package is made of, not from the checkout: pip builds in the
    tree it is given, and setuptools' build/lib there keeps files the checkout no longer has (a
    file removed, a branch switched). Installed, such a file makes the installed package other
    code than the checkout's. The pre-filters built here carry the checkout's identity, so its
    start server would take no start, and every served case would quietly time Python's path."""
    source = os.path.join(work, "source")
    os.mkdir(source)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(os.path.join(REPO, name), source)
    shutil.copytree(os.path.join(REPO, "oci_gpu_hook"), os.path.join(source, "oci_gpu_hook"),
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    site = os.path.join(work, "site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--target", site, source],
        check=True,
        stderr=subprocess.DEVNULL,
    )
    if code_identity(os.path.join(site, "oci_gpu_hook")) != code_identity():
        sys.exit("bench: the installed package is not this checkout's code; its start server would take no start")
    subprocess.run([PYTHON, "-m", "compileall", "-q", site], check=True)
    program = os.path.join(work, "oci-gpu-hook")
    with open(program, "w") as f:
        f.write(launcher.text(PYTHON, site))  # what the RPM's /usr/bin/oci-gpu-hook is
    os.chmod(program, 0o755)
    return program


def timed(argv, stdin=None, measure_rss=False):
    """(seconds, peak RSS in KiB or 0) of one process run to completion (exit 0 required).

    Peak RSS comes from GNU time when asked for: a process forked from this (large) benchmark
    inherits its resident size until exec, so its own rusage would report ours."""
    rss_file = None
    if measure_rss:
        rss_file = tempfile.NamedTemporaryFile(prefix="rss-")
        argv = ["/usr/bin/time", "-f", "%M", "-o", rss_file.name, *argv]
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    if stdin is not None:
        proc.stdin.write(stdin)
        proc.stdin.close()
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    err = proc.stderr.read()
    proc.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{argv[0]} failed ({code}): {err.decode(errors='replace').strip()}")
    if rss_file is None:
        return elapsed, 0
    with rss_file:
        return elapsed, int(open(rss_file.name).read().split()[-1])


class LiveContainer:
    """A process in its own mount namespace and a fresh deny-all devices cgroup: what the hook sees."""

    def __init__(self, bundle: str, n: int, case: str = ""):
        """case: in the container's id, so that the hook's log records can be told apart by case."""
        self.cgroup = os.path.join(CGROUP_ROOT, f"ocigpu-bench-{os.getpid()}-{n}")
        os.mkdir(self.cgroup)
        self.proc = hookcheck.hold_namespace(os.path.join(bundle, "rootfs"), 60)
        with open(os.path.join(self.cgroup, "cgroup.procs"), "w") as f:
            f.write(str(self.proc.pid))
        with open(os.path.join(self.cgroup, "devices.deny"), "w") as f:
            f.write("a")
        self.state = json.dumps(
            {
                "ociVersion": "1.0.2",
                "id": f"bench-{case}-{n}",
                "status": "creating",
                "pid": self.proc.pid,
                "bundle": bundle,
            }
        ).encode()

    def close(self):
        self.proc.kill()
        self.proc.wait()
        for _ in range(100):
            try:
                os.rmdir(self.cgroup)
                return
            except OSError:
                time.sleep(0.02)


def runc_cycle(runc: str, template: str, scratch: str, cid: str) -> tuple:
    """(seconds, 0, CPU seconds) of one runc life cycle of a pristine copy of the bundle template:
    create, start, wait for the container's exit, delete. The copy and its removal are not timed.
    The container's exit is seen through a pidfd (it is not our child), the moment it happens.

    CPU seconds: what the four runc processes and everything they waited for (the hook and its
    children included) spent, user and system. On a machine shared with other work it moves far
    less than the wall time (no time spent waiting for a CPU), so it shows small differences
    that the wall time's noise hides; the goals are judged on the wall time."""
    bundle = os.path.join(scratch, cid)
    shutil.copytree(template, bundle, symlinks=True)
    pid_file = os.path.join(scratch, cid + ".pid")
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    try:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        # stderr to /dev/null, not a pipe: the container keeps runc create's descriptors open
        if subprocess.run([runc, "create", "--bundle", bundle, "--pid-file", pid_file, cid], **quiet).returncode:
            raise SystemExit(f"runc create of {template} failed (rerun it by hand to see why)")
        with open(pid_file) as f:
            exited = os.pidfd_open(int(f.read()))
        try:
            subprocess.run([runc, "start", cid], check=True, **quiet)
            select.select([exited], [], [])
        finally:
            os.close(exited)
        subprocess.run([runc, "delete", cid], check=True, **quiet)
        elapsed = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        subprocess.run([runc, "delete", "--force", cid], **quiet)
        shutil.rmtree(bundle)
        os.unlink(pid_file)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return elapsed, 0, cpu


def server_cpu_seconds(pid: int) -> float:
    """The start server's CPU time so far, its reaped workers' included (procfs, clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def round_ratios(samples, base, field: int = 0) -> list:
    """The per-round ratios of samples to base (same rounds, same order); field 0 the wall time,
    2 the CPU time of runc_cycle's samples."""
    return [a[field] / b[field] for a, b in zip(samples, base)]


def paired_ratio(samples, base, field: int = 0) -> float:
    """The median of the per-round ratios (round_ratios)."""
    return statistics.median(round_ratios(samples, base, field))


def median_interval(values) -> tuple:
    """(low, high): a 95% confidence interval of the median of values, free of any assumption on
    their distribution: the order statistics at ranks n/2 -/+ 1.96 sqrt(n)/2 (the binomial
    rule); the whole range where there are too few values for one (10 or fewer)."""
    ordered = sorted(values)
    n = len(ordered)
    half = 1.96 * n**0.5 / 2
    low, high = math.floor(n / 2 - half), math.ceil(n / 2 + half + 1)  # 1-based ranks, rounded outwards
    return ordered[max(low, 1) - 1], ordered[min(high, n) - 1]


def judged(value: float, interval: tuple, goal: float) -> str:
    """What to say beside a paired goal's verdict (its median at most goal): the median, its
    interval, and whether the interval lies wholly on the verdict's side of the goal."""
    low, high = interval
    side = "wholly" if high <= goal or low > goal else "not wholly: within this run's noise"
    return f"x{value:.3f}, the median's 95% interval x{low:.3f} to x{high:.3f}, {side}"


def same_but_the_hook(plain: str, hooked: str) -> None:
    """The bench compares runc on two bundles for the hook's cost: refuse to measure if their
    config.json differ in anything but the hooks, or their rootfs in any file."""
    docs = []
    for bundle in (plain, hooked):
        with open(os.path.join(bundle, "config.json")) as f:
            doc = json.load(f)
        doc.pop("hooks", None)
        docs.append(doc)
        tree = sorted((os.path.relpath(d, bundle), sorted(ds), sorted(fs)) for d, ds, fs in os.walk(bundle + "/rootfs"))
        docs.append(tree)
    if docs[0] != docs[2] or docs[1] != docs[3]:
        raise SystemExit(f"{plain} and {hooked} differ in more than the hook: the comparison would be unfair")


def summary(samples, rss=None):
    """Median and p95 of timed's results, with the peak RSS when one was measured."""
    times = sorted(s[0] for s in samples)
    p95 = times[min(len(times) - 1, int(round(0.95 * (len(times) - 1))))]
    figures = {"median_ms": statistics.median(times) * 1e3, "p95_ms": p95 * 1e3, "runs": len(times)}
    return figures if rss is None else {**figures, "peak_rss_kib": rss}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    # A docker run takes ~0.3 s; 40 rounds give the paired goal an interval (10 give the range).
    parser.add_argument("--docker-runs", type=int, default=40)
    parser.add_argument("--concurrent-rounds", type=int, default=3)
    parser.add_argument("--load-rounds", type=int, default=concurrent_starts.LOAD_ROUNDS)
    parser.add_argument("--lone-starts", type=int, default=concurrent_starts.LONE_STARTS)
    parser.add_argument("--output", default=os.path.join(HERE, "results.json"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("make bench needs root (runc, mount namespaces, cgroups)")
    # Everything (rootfs, dockerd's data root, the simulated host) on a tmpfs of the bench's own:
    # on the VM this was measured on, making a file on the disk's ext4 took anywhere from 0.015 to
    # 0.8 ms depending on the directory and the hour (docs/performance.md), and a GPU start makes
    # ~40 in the rootfs; a host with its container storage's metadata in memory is what the
    # ratios should speak for.
    work = tempfile.mkdtemp(prefix="oci-gpu-hook-bench-", dir=WORK_PARENT)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "oci-gpu-hook-bench", work], check=True)
    servers = []
    try:
        launcher = install(work)
        host = simulate(os.path.join(work, "host"), gpus=8, mig=[1])
        config = os.path.join(host["root"], "config.yaml")
        hook = [launcher, "--config", config, "prestart"]
        subprocess.run([launcher, "--config", config, "inventory", "refresh"], check=True, capture_output=True)
        envs = {
            "nongpu": {},
            "gpu1": {"NVIDIA_VISIBLE_DEVICES": "0"},
            "gpu8": {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "all"},
            "mig": {"NVIDIA_VISIBLE_DEVICES": "1:0"},
        }

        # The pre-filter, in front of the same launcher (install puts it where the launcher was), as
        # install builds it: with a start server's socket. Twice: one whose socket nothing listens on
        # (every start it hands on goes to Python, as where no server runs) and one whose socket the
        # start server listens on, started with the command its unit runs (install), at its priority.
        # Both sockets are the bench's own, so that no other start on this machine reaches its server.
        front = prefilter.build(os.path.join(work, "oci-gpu-hook-prefilter"), launcher,
                                start_server=os.path.join(work, "nothing-listens.sock"))  # fmt: skip
        socket_path = os.path.join(work, "start.sock")
        served = prefilter.build(os.path.join(work, "oci-gpu-hook-served"), launcher, start_server=socket_path)
        server = subprocess.Popen(startservercheck.as_its_unit_runs([launcher, prefilter_rule.START_SERVER, "--socket",
                                                                     socket_path]),
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)  # fmt: skip
        servers.append(server)
        for _ in range(500):  # listening before the first round
            if os.path.exists(socket_path) or server.poll() is not None:
                break
            time.sleep(0.01)
        if not os.path.exists(socket_path):
            raise SystemExit(f"the start server did not listen on {socket_path}")

        def gpu_bundle(name, env, program=launcher):
            """A bundle running `true` whose prestart hook is program (the launcher, or the pre-filter)."""
            bundle = containers.make_bundle(os.path.join(work, name), args=["true"], env=env, config_file=config)
            with open(os.path.join(bundle, "config.json")) as f:
                doc = json.load(f)
            doc["hooks"]["prestart"][0].update(path=program, args=[program, *hook[1:]])
            with open(os.path.join(bundle, "config.json"), "w") as f:
                json.dump(doc, f)
            return bundle

        bundles = {name: gpu_bundle(name, env) for name, env in envs.items()}
        fronted = {name: gpu_bundle(f"prefilter-{name}", envs[name], front) for name in ("nongpu", "gpu1", "gpu8")}
        with_server = {name: gpu_bundle(f"server-{name}", envs[name], served) for name in ("gpu1", "gpu8")}
        # 8 GPUs with the 1-GPU case's capabilities: the goal's "8 GPUs against 1" with nothing else
        # changed (the gpu8 case also asks for every capability: 210 operations against 44).
        with_server["gpu8same"] = gpu_bundle("server-gpu8same", {"NVIDIA_VISIBLE_DEVICES": "all"}, served)
        # runc's own cost of running a prestart hook at all: the same hook entry, a program that does nothing
        noop = gpu_bundle("noop-hook", {}, "/bin/true")
        ways = install_ways.hooks(work, config)
        plain = containers.make_bundle(
            os.path.join(work, "plain"), args=["true"], env={}, config_file=None, with_hook=False
        )
        same_but_the_hook(plain, bundles["nongpu"])
        same_but_the_hook(plain, fronted["nongpu"])
        same_but_the_hook(plain, noop)
        scratch = os.path.join(work, "cycles")
        os.mkdir(scratch)
        runc = shutil.which("runc")
        samples = {}
        counter = [0]

        def runc_case(bundle, rss=False):
            counter[0] += 1
            cid = f"ocigpu-bench-{os.getpid()}-{counter[0]}"
            return timed([runc, "run", "--bundle", bundle, cid], measure_rss=rss)

        def cycle_case(bundle, rss=False):
            counter[0] += 1
            return runc_cycle(runc, bundle, scratch, f"ocigpu-bench-{os.getpid()}-{counter[0]}")

        def hook_case(name, rss=False, argv=hook, case=None):
            if name == "nongpu":
                state = {
                    "ociVersion": "1.0.2",
                    "id": "b",
                    "status": "creating",
                    "pid": os.getpid(),
                    "bundle": bundles[name],
                }
                return timed(argv, json.dumps(state).encode(), measure_rss=rss)
            counter[0] += 1
            live = LiveContainer(bundles[name], counter[0], (case or name).replace(" ", "-"))
            try:
                return timed(argv, live.state, measure_rss=rss)
            finally:
                live.close()

        cases = [
            ("floor", lambda rss=False: timed([PYTHON, "-I", "-c", "pass"], measure_rss=rss)),
            # The launcher's own interpreter start, without site: the first part of the breakdown.
            ("floor -IS", lambda rss=False: timed([PYTHON, "-IS", "-c", "pass"], measure_rss=rss)),
            ("runc", lambda rss=False: runc_case(plain, rss)),
        ]
        for name in envs:
            cases.append((f"runc+hook:{name}", lambda rss=False, n=name: runc_case(bundles[n], rss)))
            cases.append((f"hook:{name}", lambda rss=False, n=name: hook_case(n, rss)))
        for name, argv in ways.items():
            cases.append((name, lambda rss=False, a=argv, c=name: hook_case("gpu1", rss, a, c)))
        for name in ("nongpu", "gpu1"):
            cases.append((f"runc+prefilter:{name}", lambda rss=False, n=name: runc_case(fronted[n], rss)))
        cycles = {"cycle:runc": plain, "cycle:noop hook": noop}
        cycles.update((f"cycle:prefilter:{name}", bundle) for name, bundle in fronted.items())
        cycles.update((f"cycle:server:{name}", bundle) for name, bundle in with_server.items())
        for name, bundle in cycles.items():
            cases.append((name, lambda rss=False, b=bundle: cycle_case(b)))
        cases.append(("prefilter:nongpu", lambda rss=False: hook_case("nongpu", rss, [front, *hook[1:]])))
        # The hook alone through the start server (the pre-filter's time included, the worker's in
        # the server's process): its log records give the server's breakdown.
        cases.append(("server:gpu1", lambda rss=False: hook_case("gpu1", False, [served, *hook[1:]], "server gpu1")))
        # Each round runs the cases in a new order (seeded, so a rerun repeats it). In a fixed order
        # a case pays for what ran before it: runc right after the Python floors took 26 ms where
        # the same bundle right after another runc took 18-21 ms (CPU and page-cache state, and
        # the previous container's teardown), which made the plain bundle look slower than the
        # same bundle with a hook. Shuffled, every case follows every other alike.
        order = random.Random(0)
        # A served start's worker is the server's child, not runc's: its CPU is in the server's
        # (reaped children included), in clock ticks, too coarse for one start: given as the mean
        # over every served start of the rounds.
        server_cpu = server_cpu_seconds(server.pid)
        for round_ in range(args.runs + 1):  # round 0 warms up caches and is not kept
            for name, case in order.sample(cases, len(cases)):
                result = case()
                if round_:
                    samples.setdefault(name, []).append(result)
        served_starts = (args.runs + 1) * sum(1 for name, _ in cases if "server" in name)
        server_cpu = (server_cpu_seconds(server.pid) - server_cpu) / served_starts
        rss = {name: max(case(rss=True)[1] for _ in range(3))
               for name, case in cases if name not in cycles and name != "server:gpu1"}  # fmt: skip
        record = node.record_cost(os.path.join(work, "site"))
        exporter = node.exporter_figures(launcher, host, args.runs)
        watchdog = node.watchdog_figures(os.path.join(work, "site"), host, args.runs)
        # Docker's program as an RPM install's own `oci-gpu-hook install --runtime docker` writes it: run
        # by the launcher, since install writes the program for the interpreter and package it runs
        # from (install.install called here would write one for this checkout, whose dependencies
        # are outside it).
        rpm_docker = install_ways.wire([launcher, "--config", config], os.path.join(work, "root-rpm"))["docker"]
        docker_runs = docker.samples(os.path.join(work, "docker"), rpm_docker[0], args.docker_runs, timed)
        dockers = {name: summary(s) for name, s in docker_runs.items()}
        dockers["x_plain"] = dockers["docker run --gpus 1"]["median_ms"] / dockers["docker run"]["median_ms"]
        # And as install writes it where a compiler builds the pre-filter: the pre-filter in front of
        # that launcher (its --config built in), offering each start to the start server above.
        os.mkdir(os.path.join(work, "docker-served"))
        served_docker = prefilter.build(os.path.join(work, "docker-served", "nvidia-container-runtime-hook"),
                                        rpm_docker[0], ("--config", config), start_server=socket_path)  # fmt: skip
        served_runs = docker.samples(os.path.join(work, "docker-2"), served_docker, args.docker_runs, timed)
        dockers_served = {name: summary(s) for name, s in served_runs.items()}
        dockers_served["x_plain"] = (dockers_served["docker run --gpus 1"]["median_ms"]
                                     / dockers_served["docker run"]["median_ms"])  # fmt: skip
        dockers_served["x_plain_paired"] = paired_ratio(served_runs["docker run --gpus 1"], served_runs["docker run"])
        dockers["x_plain_paired"] = paired_ratio(docker_runs["docker run --gpus 1"], docker_runs["docker run"])
        load = [gpu_bundle(f"load{i}", {"NVIDIA_VISIBLE_DEVICES": str(i % 8)})
                for i in range(concurrent_starts.CONTAINERS)]  # fmt: skip
        walls, starts = concurrent_starts.rounds(load, args.concurrent_rounds, timed)
        load_figures = {"containers": len(load), "rounds": len(walls), "wall_median_s": statistics.median(walls),
                        "walls_s": walls, "start": summary(starts)}  # fmt: skip
        os.mkdir(os.path.join(work, "served-load"))
        served_load = concurrent_starts.served_load(os.path.join(work, "served-load"), args.load_rounds,
                                                    args.lone_starts)  # fmt: skip
        results = {name: summary(s, rss.get(name)) for name, s in samples.items()}
        floor, runc_ms = results["floor"]["median_ms"], results["runc"]["median_ms"]
        for r in results.values():
            r["x_floor"] = r["median_ms"] / floor
            r["x_runc"] = r["median_ms"] / runc_ms
        # Issue 41's figures: each cycle against the plain cycle of the same round.
        cycle_runc = results["cycle:runc"]["median_ms"]
        for name in cycles:
            results[name]["x_runc_cycle"] = paired_ratio(samples[name], samples["cycle:runc"])
            results[name]["x_runc_cycle_of_medians"] = results[name]["median_ms"] / cycle_runc
            results[name]["added_to_runc_cycle_ms"] = results[name]["median_ms"] - cycle_runc
            results[name]["cpu_median_ms"] = statistics.median(x[2] for x in samples[name]) * 1e3
            results[name]["x_runc_cycle_cpu"] = paired_ratio(samples[name], samples["cycle:runc"], 2)
        gpu8_x_gpu1 = paired_ratio(samples["cycle:prefilter:gpu8"], samples["cycle:prefilter:gpu1"])
        served_gpu8_x_gpu1 = paired_ratio(samples["cycle:server:gpu8"], samples["cycle:server:gpu1"])
        served_gpu8same_x_gpu1 = paired_ratio(samples["cycle:server:gpu8same"], samples["cycle:server:gpu1"])
        gpu1, gpu8 = results["hook:gpu1"]["median_ms"], results["hook:gpu8"]["median_ms"]
        for name in ways:
            results[name]["x_rpm"] = results[name]["median_ms"] / gpu1
        peak = max(r["peak_rss_kib"] for n, r in results.items() if n.startswith("hook:"))
        server_logged = breakdown.logged(os.path.join(host["root"], "hook.log"), "bench-server-gpu1-")
        server_sandboxes = breakdown.sandboxes(os.path.join(host["root"], "hook.log"))
        imports = breakdown.import_ms(PYTHON, os.path.join(work, "site"), args.runs)
        logged = breakdown.logged(os.path.join(host["root"], "hook.log"), "bench-gpu1-")
        parts = breakdown.breakdown(gpu1, results["floor -IS"]["median_ms"], imports, logged)
        added = {
            name: results[f"runc+{name}"]["median_ms"] - runc_ms
            for name in ("hook:nongpu", "prefilter:nongpu", "hook:gpu1", "prefilter:gpu1")
        }
        x_cycle = {name: results[f"cycle:prefilter:{name}"]["x_runc_cycle"] for name in ("nongpu", "gpu1")}
        # Issue 51's paired goals, each with the noise of its rounds: a median an interval wide of
        # the goal is met or missed by this machine's noise, not by the code (docs/performance.md).
        paired_goals = {  # target: (case, the case its rounds are paired with, goal)
            f"cycle:server:gpu1 <= {GOAL_GPU1_X_RUNC}x cycle:runc": ("cycle:server:gpu1", "cycle:runc",
                                                                    GOAL_GPU1_X_RUNC),
            f"cycle:server:gpu8same <= {GOAL_GPU8_X_GPU1}x its gpu1": ("cycle:server:gpu8same", "cycle:server:gpu1",
                                                                      GOAL_GPU8_X_GPU1),
            f"cycle:prefilter:nongpu <= {GOAL_NONGPU_X_RUNC}x cycle:runc": ("cycle:prefilter:nongpu", "cycle:runc",
                                                                           GOAL_NONGPU_X_RUNC),
        }  # fmt: skip
        targets, noise = {}, {}
        for target, (case, base, goal) in paired_goals.items():
            ratios = round_ratios(samples[case], samples[base])
            median = statistics.median(ratios)
            targets[target] = median <= goal
            noise[target] = judged(median, median_interval(ratios), goal)
        targets.update(
            {
                f"cycle:server:gpu8 (all caps) <= {GOAL_GPU8_X_GPU1}x its gpu1": served_gpu8_x_gpu1 <= GOAL_GPU8_X_GPU1,
                f"cycle:prefilter:gpu1 (no server) <= {PYTHON_GPU1_X_RUNC}x cycle:runc": x_cycle["gpu1"]
                <= PYTHON_GPU1_X_RUNC,
                f"cycle:prefilter:gpu8 (no server) <= {PYTHON_GPU8_X_GPU1}x its gpu1": gpu8_x_gpu1
                <= PYTHON_GPU8_X_GPU1,
                "runc+prefilter:nongpu <= 1.15x runc": results["runc+prefilter:nongpu"]["x_runc"] <= 1.15,
                "runc+prefilter:nongpu adds <= 3 ms to runc": added["prefilter:nongpu"] <= 3.0,
                "hook:nongpu <= 1.3x floor": results["hook:nongpu"]["x_floor"] <= 1.3,
                "hook:gpu1 <= 2.0x floor": results["hook:gpu1"]["x_floor"] <= 2.0,
                "runc+hook:gpu1 <= 2.0x runc": results["runc+hook:gpu1"]["x_runc"] <= 2.0,
                "hook:gpu8 <= 1.25x hook:gpu1": gpu8 <= 1.25 * gpu1,
                "hook peak RSS <= 30 MiB": peak <= 30 << 10,
                "container record <= 0.5 ms": record["total_ms"] <= 0.5,
                "exporter scrape (8 GPUs, 50 records) <= 50 ms": exporter["scrape_median_ms"] <= 50,
                "exporter RSS <= 60 MiB": exporter["rss_kib"] <= 60 << 10,
                "watchdog scan (8 GPUs, 100 processes) <= 20 ms CPU": watchdog["scan_cpu_ms"] <= 20,
                "watchdog RSS <= 60 MiB": watchdog["rss_kib"] <= 60 << 10,
            }
        )
        for name in ways:
            if name.startswith("install:"):
                targets[f"{name} <= 1.05x RPM launcher"] = results[name]["x_rpm"] <= 1.05
        # Judged as the paired cycle goals are: the median of the per-round ratios, with its noise
        # (before, the ratio of the two medians, over 10 rounds that gave no interval).
        docker_ratios = round_ratios(served_runs["docker run --gpus 1"], served_runs["docker run"])
        docker_target = f"docker run --gpus 1 (start server) <= {GOAL_DOCKER_X_PLAIN}x docker run, paired"
        targets[docker_target] = statistics.median(docker_ratios) <= GOAL_DOCKER_X_PLAIN
        noise[docker_target] = judged(statistics.median(docker_ratios), median_interval(docker_ratios),
                                      GOAL_DOCKER_X_PLAIN)  # fmt: skip
        targets["docker run --gpus 1 (launcher, no server) <= 1.10x docker run"] = dockers["x_plain"] <= 1.10
        # NVIDIA's legacy path is not built here: its figures stay in their own block, as issue 41 gave
        # them; the goals above are this run's ratios against limits derived from them.
        nvidia = dict(NVIDIA_LEGACY)
        targets[f"{len(load)} concurrent GPU starts <= 4.3 s wall"] = load_figures["wall_median_s"] <= 4.3
        targets.update(served_load["targets"])
        cpu = next(
            (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?"
        )
        machine = {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "cpu": cpu,
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "runc": subprocess.run([runc, "--version"], capture_output=True, text=True).stdout.splitlines()[0],
        }
        doc = {"runs": args.runs, "machine": machine, "how": HOW, "results": results, "targets": targets,
               "targets_noise": noise,
               "command": "make bench",
               "added_to_runc_ms": added, "cycle_gpu8_x_gpu1": gpu8_x_gpu1,
               "cycle_server_gpu8_x_gpu1": served_gpu8_x_gpu1,
               "cycle_server_gpu8same_x_gpu1": served_gpu8same_x_gpu1, "nvidia_legacy_taken_from_issue_41": nvidia,
               "server_worker_timings_gpu1_ms": server_logged,
               "server_cpu_per_served_start_ms": server_cpu * 1e3,
               "server_ldconfig_sandboxes": server_sandboxes,
               "node": {"container_record": record, "exporter": exporter, "watchdog": watchdog},
               "docker": {"runs": args.docker_runs, **dockers},
               "docker_start_server": {"runs": args.docker_runs, **dockers_served}, "concurrent": load_figures,
               "served_load": served_load,
               "breakdown_gpu1_ms": [{"part": p, "ms": ms, "what": what} for p, ms, what in parts]}  # fmt: skip
        with open(args.output, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"{'case':24} {'median ms':>10} {'p95 ms':>8} {'x floor':>8} {'x runc':>7} {'peak RSS MiB':>12}")
        for name, r in results.items():
            if name in cycles:
                continue
            print(
                f"{name:24} {r['median_ms']:10.1f} {r['p95_ms']:8.1f} {r['x_floor']:8.2f} {r['x_runc']:7.2f} "
                f"{r.get('peak_rss_kib', 0) / 1024:12.1f}"
            )
        print(f"runc life cycles (create, start, wait, delete; pristine bundle), {args.runs} paired rounds:")
        for name in cycles:
            r = results[name]
            print(f"  {name:24} median {r['median_ms']:6.1f} ms, p95 {r['p95_ms']:6.1f} ms, "
                  f"x{r['x_runc_cycle']:.3f} the plain cycle (paired; of medians x{r['x_runc_cycle_of_medians']:.3f}, "
                  f"{r['added_to_runc_cycle_ms']:+.1f} ms); CPU {r['cpu_median_ms']:.1f} ms, "
                  f"x{r['x_runc_cycle_cpu']:.3f} (paired)")  # fmt: skip
        print(f"  8 GPUs against 1 GPU: x{gpu8_x_gpu1:.3f} (paired); through the start server "
              f"x{served_gpu8_x_gpu1:.3f}, with the 1-GPU capabilities x{served_gpu8same_x_gpu1:.3f}")  # fmt: skip
        print(f"  the start server's CPU per served start (not in the cycles' CPU above): {server_cpu * 1e3:.1f} ms "
              "(mean; its workers included)")  # fmt: skip
        print("  ldconfig's sandbox in served starts, made by: "
              + ", ".join(f"{who} {count}" for who, count in sorted(server_sandboxes.items())))  # fmt: skip
        print(
            f"container record: {record['total_ms']:.3f} ms (import {record['import_ms']:.3f}, build and write "
            f"{record['write_ms']:.3f})"
        )
        print(
            f"exporter, 8 GPUs and 50 records: scrape median {exporter['scrape_median_ms']:.1f} ms, p95 "
            f"{exporter['scrape_p95_ms']:.1f} ms, RSS {exporter['rss_kib'] / 1024:.1f} MiB"
        )
        print(
            f"watchdog, 8 GPUs and 100 processes: scan {watchdog['scan_cpu_ms']:.1f} ms CPU, RSS "
            f"{watchdog['rss_kib'] / 1024:.1f} MiB"
        )
        for name, ms in added.items():
            print(f"added to a runc run by {name}: {ms:+.1f} ms")
        print(
            "NVIDIA's legacy path was not run here; taken from issue 41, measured elsewhere: "
            + ", ".join(f"{case} x{x:.2f}" for case, x in NVIDIA_LEGACY["x_runc_cycle"].items())
            + " a plain runc cycle"
        )
        print("where the time of hook:gpu1 goes (ms):")
        for part, ms, what in parts:
            print(f"  {part:52} {ms:7.2f}  {what}")
        print("the start server's worker at 1 GPU, its log records' medians (ms): "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(server_logged.items())))  # fmt: skip
        for name in ways:
            print(f"{name}: x{results[name]['x_rpm']:.3f} the RPM's launcher (hook:gpu1)")
        without, with_gpus = dockers["docker run"], dockers["docker run --gpus 1"]
        print(
            f"docker run: median {without['median_ms']:.1f} ms, p95 {without['p95_ms']:.1f} ms; with --gpus 1: "
            f"median {with_gpus['median_ms']:.1f} ms, p95 {with_gpus['p95_ms']:.1f} ms (x{dockers['x_plain']:.3f}; "
            f"paired x{dockers['x_plain_paired']:.3f}); through the pre-filter and the start server: "
            f"x{dockers_served['x_plain']:.3f} (paired x{dockers_served['x_plain_paired']:.3f})"
        )
        print(
            f"{len(load)} concurrent GPU starts under runc: wall median {load_figures['wall_median_s']:.2f} s "
            f"(rounds: {', '.join(f'{w:.2f}' for w in walls)}); one start: median "
            f"{load_figures['start']['median_ms']:.0f} ms, p95 {load_figures['start']['p95_ms']:.0f} ms"
        )
        print("\n".join(concurrent_starts.describe(served_load)))
        for target, met in targets.items():
            print(f"{'met ' if met else 'MISSED'} {target}" + (f" ({noise[target]})" if target in noise else ""))
        print(f"wrote {args.output}")
    finally:
        for server in servers:  # stopped by its pid, as systemd stops it
            server.terminate()
            server.wait()
        subprocess.run(["umount", "--lazy", work], check=True)  # a lazy unmount: a straggler cannot block it
        os.rmdir(work)
        leftovers.remove_compiled_settings(leftovers.RUN_DIR, work)  # what the hooks kept of the bench's config


if __name__ == "__main__":
    main()
