"""`podman run` with a GPU by CDI and by the hook, for `make bench` (issue 51, goal 4; root, podman,
runc, gcc, unshare, busybox-static).

Every case is `podman run --rm ... true` of one busybox image on a simulated 8-GPU host (one GPU in
MIG mode, as bench/run.py's), with the hook from a regular install (bench/run.py's install) and
the compiled pre-filter in front of it, as install wires it where a compiler is found:
- plain: no GPU, no hook (podman reads an empty hooks directory);
- cdi: `--device bench-ours.com/gpu=0` from the spec `oci-gpu-hook cdi generate` writes, no hooks.d
  file; the spec's createContainer hook (`oci-gpu-hook ldcache-refresh`) runs through the pre-filter
  at the path an installed spec names, and the pre-filter hands it straight to Python: a cold
  interpreter start for each container, then the host's ldconfig;
- cdi-no-hook: the same spec with that hook left out. Not a working GPU container (no SONAME links,
  no ld.so.cache: nvidia-smi cannot load NVML), there only to show what the hook costs;
- cdi+hooks.d: the spec's device with our hooks.d file present, as on a host where install ran:
  the prestart hook sees the spec's device variable and records the container, through the server;
- hooks.d-server: `-e NVIDIA_VISIBLE_DEVICES=0` through the hooks.d file install writes, the
  pre-filter offering the start to a start server of the bench's own (install's default);
- hooks.d-python: the same with the pre-filter's socket one nothing listens on (no server runs);
- hooks.d-no-gpu: a container without a GPU with the hooks.d file present (the pre-filter answers).
Before the rounds each case runs once with a command that shows it is what it says (nvidia-smi -L
lists GPU 0 and nothing else; no GPU where none is asked for; the start server's count of served
starts grows by one for each served case), and after them the server's count must be exactly the
served cases' runs. Then the rounds: a warm-up round, then --cdi-runs rounds, each in a new seeded
order; each case's figure is the median of its per-round ratios (and differences) to plain podman
run in the same round, so that load from other work moves both sides alike.

The bench runs in a private mount namespace of its own (unshare) with an overlay over /etc: podman
4.3 reads CDI specs from /etc/cdi and /var/run/cdi only, and the bench's go to /etc/cdi there,
where no other podman on the host sees them and nothing of them outlives the run.

NVIDIA's own spec (`nvidia-ctk cdi generate`) is not measured: no nvidia-ctk can be had on this
machine (docs/performance.md, "CDI or the hook", says why and what its spec does differently).
Writes the "cdi" part of bench/results.json (the rest kept) and prints a table.
"""

import argparse
import datetime
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(1, os.path.join(REPO, "tests"))  # hookcheck, startservercheck: shared with the suite

import hookcheck  # noqa: E402
import leftovers  # noqa: E402
import results  # noqa: E402 - bench/results.py
import run  # noqa: E402 - bench/run.py: the regular install, timed runs, medians and paired ratios
import startservercheck  # noqa: E402

from oci_gpu_hook.start import prefilter_rule  # noqa: E402
from oci_gpu_hook.toolkit import cdi, containers, install, prefilter  # noqa: E402
from oci_gpu_hook.toolkit.simulate import simulate  # noqa: E402

KIND = "bench-ours.com/gpu"  # a kind of the bench's own: no other spec on the host defines it
KIND_NO_HOOK = "bench-ours-no-hook.com/gpu"
SPEC_DIR = "/etc/cdi"
IMAGE = f"localhost/oci-gpu-hook-bench-cdi:{os.getpid()}"
PRIVATE = "--in-private-namespace"  # set by the bench itself once it runs in its own namespace
GPU_CHECK = ["nvidia-smi", "-L"]
NO_GPU_CHECK = ["sh", "-c", "test ! -e /dev/nvidia0 && test ! -e /usr/bin/nvidia-smi"]
# The spec without its hook has the GPU's node and the driver's files, and nothing the hook makes.
NO_HOOK_CHECK = ["sh", "-c", "test -c /dev/nvidia0 && test -f /usr/bin/nvidia-smi && test ! -e /etc/ld.so.cache "
                 "&& ! nvidia-smi -L"]  # fmt: skip
WHAT = {
    "plain": "podman run, no GPU, no hook",
    "cdi": "--device from our cdi generate spec (its createContainer hook: ldcache-refresh, cold Python), no hooks.d",
    "cdi-no-hook": "our spec with its createContainer hook left out (not a working GPU container: the hook's cost)",
    "cdi+hooks.d": "--device from our spec with our hooks.d file present (the prestart hook records it, served)",
    "hooks.d-server": "-e NVIDIA_VISIBLE_DEVICES=0 through hooks.d, the pre-filter and the start server",
    "hooks.d-python": "-e NVIDIA_VISIBLE_DEVICES=0 through hooks.d, the pre-filter and Python (no server)",
    "hooks.d-no-gpu": "no GPU, our hooks.d file present (the pre-filter answers)",
}
SERVED = ("cdi+hooks.d", "hooks.d-server")  # the cases whose prestart hook the start server runs
NVIDIA_CTK = {
    "measured": False,
    "why": "no nvidia-ctk or nvidia-cdi-hook on this machine and none to be had offline: Debian 12 and 13 "
    "(main, contrib, non-free) ship no NVIDIA container toolkit package, PyPI has none, no copy is "
    "vendored here, and its Go module cannot be fetched (the Go module proxy does not resolve)",
}


def in_private_namespace(work: str) -> None:
    """An overlay over /etc, its upper layer in work, so that /etc/cdi is the bench's alone."""
    upper, scratch = os.path.join(work, "etc-upper"), os.path.join(work, "etc-work")
    os.mkdir(upper)
    os.mkdir(scratch)
    options = f"lowerdir=/etc,upperdir={upper},workdir={scratch}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, "/etc"], check=True)
    os.makedirs(SPEC_DIR, exist_ok=True)


def write_specs(launcher: str, config: str, hook_program: str) -> str:
    """Our spec for the simulated host in SPEC_DIR as `cdi generate` writes it, its hook the one an
    installed host's names (the pre-filter in front of the launcher), and the same spec without its
    hook under KIND_NO_HOOK; returns the first's path."""
    out = subprocess.run([launcher, "--config", config, "cdi", "generate", "--vendor-class", KIND, "--format", "json"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    spec = json.loads(out.stdout)
    (hook,) = spec["containerEdits"]["hooks"]
    # Generated outside an install, the spec names this interpreter (install.installed_command); an
    # installed one names /usr/bin/oci-gpu-hook, here the bench's pre-filter. Nothing else changes.
    rest = hook["args"][hook["args"].index(cdi.HOOK_SUBCOMMAND) :]
    hook.update(path=hook_program, args=install.hook_args([hook_program], *rest))
    without = json.loads(json.dumps(spec))
    without["kind"] = KIND_NO_HOOK
    del without["containerEdits"]["hooks"]
    paths = []
    for doc, name in ((spec, "bench-ours.json"), (without, "bench-ours-no-hook.json")):
        cdi.validate(doc)
        paths.append(os.path.join(SPEC_DIR, name))
        cdi.write_atomically(paths[-1], cdi.dump(doc, "json"))
    return paths[0]


def podman(hooks_dir: str, options, command) -> list:
    return ["podman", "--hooks-dir", hooks_dir, "--runtime", "runc", "run", "--rm", *containers.PODMAN_RUN_OPTIONS,
            *options, IMAGE, *command]  # fmt: skip


def served_count(socket_path: str, wanted: int) -> int:
    """The start server's count of served starts once it is wanted (or after startservercheck's
    hang guard: the count as it stands)."""
    try:
        return startservercheck.counted(socket_path, served=wanted).get("served", -1)
    except OSError as e:
        raise SystemExit(f"the bench's start server does not answer on {socket_path}: {e}") from None


def check(name: str, argv, gpu_uuid: str) -> None:
    """One run of the case's command with a check in place of `true`: SystemExit if it is not what
    its name says."""
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    if argv[-len(GPU_CHECK) :] == GPU_CHECK:
        ok = out.returncode == 0 and hookcheck.listed_uuids(out.stdout, ("GPU", "MIG")) == [gpu_uuid]
    else:
        ok = out.returncode == 0
    if not ok:
        raise SystemExit(f"{name}: the container is not what the case says ({out.returncode}): "
                         f"{(out.stdout + out.stderr).strip()[-500:]}")  # fmt: skip


def differences_ms(samples, base) -> list:
    """The per-round differences of samples to base (timed's results), in ms."""
    return [(a[0] - b[0]) * 1e3 for a, b in zip(samples, base)]


def paired_added_ms(samples, base) -> float:
    return statistics.median(differences_ms(samples, base))


def cases_for(hooks: dict) -> dict:
    """{case: (hooks directory, podman run options, the command that checks it)}."""
    gpu0 = ["-e", "NVIDIA_VISIBLE_DEVICES=0"]
    return {
        "plain": (hooks["none"], [], NO_GPU_CHECK),
        "cdi": (hooks["none"], ["--device", f"{KIND}=0"], GPU_CHECK),
        "cdi-no-hook": (hooks["none"], ["--device", f"{KIND_NO_HOOK}=0"], NO_HOOK_CHECK),
        "cdi+hooks.d": (hooks["served"], ["--device", f"{KIND}=0"], GPU_CHECK),
        "hooks.d-server": (hooks["served"], gpu0, GPU_CHECK),
        "hooks.d-python": (hooks["python"], gpu0, GPU_CHECK),
        "hooks.d-no-gpu": (hooks["served"], [], NO_GPU_CHECK),
    }


def checked_rounds(cases: dict, runs: int, socket_path: str, gpu_uuid: str) -> tuple:
    """({case: [timed's result of each kept round]}, the load averages before and after the rounds,
    the server's served starts): each case checked first, the server's count checked throughout."""
    served = served_count(socket_path, 0)
    for name, (hooks_dir, options, command) in cases.items():
        check(name, podman(hooks_dir, options, command), gpu_uuid)
        wanted = served + (name in SERVED)
        served = served_count(socket_path, wanted)
        if served != wanted:
            raise SystemExit(f"{name}: the start server served {served} starts, not {wanted}")
    order = random.Random(0)
    samples = {}
    loads = [os.getloadavg()]
    for round_ in range(runs + 1):  # round 0 warms up and is not kept
        for name, (hooks_dir, options, _) in order.sample(list(cases.items()), len(cases)):
            result = run.timed(podman(hooks_dir, options, ["true"]))
            if round_:
                samples.setdefault(name, []).append(result)
    loads.append(os.getloadavg())
    wanted = served + (runs + 1) * len(SERVED)
    if served_count(socket_path, wanted) != wanted:
        raise SystemExit(f"the start server did not serve exactly the {len(SERVED)} served cases' starts")
    return samples, loads, wanted


def measure(work: str, runs: int) -> dict:
    launcher = run.install(work)
    host = simulate(os.path.join(work, "host"), gpus=8, mig=[1])
    config = os.path.join(host["root"], "config.yaml")
    subprocess.run([launcher, "--config", config, "inventory", "refresh"], check=True, capture_output=True)
    # Both pre-filters at a path named as installed (/usr/bin/oci-gpu-hook), so that their hook
    # entries read as install writes them; one offers to the bench's own server, one to a socket
    # nothing listens on.
    socket_path = os.path.join(work, "start.sock")
    programs = {}
    for name, socket in (("served", socket_path), ("python", os.path.join(work, "nothing-listens.sock"))):
        os.mkdir(os.path.join(work, name))
        programs[name] = prefilter.build(os.path.join(work, name, "oci-gpu-hook"), launcher, start_server=socket)
    hooks = {name: install.write_hooks_dir(os.path.join(work, f"hooks-{name}"), [program, "--config", config])
             for name, program in programs.items()}  # fmt: skip
    hooks["none"] = os.path.join(work, "hooks-none")
    os.mkdir(hooks["none"])
    write_specs(launcher, config, programs["served"])
    containers.podman_image(containers.make_rootfs(os.path.join(work, "rootfs")), IMAGE)
    cases = cases_for(hooks)
    # As its unit runs it (the hooks' environment), its log beside it; stopped by its pid.
    command = startservercheck.as_its_unit_runs([launcher, prefilter_rule.START_SERVER, "--socket", socket_path])
    server = startservercheck.Server(os.path.join(work, "start-server.log"), command=command)
    try:
        with server:
            server.wait_listening()
            samples, loads, served = checked_rounds(cases, runs, socket_path, host["gpus"][0]["uuid"])
    finally:
        subprocess.run(["podman", "rmi", "-f", IMAGE], capture_output=True)
    figures = {}
    for name in cases:
        found = samples[name]
        figures[name] = {**run.summary(found), "what": WHAT[name],
                         "x_plain": run.paired_ratio(found, samples["plain"]),
                         "added_to_plain_ms": paired_added_ms(found, samples["plain"])}  # fmt: skip
    hook = differences_ms(samples["cdi"], samples["cdi-no-hook"])
    podman_version = subprocess.run(["podman", "--version"], capture_output=True, text=True).stdout.split()[-1]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["bench/cdi.py", *(a for a in sys.argv[1:] if a != PRIVATE)]),
        "runs": runs,
        "podman": podman_version,
        "host": "simulated, 8 GPUs (GPU 1 in MIG mode); each case `podman run --rm --runtime runc ... true`",
        "load_average_1_5_15": {"before_rounds": loads[0], "after_rounds": loads[1]},
        "how": "each case in every round, in a new seeded order per round, after a warm-up round; x_plain and "
        "added_to_plain_ms: the medians of the per-round ratios and differences to plain podman run",
        "cases": figures,
        # The createContainer hook of our spec: against the same spec without it, in the same round.
        "cdi_hook_ms": statistics.median(hook),
        "cdi_hook_ms_quartiles": statistics.quantiles(hook, n=4),
        "cdi_hook_share_of_added": statistics.median(hook) / figures["cdi"]["added_to_plain_ms"],
        "served_starts": served,
        "nvidia_ctk": NVIDIA_CTK,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cdi-runs", type=int, default=10, help="rounds kept (a podman run takes ~0.2 s)")
    parser.add_argument("--output", default=os.path.join(HERE, "results.json"))
    parser.add_argument(PRIVATE, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/cdi.py needs root (podman, runc, a mount namespace)")
    for tool in ("podman", "runc", "unshare"):
        if not shutil.which(tool):
            raise SystemExit(f"bench/cdi.py needs {tool}")
    if not args.in_private_namespace:
        argv = ["unshare", "--mount", "--propagation", "private", sys.executable, os.path.abspath(__file__)]
        os.execvp("unshare", argv + sys.argv[1:] + [PRIVATE])
    # Everything on a tmpfs of the bench's own, as bench/run.py does (and the overlay's upper layer).
    work = tempfile.mkdtemp(prefix="oci-gpu-hook-bench-cdi-", dir=run.WORK_PARENT)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "oci-gpu-hook-bench-cdi", work], check=True)
    try:
        in_private_namespace(work)
        try:
            figures = measure(work, args.cdi_runs)
        finally:
            subprocess.run(["umount", "--lazy", "/etc"], check=True)
    finally:
        subprocess.run(["umount", "--lazy", work], check=True)
        os.rmdir(work)
        leftovers.remove_compiled_settings(leftovers.RUN_DIR, work)  # what the hooks kept of the bench's config
    results.save_part(args.output, "cdi", figures)
    loads = figures["load_average_1_5_15"]
    print(f"podman {figures['podman']}, {args.cdi_runs} paired rounds; load average "
          f"{loads['before_rounds'][0]:.2f} before the rounds, {loads['after_rounds'][0]:.2f} after")  # fmt: skip
    print(f"{'case':16} {'median ms':>10} {'p95 ms':>8} {'x plain':>8} {'added ms':>9}  what")
    for name, r in figures["cases"].items():
        print(f"{name:16} {r['median_ms']:10.1f} {r['p95_ms']:8.1f} {r['x_plain']:8.3f} "
              f"{r['added_to_plain_ms']:+9.1f}  {r['what']}")  # fmt: skip
    q1, _, q3 = figures["cdi_hook_ms_quartiles"]
    print(f"our spec's createContainer hook (cdi against cdi-no-hook, paired): {figures['cdi_hook_ms']:+.1f} ms "
          f"(quartiles {q1:+.1f}, {q3:+.1f}), {figures['cdi_hook_share_of_added']:.0%} of what the spec adds to "
          "plain podman run")  # fmt: skip
    print(f"nvidia-ctk's spec: not measured: {NVIDIA_CTK['why']}")
    print(f"wrote the cdi part to {args.output}")


if __name__ == "__main__":
    main()
