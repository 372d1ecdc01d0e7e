"""A real node in a VM (issues 38 and 50): systemd as PID 1, unified cgroup2 and SELinux enforcing,
which no machine here has. The harness boots a cached Debian 12 base image under qemu (TCG: this
machine's /dev/kvm is a nested PVM that cannot run a stock kernel) with this checkout as a payload
on a second disk, runs named scenarios in one boot, and brings back their results and the audit
log. The image comes in two policy flavours (FLAVOURS; tests/vm/build-base.sh): debian
(refpolicy `default`, $SEVM/base) and rhel (Fedora's targeted policy with container-selinux,
$SEVM/base-rhel); each is booted once per session. tests/e2e/test_node_vm.py has a test per
scenario and flavour.

How to add a scenario
---------------------
Write tests/vm/scenarios/NAME.sh (NAME: lower case, digits, underscores). That is all: the next
boot runs it and tests/e2e/test_node_vm.py gets a test_scenario[NAME]. The file is bash, sourced
after tests/vm/lib.sh (read it: $SIM, $HOOK, run, fail, expect, gpu_run), as root in
unconfined_t (an administrator's shell; Debian's policy confines runc when started from a
service), with SELinux enforcing. Its first lines say what it proves and its time limit:

    # proves: gpu_container_t gets its GPU under enforcing; container_t none
    # timeout: 300

A scenario that means something on one policy alone says which (`# flavours: rhel`); without that
line it runs on both, and $FLAVOUR (lib.sh) tells it where it runs. It passes when it exits 0;
`fail MESSAGE` ends it. Its output, its exit status, its time and
the AVC/SELINUX_ERR records logged while it ran are brought back; a failing test shows them and
the serial console's tail. A scenario may also assert that it caused no denial: `no_denials`
(lib.sh) fails on any logged since it started. Scenarios run in name order, after the common
set-up (tests/vm/setup.sh: the package installed as a user does, the SELinux module loaded with
`semodule -i`, `oci-gpu-hook install --runtime podman`, the busybox image imported), in the same
boot: leave the node as you found it (remove containers, restore policies and files you changed).
Test it alone: VMCHECK_SCENARIOS=NAME[,NAME] pytest tests/e2e/test_node_vm.py (the boot still
runs the set-up); while writing one, VMCHECK_SCENARIOS=/path/to/NAME.sh runs it from there. A
scenario that needs the shared CRI-O or kubelet in the VM says so (`# needs: crio kubelet`): their
programs then come in the payload's bin/ (and CRI-O's pause image as pause.tar). One that needs
the node image (`# needs: image`) finds its root, unpacked, at $P/node-image, and its archive at
$P/node-image.tar. One that needs a cluster (`# needs: kube`) finds the shared Kubernetes build's
programs in $P/bin/kube and what starts them as tests/kubecheck.py does in $P/cluster (_cluster()).

The pieces
----------
- tests/vm/build-base.sh: the base images (packages, the flavour's policy, a boot unit that runs
  the payload), cached in $SEVM (default /var/cache/oci-gpu-hook-node-vm)/base and base-rhel;
  about 10 minutes, and 5 more for rhel, once per machine, in the background of `make test`
  (tests/toolbuild.py). Nothing of the checkout is in them, so no project change rebuilds them.
- payload(): the checkout's files (git ls-files: tracked and untracked-not-ignored), wheels of the
  package and its dependencies (the VM has no network; dependency wheels cached in $SEVM/wheels),
  two simulated GPU hosts built at host speed (driver 550.54.15 and, for a driver update,
  560.35.03), the busybox image, tests/vm/*.sh and the scenarios. A tar, used as a raw disk.
- boot(): qemu with the base image (snapshot=on: each boot starts from the same image), the
  payload (vdb) and an empty results disk (vdc); the guest writes its results there as a tar.

Every boot first runs tests/vm/selfcheck.sh, which fails on purpose with a denial: the harness's
own test (test_the_harness_reports_a_failing_scenario_with_its_denials) checks that a failure,
its output and its denial come back.

Time (2 cores, shared with other work, TCG): the base image 185 s once per machine; then per
session the payload 5-20 s, boot to the guest 35-70 s, the set-up 145-280 s (a venv 40 s,
`semodule -i` 40-85 s), a GPU `podman run` 4-8 s, the whole boot 6-11 minutes; the rhel
flavour's set-up 126-164 s (the RPM's `semodule` relinks 422 modules) and its whole boot 17 minutes.
On rhel the payload also carries the oci-gpu-hook-selinux RPM (`make rpm SELINUX_HEADERS=`: the
module compiled against RHEL's policy headers, ../shared/tools/selinux-rhel).

In the background of `make test`
--------------------------------
The boot touches nothing of the host's mount table, cgroups or /dev, so `make test` starts it at
once (`python3 tests/vmcheck.py --for-pid MAKE'S_PID build/node-vm.json`), beside the other suites,
instead of when pytest reaches tests/e2e/test_node_vm.py. That process boots each flavour in turn
and writes each run (or why there is none) to the flavour's file (build/node-vm.json for debian,
build/node-vm-rhel.json for rhel: result_of()), holding FILE.lock while it works, and stops qemu if
make is gone (an interrupted `make test`). pytest, told the file by VMCHECK_BOOTED, waits for it
(booted()) and its tests read that run as they would their own boot's. Without VMCHECK_BOOTED (pytest
run by hand) the session boots when its first test asks, as before.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback

import toolbuild

from oci_gpu_hook.start.digits import decimal

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VM_DIR = os.path.join(REPO, "tests", "vm")
SCENARIO_DIR = os.path.join(VM_DIR, "scenarios")
SELFCHECK = os.path.join(VM_DIR, "selfcheck.sh")
NAME = re.compile(r"^[a-z0-9_]+$")
SIM_VERSIONS = {"gpuhost.tar": "550.54.15", "gpuhost-next.tar": "560.35.03"}
# the base image's policy flavours (tests/vm/build-base.sh), in the order `make test` boots them;
# VMCHECK_FLAVOURS (a comma list) narrows them
FLAVOURS = ("debian", "rhel")
BASE_TOOLS = {"debian": ("node-vm", "base"), "rhel": ("node-vm-rhel", "base-rhel")}
# seconds, the whole boot: a hang guard, never a speed check (the rhel boot, with a cluster in its
# toolkit_daemonset, took 1760 s in a whole `make test`)
BOOT_TIMEOUT = 4200
KEEP_RUNS = 4  # two sessions' boots, of both flavours
BOOTED = "VMCHECK_BOOTED"  # the result file of a boot started in the background (make test)
# seconds a session waits for the background boot's result: the tools it may wait on first (the
# base image, CRI-O, the kubelet, built by tests/toolbuild.py meanwhile), then the boot; a hang guard
BACKGROUND_WAIT = BOOT_TIMEOUT + 2 * toolbuild.WAIT_FOR_OTHERS
# seconds for its lock to appear: the background boot takes it as it starts, long before pytest
# reaches the node VM's tests, so a lock missing then is a boot that never started
BACKGROUND_START = 60


class VmError(Exception):
    """The VM did not boot, or brought nothing back: the message says what is known."""


def cache() -> str:
    return toolbuild.cache("node-vm")


def flavours() -> list:
    """The flavours a session boots: FLAVOURS, or those VMCHECK_FLAVOURS names; where
    VMCHECK_SCENARIOS narrows the scenarios, only the flavours that run one of them."""
    wanted = [f for f in os.environ.get("VMCHECK_FLAVOURS", "").split(",") if f]
    unknown = sorted(set(wanted) - set(FLAVOURS))
    assert not unknown, f"VMCHECK_FLAVOURS: no flavour {unknown} (there are {FLAVOURS})"
    chosen = [f for f in FLAVOURS if f in wanted] if wanted else list(FLAVOURS)
    if os.environ.get("VMCHECK_SCENARIOS"):
        chosen = [f for f in chosen if scenarios(f)]
    return chosen


def base(flavour: str = "debian") -> dict:
    """The flavour's base image files. The build script runs every time, under the build's lock
    (waiting for a build in progress): its stamps make it a no-op unless its recipe changed."""
    tool, folder = BASE_TOOLS[flavour]
    done = toolbuild.build(tool)
    if done.returncode != 0:
        raise VmError(f"the {flavour} base image build failed ({done.returncode}):\n"
                      f"{done.stdout[-2000:]}{done.stderr[-3000:]}")  # fmt: skip
    out = os.path.join(cache(), folder)
    return {name: os.path.join(out, name) for name in ("rootfs.img", "vmlinuz", "initrd.img")}


def scenarios(flavour: str | None = None) -> list:
    """The scenario names, in the order a boot runs them; with flavour, those that run on it (a
    scenario's `# flavours:` line names them; without one it runs on all). VMCHECK_SCENARIOS (a
    comma list) narrows them; an entry that is a path to a .sh file adds a scenario from outside
    tests/vm/scenarios (one being written)."""
    names = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(SCENARIO_DIR, "*.sh")))
    wanted = [n for n in os.environ.get("VMCHECK_SCENARIOS", "").split(",") if n]
    for entry in wanted:
        if entry.endswith(".sh"):
            _OUTSIDE[os.path.basename(entry)[:-3]] = os.path.abspath(entry)
    bad = [n for n in names + list(_OUTSIDE) if not NAME.match(n)]
    assert not bad, f"scenario names must be lower case, digits and underscores: {bad}"
    if wanted:
        names = [n for n in names if n in wanted] + sorted(_OUTSIDE)
    if flavour:
        names = [n for n in names if flavour in _flavours_of(n)]
    return names


def _flavours_of(name: str) -> tuple:
    """The flavours a scenario runs on: its `# flavours:` line, else all."""
    named = _header(path(name), "flavours")
    unknown = sorted(set(named) - set(FLAVOURS))
    assert not unknown, f"{path(name)}: no flavour {unknown} (there are {FLAVOURS})"
    return tuple(named) or FLAVOURS


_OUTSIDE: dict = {}  # name: path, of the scenarios VMCHECK_SCENARIOS names by path


def path(name: str) -> str:
    """The scenario's file."""
    if name == "selfcheck":
        return SELFCHECK
    return _OUTSIDE.get(name) or os.path.join(SCENARIO_DIR, name + ".sh")


def _header(file: str, key: str) -> list:
    """The words of a scenario's `# KEY:` line ([] when it has none)."""
    with open(file) as f:
        for line in f:
            if line.startswith(f"# {key}:"):
                return line.split(":", 1)[1].split()
    return []


def proves(name: str) -> str:
    """What the scenario says it proves (its `# proves:` line)."""
    return " ".join(_header(path(name), "proves"))


def needs(name: str) -> list:
    """What the scenario needs in the VM (its `# needs:` line): shared tools (crio, kubelet), and
    `image`, the node image's root at $P/node-image (deploy/build-image.py)."""
    return _header(path(name), "needs")


# tool: the programs of it a scenario gets in the payload's bin/ (what toolbuild.build prints: a
# directory holding them, or the program itself)
TOOL_PROGRAMS = {"crio": ("crio", "pinns", "crictl"), "kubelet": ("kubelet",),
                 "kube": ("kcp-etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl",
                          "kubelet")}  # fmt: skip
# where a tool's programs go in the payload: bin/, or a directory of their own (kube's kubelet is
# not the kubelet tool's)
TOOL_DIRECTORY = {"kube": "bin/kube"}


def _made(tool: str) -> str:
    """What the tool's build made (the last line it printed: a program, or a directory)."""
    done = toolbuild.build(tool)
    made = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else ""
    if not made:
        raise VmError(f"{tool}: its build failed ({done.returncode}): {done.stderr[-2000:]}")
    return made


def _tool_programs(tool: str, into: str) -> None:
    made = _made(tool)
    if os.path.isfile(made) and len(TOOL_PROGRAMS[tool]) > 1:  # it printed each program's path
        made = os.path.dirname(made)
    os.makedirs(into, exist_ok=True)
    for program in TOOL_PROGRAMS[tool]:
        source = os.path.join(made, program) if os.path.isdir(made) else made
        shutil.copy(source, os.path.join(into, program))


CLUSTER_NODE = "vmcheck"  # the VM's host name: its kubelet's Node
CLUSTER_PKI = "/opt/vmcheck/cluster/pki"  # where the guest finds the payload's cluster/pki (lib.sh's $P)


def _cluster(into: str) -> None:
    """A one-node cluster's makings for the guest, as tests/kubecheck.py runs one here (`# needs:
    kube`): pki/ (certificates() and the kubeconfigs, naming the files where the guest mounts
    them), control-plane (a line per component in start order: its name, a tab, its command line
    quoted for the shell, the programs in /usr/local/bin), kubelet.json (its KubeletConfiguration:
    CRI-O, the systemd cgroup driver) and manifests.yaml (deploy/kubernetes/ with what names the
    simulated host at /srv/gpuhost changed, kubecheck.node_manifests, the node's own paths)."""
    import shlex

    import kubecheck
    import yaml

    pki = os.path.join(into, "pki")
    os.makedirs(pki)
    kubeconfigs = kubecheck.certificates(pki, CLUSTER_NODE, seen_at=CLUSTER_PKI)
    programs = {name: f"/usr/local/bin/{name}" for name in TOOL_PROGRAMS["kube"]}
    commands = kubecheck.control_plane_commands(programs, CLUSTER_PKI, kubeconfigs, "/var/lib/vmcheck-kube")
    with open(os.path.join(into, "control-plane"), "w") as f:
        f.write("".join(f"{name}\t{shlex.join(argv)}\n" for name, argv in commands.items()))
    config = kubecheck.kubelet_configuration("unix:///var/run/crio/crio.sock", CLUSTER_PKI, "systemd")
    with open(os.path.join(into, "kubelet.json"), "w") as f:
        json.dump(config, f)
    docs = kubecheck.node_manifests({"root": "/srv/gpuhost"}, None, None, None, {},
                                    keep_node_selectors=True, keep_propagation=True, moved=False)  # fmt: skip
    with open(os.path.join(into, "manifests.yaml"), "w") as f:
        yaml.safe_dump_all(docs, f)


def _sh(*args, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, stdin=subprocess.DEVNULL, **kwargs)
    if done.returncode != 0:
        raise VmError(f"{' '.join(args)}: exit {done.returncode}: {done.stderr[-2000:]}")
    return done


def _checkout_files() -> list:
    out = _sh("git", "-C", REPO, "ls-files", "-z", "-co", "--exclude-standard").stdout
    return [p for p in out.split("\0") if p and os.path.lexists(os.path.join(REPO, p))]


def _python() -> str:
    """The checkout's venv's interpreter (`make setup` makes it, with pip; Debian's python3 may
    have no pip): the same Python 3.11 as the VM's, so its wheels fit there."""
    python = os.path.join(REPO, ".venv", "bin", "python")
    return python if os.path.exists(python) else "python3"


def _wheels(src: str, into: str) -> None:
    """Wheels of the package (from the payload's copy of the checkout) and of its dependencies.
    The dependencies' wheels are kept in $SEVM/wheels: offline from there when they suffice, else
    pip fetches (as `make setup` does)."""
    kept = os.path.join(cache(), "wheels")
    os.makedirs(kept, exist_ok=True)
    with open(os.path.join(kept, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        base = [_python(), "-m", "pip", "wheel", "-q", "-w", kept, "--find-links", kept, f"{src}[kubernetes]",
                "setuptools>=77"]  # fmt: skip
        offline = subprocess.run([*base, "--no-index"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if offline.returncode != 0:
            _sh(*base)
        os.makedirs(into, exist_ok=True)
        for wheel in glob.glob(os.path.join(kept, "*.whl")):
            if not os.path.basename(wheel).startswith("oci_gpu_hook-"):
                shutil.copy(wheel, into)
        # the package's own wheel: this checkout's, never a kept one
        for old in glob.glob(os.path.join(kept, "oci_gpu_hook-*.whl")):
            os.unlink(old)
        _sh(_python(), "-m", "pip", "wheel", "-q", "--no-deps", "--no-index", "--find-links", into, "-w", into, src)


def _simulated_host(tar_path: str, version: str) -> None:
    """A simulated GPU host at /srv/gpuhost (the path the guest unpacks it to), built in a private
    mount namespace on a tmpfs there: the host's /srv is never touched."""
    python = _python()
    script = ('mount -t tmpfs vmcheck /srv && "$0" -m oci_gpu_hook simulate /srv/gpuhost --gpus 2 '
              '--driver-version "$1" >/dev/null && tar -C /srv --warning=no-file-ignored -cf "$2" gpuhost')  # fmt: skip
    _sh("unshare", "-m", "--propagation", "private", "sh", "-c", script, python, version, tar_path, cwd=REPO)


def _selinux_rpm(directory: str, into: str) -> None:
    """The oci-gpu-hook-selinux RPM as `make rpm` builds it, its module compiled against RHEL's
    policy headers (../shared/tools/selinux-rhel, cached by toolbuild), for the rhel flavour."""
    headers = _made("selinux-rhel")
    topdir = os.path.join(directory, "rpmbuild")
    _sh("make", "-s", "rpm", f"RPM_TOPDIR={topdir}", f"SELINUX_HEADERS={headers}", cwd=REPO)
    made = glob.glob(os.path.join(topdir, "RPMS", "noarch", "oci-gpu-hook-selinux-*.rpm"))
    if len(made) != 1:
        raise VmError(f"make rpm made {len(made)} oci-gpu-hook-selinux packages, not one: {made}")
    os.makedirs(into)
    shutil.copy(made[0], into)
    shutil.rmtree(topdir)


def _node_image(directory: str, into: str) -> None:
    """The node image's root, as `make image SELINUX_HEADERS=` builds it on this machine (its
    bundle carries the SELinux module for both policy families), unpacked (owners kept): a
    scenario chroots into it to run the toolkit as the node pod would; and its archive beside it
    (INTO.tar)."""
    import imagecheck

    archive = os.path.join(directory, "node-image.tar")
    headers = _made("selinux-rhel")
    _sh(sys.executable, os.path.join(REPO, "deploy", "build-image.py"), "--output", archive, "--selinux-headers",
        headers, cwd=REPO)  # fmt: skip
    with imagecheck.layer(archive) as layer:
        layer.extractall(into)
    os.makedirs(os.path.join(into, "host"), exist_ok=True)  # where the node pod mounts the host's root
    os.rename(archive, into + ".tar")  # for `podman load`: the image CRI-O runs the DaemonSets from


def payload(directory: str, names, flavour: str = "debian") -> str:
    """The payload tar for a boot of the flavour's image that runs the scenarios names (in that
    order), built in directory; returns its path."""
    stage = os.path.join(directory, "payload")
    os.makedirs(os.path.join(stage, "src"))
    listing = os.path.join(directory, "files")
    with open(listing, "w") as f:
        f.write("".join(p + "\0" for p in _checkout_files()))
    _sh("tar", "-C", REPO, "--null", "--no-recursion", "-T", listing, "-cf", listing + ".tar")
    _sh("tar", "-C", os.path.join(stage, "src"), "-xf", listing + ".tar")
    os.unlink(listing + ".tar")
    _wheels(os.path.join(stage, "src"), os.path.join(stage, "wheels"))
    for tar_name, version in SIM_VERSIONS.items():
        _simulated_host(os.path.join(stage, tar_name), version)
    from oci_gpu_hook.toolkit.containers import make_rootfs

    make_rootfs(os.path.join(directory, "gpubox"), debian=True)
    _sh("tar", "-C", os.path.join(directory, "gpubox"), "-cf", os.path.join(stage, "gpubox.tar"), ".")
    tools = sorted({tool for name in names for tool in needs(name)})
    for tool in tools:
        if tool == "image":
            _node_image(directory, os.path.join(stage, "node-image"))
        else:
            _tool_programs(tool, os.path.join(stage, TOOL_DIRECTORY.get(tool, "bin")))
        if tool == "kube":
            _cluster(os.path.join(stage, "cluster"))
    if "crio" in tools:
        # CRI-O's pause image: the busybox image with a /pause that sleeps (no registry in the VM)
        with open(os.path.join(directory, "gpubox", "pause"), "w") as f:
            f.write("#!/bin/sh\nexec /bin/busybox sleep 1000000000\n")
        os.chmod(os.path.join(directory, "gpubox", "pause"), 0o755)
        _sh("tar", "-C", os.path.join(directory, "gpubox"), "-cf", os.path.join(stage, "pause.tar"), ".")
    if flavour == "rhel":
        _selinux_rpm(directory, os.path.join(stage, "rpms"))
    for name in ("guest.sh", "lib.sh", "setup.sh"):
        shutil.copy(os.path.join(VM_DIR, name), stage)
    os.makedirs(os.path.join(stage, "scenarios"))
    for name in names:
        shutil.copy(path(name), os.path.join(stage, "scenarios", name + ".sh"))
    with open(os.path.join(stage, "scenarios.list"), "w") as f:
        f.write("".join(n + "\n" for n in names))
    out = os.path.join(directory, "payload.tar")
    _sh("tar", "-C", stage, "-cf", out, ".")
    shutil.rmtree(stage)
    return out


class Step:
    """One step's results: rc (None: it never ran), output, avc (the denial records), seconds."""

    def __init__(self, directory: str):
        def read(name, default=""):
            try:
                with open(os.path.join(directory, name), errors="replace") as f:
                    return f.read()
            except OSError:
                return default

        self.rc = decimal(read("rc").strip())  # an exit status, 0-255
        self.output, self.avc = read("output.log"), read("avc.log")
        seconds = read("seconds").strip()
        self.seconds = float(seconds) if seconds else None


class Run:
    """A finished boot: its serial log and results directory (unpacked from the results disk)."""

    def __init__(self, directory: str, names, qemu_rc: int, wall: float):
        self.directory, self.names, self.qemu_rc, self.wall = directory, list(names), qemu_rc, wall
        self.serial = os.path.join(directory, "serial.log")
        self.results = os.path.join(directory, "results")

    def serial_tail(self, lines: int = 60) -> str:
        with open(self.serial, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def setup(self) -> Step:
        return Step(os.path.join(self.results, "setup"))

    def step(self, name: str) -> Step:
        return Step(os.path.join(self.results, "scenarios", name))

    def report(self, title: str, step: Step) -> str:
        """What a failure shows: the step's output tail, its denials, the serial console's tail."""
        return (
            f"{title} (exit {step.rc}, {step.seconds} s; everything in {self.directory})\n"
            f"--- output (tail):\n{step.output[-6000:]}\n"
            f"--- SELinux denials while it ran ({len(step.avc.splitlines())}):\n{step.avc[-4000:] or '(none)'}\n"
            f"--- serial console (tail):\n{self.serial_tail()}"
        )

    def failure(self, name: str) -> str | None:
        """None when the scenario passed, else the report of why not."""
        setup = self.setup()
        if setup.rc != 0:
            return self.report("the VM's set-up failed, so no scenario ran", setup)
        step = self.step(name)
        if step.rc is None:
            return self.report(f"scenario {name} did not finish (no result came back)", step)
        if step.rc != 0:
            return self.report(f"scenario {name} failed: it was to prove: {proves(name)}", step)
        return None


def boot(names, flavour: str = "debian", timeout: int = BOOT_TIMEOUT, memory: int = 4096,
         abandoned=lambda: False) -> Run:  # fmt: skip
    """Boot the flavour's base image once with this checkout and run the scenarios names in it.
    abandoned(): asked every few seconds while qemu runs; True stops it (no one waits for the run
    any more)."""
    images = base(flavour)
    runs = os.path.join(cache(), "runs")
    os.makedirs(runs, exist_ok=True)
    # the newest KEEP_RUNS stay for a look; older ones go, unless a boot may still be using them
    for old in sorted(glob.glob(os.path.join(runs, "*")))[:-KEEP_RUNS]:
        if time.time() - os.path.getmtime(old) > BOOT_TIMEOUT + 600:
            shutil.rmtree(old, ignore_errors=True)
    stamp = time.strftime("%Y%m%d-%H%M%S-") + hashlib.sha1(os.urandom(8)).hexdigest()[:6]
    directory = os.path.join(runs, f"{stamp}-{flavour}")
    os.makedirs(directory)
    disk = payload(directory, names, flavour)
    results = os.path.join(directory, "results.img")
    with open(results, "wb") as f:
        f.truncate(256 << 20)
    serial = os.path.join(directory, "serial.log")
    append = ("root=/dev/vda rw console=ttyS0 security=selinux selinux=1 enforcing=1 panic=-1 "
              "systemd.show_status=false")  # fmt: skip
    qemu = ["qemu-system-x86_64", "-accel", "tcg,thread=multi", "-cpu", "max", "-smp", "2", "-m", str(memory),
            "-nographic", "-no-reboot", "-kernel", images["vmlinuz"], "-initrd", images["initrd.img"],
            "-append", append,
            "-drive", f"file={images['rootfs.img']},format=raw,if=virtio,snapshot=on",
            "-drive", f"file={disk},format=raw,if=virtio,readonly=on",
            "-drive", f"file={results},format=raw,if=virtio",
            "-nic", "none"]  # fmt: skip
    started = time.monotonic()
    with open(serial, "wb") as log:
        # TMPDIR: qemu's snapshot overlay goes beside the run, not into /tmp
        proc = subprocess.Popen(["nice", "-n", "10", *qemu], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env={**os.environ, "TMPDIR": directory})  # fmt: skip
        deadline = started + timeout
        while True:
            try:
                rc = proc.wait(5)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() < deadline and not abandoned():
                    continue
                proc.kill()
                proc.wait()
                rc = -9
                break
    if rc == -9 and abandoned():
        os.unlink(results)
        os.unlink(disk)
        raise VmError("stopped: the make that started this boot is gone")
    run = Run(directory, names, rc, time.monotonic() - started)
    os.makedirs(run.results)
    unpacked = subprocess.run(["tar", "-xf", results, "-C", run.results], capture_output=True, text=True)
    os.unlink(results)
    os.unlink(disk)
    if unpacked.returncode != 0:
        raise VmError(
            f"the VM brought no results back (qemu exit {rc}, {run.wall:.0f} s; timeout {timeout} s): "
            f"it did not boot or the guest did not finish. Serial console ({serial}), tail:\n{run.serial_tail()}"
        )
    return run


_SESSION: dict = {}


def session_run(flavour: str = "debian") -> Run:
    """One boot of each flavour per pytest session, with the harness's self-check first and every
    scenario of the flavour: the one `make test` started in the background when VMCHECK_BOOTED
    names its result file, else one of the session's own. A boot that failed is not tried again:
    every test of that flavour reports the same failure."""
    if flavour not in _SESSION:
        names = ["selfcheck", *scenarios(flavour)]
        try:
            if os.environ.get(BOOTED):
                _SESSION[flavour] = booted(result_of(os.environ[BOOTED], flavour), names, flavour=flavour)
            else:
                _SESSION[flavour] = boot(names, flavour)
        except VmError as e:
            _SESSION[flavour] = e
    if isinstance(_SESSION[flavour], VmError):
        raise _SESSION[flavour]
    return _SESSION[flavour]


def result_of(result: str, flavour: str) -> str:
    """The result file of the flavour's background boot: RESULT's name with the flavour in it
    (build/node-vm.json: build/node-vm-rhel.json), RESULT itself for debian."""
    if flavour == FLAVOURS[0]:
        return result
    stem, extension = os.path.splitext(result)
    return f"{stem}-{flavour}{extension}"


def _log_of(result: str) -> str:
    """The background boots' log (make test's build/node-vm.log), from any flavour's result file."""
    stem = os.path.splitext(result)[0]
    for flavour in FLAVOURS[1:]:  # result_of: the first flavour's file has no suffix
        if stem.endswith("-" + flavour):
            stem = stem[: -len(flavour) - 1]
    return stem + ".log"


def booted(result: str, names, wait: float = BACKGROUND_WAIT, flavour: str = "debian") -> Run:
    """The run of the background boot whose result file is result, once it has finished (its lock
    free). A boot of other scenarios than names (VMCHECK_SCENARIOS changed since) is not this
    session's: it boots its own."""
    lock_path = result + ".lock"
    started = time.monotonic()
    while not os.path.exists(lock_path):  # made, already locked, as the background boot starts
        if time.monotonic() > started + min(wait, BACKGROUND_START):
            raise VmError(f"no background boot started: {lock_path} is missing (its log: {_log_of(result)})")
        time.sleep(1)
    deadline = started + wait
    with open(lock_path) as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise VmError(f"the background boot did not finish within {wait:.0f} s "
                                  f"(its log: {_log_of(result)})") from None  # fmt: skip
                time.sleep(2)
    try:
        with open(result) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise VmError(f"the background boot ended without a result ({e}); its log: {_log_of(result)}") from None
    if doc.get("names") != list(names):
        return boot(names, flavour)
    if "error" in doc:
        raise VmError(doc["error"])
    return Run(doc["directory"], names, doc["qemu_rc"], doc["wall"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main(argv) -> int:
    """The background boots: one of each flavour (VMCHECK_FLAVOURS narrows them), in turn, with
    every scenario of it (VMCHECK_SCENARIOS narrows them, as for pytest); each writes its run, or
    why there is none, to its result file (result_of(RESULT, flavour)); booted() reads it. A
    flavour's result is there as soon as its boot ended, so a session's tests of the first
    flavour need not wait for the second's boot."""
    parser = argparse.ArgumentParser(prog="vmcheck.py", description=main.__doc__)
    parser.add_argument("result", help="the JSON file to write the run to (its lock beside it, RESULT.lock)")
    parser.add_argument("--for-pid", type=int, help="stop qemu if this process (make) ends first")
    args = parser.parse_args(argv)
    result = os.path.abspath(args.result)
    os.makedirs(os.path.dirname(result), exist_ok=True)
    # Every lock file appears already locked, all of them before the first boot: a session that
    # finds one unlocked finds its result too.
    locks = {}
    for flavour in flavours():
        made = f"{result_of(result, flavour)}.lock.{os.getpid()}"
        locks[flavour] = open(made, "w")
        fcntl.flock(locks[flavour], fcntl.LOCK_EX)
        os.rename(made, result_of(result, flavour) + ".lock")
    gone = lambda: args.for_pid is not None and not _alive(args.for_pid)  # noqa: E731
    for flavour, lock in locks.items():
        names = ["selfcheck", *scenarios(flavour)]
        started = time.monotonic()
        try:
            if gone():
                raise VmError("stopped: the make that started this boot is gone")
            run = boot(names, flavour, abandoned=gone)
            doc = {"names": names, "directory": run.directory, "qemu_rc": run.qemu_rc, "wall": run.wall}
        except VmError as e:
            doc = {"names": names, "error": str(e)}
        except Exception:  # a session must hear of any failure, never find no result
            doc = {"names": names, "error": f"the background boot failed:\n{traceback.format_exc()}"}
        out = result_of(result, flavour)
        with open(out + ".tmp", "w") as f:
            json.dump(doc, f)
        os.rename(out + ".tmp", out)
        took = time.monotonic() - started
        print(f"vmcheck: {flavour}: {doc.get('error') or 'booted, results in ' + doc['directory']} ({took:.0f} s)",
              flush=True)  # fmt: skip
        lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
