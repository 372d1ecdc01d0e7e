"""What "nothing escaped and nothing leaked" means, shared by tests/security and tests/reliability.

Every check compares two Observations taken around one run of the hook against a live container
(tests/conftest.py `live_container`): the container's mounts (its own mount namespace), its rootfs
tree, its device cgroup, the host's mounts, a canary tree on the host that hostile links point at,
the simulated host's files and a few real host directories a hook that followed a link to '/'
would write into. Importable from any test (pytest puts tests/ on sys.path for its conftest.py).

Also what the suite and the bench share for running containers and reading what they saw: a
process holding a mount namespace (hold_namespace), a detached runc container (runc_detached), a
CDI spec where podman reads it (cdi_spec_in_etc), the UUIDs `nvidia-smi -L` printed (listed_uuids).
The hook and the CLI run as containers.hook_command() gives them: this interpreter, this checkout.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time

from oci_gpu_hook.toolkit.containers import hook_command

HOOK_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}  # what hooks.d gives the hook


def checkout_command() -> list:
    """This interpreter and this checkout's program, isolated: the checkout is put on the path by
    the command itself, as a launcher does (launcher.py). -I leaves the working directory out, and
    a checkout the interpreter has no install of (a locked clone's, tests/test_checkout_location.py)
    would not be found by `-m oci_gpu_hook` (hook_command's)."""
    from oci_gpu_hook.toolkit import launcher

    return [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {launcher.package_parent()!r}); "
            "from oci_gpu_hook.hook import main; sys.exit(main())"]  # fmt: skip


# Real host directories a hook that followed a hostile link to '/' (or to '../../..') would touch.
HOST_WATCH = (
    "/",
    "/usr",
    "/usr/lib64",
    "/usr/lib",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/bin",
    "/usr/sbin",
    "/dev",
    "/etc",
    "/etc/ld.so.conf.d",
    "/etc/vulkan",
    "/lib/firmware",
    "/var/run/nvidia-persistenced",
    "/proc/driver/nvidia",
)

# The hook's own log, inventory cache and journal directory (empty between applies) are the host
# files it is meant to write.
# The hook's own bookkeeping in the simulated host's directory; containers/ holds the records of
# GPU starts (container_record.py), failed ones included, so only its name is compared.
HOOK_OWN_FILES = ("hook.log", "inventory-cache.json", "pending", "containers")


def run_hook(config: str, state, env=None, timeout: float = 60, preexec_fn=None) -> subprocess.CompletedProcess:
    """The hook as a runtime runs it: the real entry point, state on stdin, a fixed environment."""
    data = state.encode() if isinstance(state, str) else state
    return subprocess.run(
        [*hook_command(config), "prestart"],
        input=data, capture_output=True, env=HOOK_ENV if env is None else env, timeout=timeout,
        preexec_fn=preexec_fn,
    )  # fmt: skip


class Result:
    """A hook run's outcome, the same whether it ran in a subprocess or in-process."""

    def __init__(self, returncode: int, stderr: str):
        self.returncode = returncode
        self.stderr = stderr


def run_hook_in_process(config: str, state: str, capsys) -> Result:
    """hook.main in this process (the apply child is forked from it), for tests that patch the
    hook's modules (e.g. the O_NOFOLLOW walk instead of openat2)."""
    from oci_gpu_hook import hook

    class _Stdin:
        buffer = io.BytesIO(state.encode())

    saved = sys.stdin
    sys.stdin = _Stdin()
    capsys.readouterr()
    try:
        code = hook.main(["--config", config, "prestart"])
    finally:
        sys.stdin = saved
    return Result(code, capsys.readouterr().err)


def one_clear_line(stderr) -> str:
    """The single 'oci-gpu-hook: ...' line a failure must produce (no traceback, no internal error)."""
    text = stderr.decode("utf-8", "replace") if isinstance(stderr, bytes) else stderr
    lines = text.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {text[:2000]!r}"
    assert lines[0].startswith("oci-gpu-hook: "), lines[0]
    assert "internal error" not in lines[0] and "Traceback" not in text, lines[0]
    assert len(lines[0]) < 2000, f"an unbounded error line ({len(lines[0])} characters)"
    return lines[0]


def listed_uuids(text: str, kinds=("GPU", "MIG")) -> list:
    """The UUIDs `nvidia-smi -L` printed in text, in its order: those of GPUs and MIG devices, or
    of the kinds named ("GPU" alone leaves out a MIG-enabled GPU's MIG devices)."""
    return re.findall(rf"UUID: ((?:{'|'.join(kinds)})-[0-9a-f-]+)\)", text)


# --- observations -------------------------------------------------------------------------------


def command_lines() -> dict:
    """{pid: argv as bytes} of every process now (one that exits meanwhile is left out)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().split(b"\0")
        except OSError:
            continue  # gone meanwhile
    return found


def mountinfo(pid="self") -> list[tuple[str, str, str]]:
    """(mount point, root within its filesystem, filesystem type) of every mount pid sees."""
    with open(f"/proc/{pid}/mountinfo") as f:
        lines = f.read().splitlines()
    mounts = []
    for line in lines:
        fields = line.split()
        post = line.split(" - ", 1)[1].split()
        mounts.append((unescape(fields[4]), unescape(fields[3]), post[0]))
    return sorted(mounts)


def unescape(field: str) -> str:
    from oci_gpu_hook.start.linux import mountinfo  # the package's one mountinfo unescape

    return mountinfo.unescape(field)


def tree(root: str, contents: bool = False, times: bool = False) -> dict:
    """Every path under root (root included) with type, mode, link target, and optionally a hash of
    the contents and the files' modification times: what 'nothing created, changed or removed'
    means. The one snapshot of a tree the tests compare."""
    seen = {}

    def record(path):
        st = os.lstat(path)
        entry = [st.st_mode, st.st_rdev, st.st_uid]
        if os.path.islink(path):
            entry.append(os.readlink(path))
        elif contents and os.path.isfile(path):
            with open(path, "rb") as f:
                entry.append(hashlib.sha256(f.read()).hexdigest())
        if times and os.path.isfile(path) and not os.path.islink(path):
            entry.append(st.st_mtime_ns)
        seen[os.path.relpath(path, root)] = tuple(entry)

    if not os.path.lexists(root):
        return {}
    record(root)
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            record(os.path.join(directory, name))
    return seen


def host_watch() -> dict:
    """Listings of HOST_WATCH: names with type, inode and device numbers (and size for files)."""
    seen = {}
    for directory in HOST_WATCH:
        try:
            names = sorted(os.listdir(directory))
        except OSError as e:
            seen[directory] = e.errno
            continue
        listing = {}
        for name in names:
            try:
                st = os.lstat(os.path.join(directory, name))
            except FileNotFoundError:
                continue  # gone between listdir and lstat: not ours (e.g. a short-lived /dev node)
            listing[name] = (st.st_mode, st.st_ino, st.st_rdev, st.st_size if stat.S_ISREG(st.st_mode) else None)
        seen[directory] = listing
    seen["/etc/ld.so.cache"] = _file_hash("/etc/ld.so.cache")
    return seen


def _file_hash(path):
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        return e.errno


def prefilter_for_this_checkout(directory, **build) -> tuple:
    """(the compiled pre-filter, the launcher of this checkout it runs), built in directory;
    build: more of prefilter.build's options (start_server, flags)."""
    from oci_gpu_hook.toolkit import launcher, prefilter

    python = os.path.join(str(directory), "oci-gpu-hook-python")
    with open(python, "w") as f:
        f.write(launcher.for_this_install())
    os.chmod(python, 0o755)
    return prefilter.build(os.path.join(str(directory), "oci-gpu-hook"), python, **build), python


def config_with(host: dict, tmp_path, extra: str) -> str:
    """A configuration file of the test's own: the simulated host's, with the top-level keys of the
    YAML lines extra added, each in place of the host's own if it has one (a key written twice is
    refused: settings.load_yaml)."""
    import yaml

    path = os.path.join(str(tmp_path), "config.yaml")
    with open(f"{host['root']}/config.yaml") as f:
        doc = yaml.safe_load(f)
    doc.update(yaml.safe_load(extra) or {})
    with open(path, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    return path


# GPU feature discovery's family name of each simulated model's compute capability, and the
# models that can run MIG (A100, H100): the labels' expected values come from here and from the
# simulated host's description, never from the code under test.
MIB = 1 << 20
GFD_FAMILIES = {(7, 5): "turing", (8, 0): "ampere", (8, 9): "ada-lovelace", (9, 0): "hopper"}
MIG_CAPABLE = {(8, 0), (9, 0)}


def expected_common(host, strategy: str, sharing: str = "time-slicing", facts: bool = False) -> dict:
    """The labels every strategy carries, from the host summary. facts: with the machine and mode
    labels, which come from the simulated sysfs (for_node and the command)."""
    driver = host["driver_version"].split(".")
    rev = driver[2] if len(driver) > 2 else ""
    cuda_major, cuda_minor = host["cuda_version"].split(".")
    labels = {
        "nvidia.com/cuda.driver.major": driver[0],
        "nvidia.com/cuda.driver.minor": driver[1],
        "nvidia.com/cuda.driver.rev": rev,
        "nvidia.com/cuda.driver-version.major": driver[0],
        "nvidia.com/cuda.driver-version.minor": driver[1],
        "nvidia.com/cuda.driver-version.revision": rev,
        "nvidia.com/cuda.driver-version.full": host["driver_version"],
        "nvidia.com/cuda.runtime.major": cuda_major,
        "nvidia.com/cuda.runtime.minor": cuda_minor,
        "nvidia.com/cuda.runtime-version.major": cuda_major,
        "nvidia.com/cuda.runtime-version.minor": cuda_minor,
        "nvidia.com/cuda.runtime-version.full": host["cuda_version"],
        "nvidia.com/mig.capable": str(
            any(g["mig"] or tuple(g["model"]["compute_capability"]) in MIG_CAPABLE for g in host["gpus"])
        ).lower(),
        "nvidia.com/mig.strategy": strategy,
        "nvidia.com/mps.capable": "false",
    }
    if facts:
        labels["nvidia.com/gpu.machine"] = "-".join(host["machine"].split(" "))
        labels.update(expected_pci_labels(host))
    return labels


def expected_pci_labels(host) -> dict:
    """gpu.mode and vgpu.* by GFD's rules, from the classes and the vGPU host driver the host was
    described with: every GPU of one class, a VGA controller's (0x0300xx) graphics, a 3D
    controller's (0x0302xx) compute, else unknown (GFD's getModeForClasses); vgpu.present true with
    the host driver's version and branch where its GPUs carry NVIDIA's vGPU capability, false on
    bare metal."""
    classes = {g["pci_class"] for g in host["gpus"]}
    mode = {0x030200: "compute", 0x030000: "graphics"}.get(classes.pop(), "unknown") if len(classes) == 1 else "unknown"
    labels = {"nvidia.com/gpu.mode": mode, "nvidia.com/vgpu.present": "false"}
    if host.get("vgpu_host_driver"):
        version, branch = host["vgpu_host_driver"]
        labels.update({"nvidia.com/vgpu.present": "true", "nvidia.com/vgpu.host-driver-version": version,
                       "nvidia.com/vgpu.host-driver-branch": branch})  # fmt: skip
    return labels


def expected_gpu(host, gpus, replicas: int, sharing: str = "time-slicing") -> dict:
    """gpu.*: every GPU counted; without sharing where every GPU has MIG on, as GFD writes them."""
    model = gpus[0]["model"]
    major, minor = model["compute_capability"]
    if all(g["mig"] for g in gpus):
        replicas = 0
    return {
        "nvidia.com/gpu.count": str(len(gpus)),
        "nvidia.com/gpu.product": "-".join(model["name"].split()) + ("-SHARED" if replicas > 1 else ""),
        "nvidia.com/gpu.memory": str(model["memory_total"] // MIB),
        "nvidia.com/gpu.family": GFD_FAMILIES[(major, minor)],
        "nvidia.com/gpu.compute.major": str(major),
        "nvidia.com/gpu.compute.minor": str(minor),
        "nvidia.com/gpu.replicas": str(replicas),
        "nvidia.com/gpu.sharing-strategy": sharing if replicas > 1 else "none",
    }


def expected_mig(key: str, gpu_name: str, migs, replicas: int = 1, sharing: str = "time-slicing") -> dict:
    """One MIG profile's labels (key: gpu under single, mig-<profile> under mixed), from the host
    summary and the simulator's profile table (what a real A100-SXM4-40GB reports)."""
    from oci_gpu_hook.toolkit.simulate import model

    profile = model.MIG_PROFILE[migs[0]["profile"]]
    prefix = f"nvidia.com/{key}."
    values = {
        "count": len(migs),
        "product": "-".join(gpu_name.split()) + f"-MIG-{profile.name}" + ("-SHARED" if replicas > 1 else ""),
        "replicas": replicas,
        "sharing-strategy": sharing if replicas > 1 else "none",
        "memory": migs[0]["memory_total"] // MIB,
        "slices.gi": profile.slices,
        "slices.ci": profile.slices,
        "multiprocessors": profile.multiprocessors,
        "engines.copy": profile.copy_engines,
        "engines.decoder": profile.decoders,
        "engines.encoder": profile.encoders,
        "engines.jpeg": profile.jpegs,
        "engines.ofa": profile.ofas,
    }
    assert values["memory"] == profile.memory_mib  # the memory info and the attributes agree
    return {prefix + k: str(v) for k, v in values.items()}


def expected_labels(host: dict, mig_strategy: str = "none", replicas: int = 1) -> dict:
    """The node labels `oci-gpu-hook labels` must write for the simulated host (its description:
    simulated-host.json, what the `host` fixture returns, and the simulator's MIG profile table),
    with GFD's names and values, for the strategy none or mixed and replicas of each full GPU."""
    if mig_strategy not in ("none", "mixed"):
        raise ValueError(f"expected_labels: strategy {mig_strategy!r} (none or mixed)")
    gpus = host["gpus"]
    labels = {**expected_common(host, mig_strategy, facts=True), **expected_gpu(host, gpus, replicas)}
    migs = [m for g in gpus for m in g["mig"]] if mig_strategy == "mixed" else []
    for profile in sorted({m["profile"] for m in migs}):
        labels.update(
            expected_mig(f"mig-{profile}", gpus[0]["model"]["name"], [m for m in migs if m["profile"] == profile])
        )
    return labels


def one_mib_documents(key: str) -> dict:
    """{name: (text, the words refusing it)}: configuration documents of 1 MiB, the most a file may
    hold, each a value of key made of hundreds of thousands of short nodes. PyYAML took 5 to 38 s
    to build any of them before a bound looked at what it had built (issue 36, item 7)."""
    from oci_gpu_hook.start import settings

    def filled(head: str, unit: str, tail: str) -> str:
        return head + unit * ((settings.MAX_CONFIG_BYTES - len(head) - len(tail)) // len(unit)) + tail

    row = "[" + ",".join(["a"] * 1000) + "]"  # within every bound by itself
    return {
        "flow-list": (filled(f"{key}: [", "0,", "0]\n"), settings.TOO_LONG),
        "block-list": (filled(f"{key}:\n", "- a:\n", ""), settings.TOO_LONG),  # of one-key mappings
        "flow-mapping": (filled(f"{key}: {{", "a,", "a}\n"), settings.TOO_WIDE),
        "nested": (filled(f"{key}: [", row + ",", row + "]\n"), settings.TOO_MANY_VALUES),
    }


def remove_cgroup(path: str, tries: int = 100) -> None:
    """rmdir a test cgroup; the kernel keeps it busy (EBUSY) for a moment after its last process
    exits. Any other failure, or one still busy after the tries, is raised: a cgroup left on the
    host must not go unnoticed."""
    for _ in range(tries - 1):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            time.sleep(0.02)
    os.rmdir(path)


def device_rules(cgroup: str) -> str:
    with open(os.path.join(cgroup, "devices.list")) as f:
        return f.read()


def host_files(root: str) -> dict:
    own = HOOK_OWN_FILES
    return {p: v for p, v in tree(root, contents=True).items() if p not in own and not p.startswith("containers/")}


class Observation:
    def __init__(self, pid: int, bundle: str, cgroup: str, host_root: str, canary: str | None):
        self.container_mounts = mountinfo(pid)
        self.host_mounts = mountinfo()
        self.bundle = tree(bundle)
        self.rules = device_rules(cgroup)
        self.canary = tree(canary, contents=True) if canary else {}
        self.host_root = host_files(host_root)
        self.host = host_watch()


def observe(container, canary: str | None = None) -> Observation:
    """container: the live_container tuple (state, bundle, pid, cgroup, host)."""
    _, bundle, pid, cgroup, host = container
    return Observation(pid, bundle, cgroup, host["root"], canary)


def assert_contained(before: Observation, after: Observation, rootfs: str, canary: str | None = None) -> None:
    """Whatever the outcome: nothing outside the rootfs was created, changed or mounted over."""
    rootfs = os.path.realpath(rootfs)
    added = sorted(set(after.container_mounts) - set(before.container_mounts))
    outside = [m for m in added if not m[0].startswith(rootfs + "/")]
    assert not outside, f"{len(outside)} mounts outside the rootfs: {outside[:3]}"
    if canary:
        assert not [m for m in after.container_mounts if m[0].startswith(canary)], "a mount on the canary"
        assert after.canary == before.canary, "the canary tree on the host changed"
    gone = sorted(set(before.host_mounts) - set(after.host_mounts))
    new = sorted(set(after.host_mounts) - set(before.host_mounts))
    assert after.host_mounts == before.host_mounts, f"the host's mount table changed: gone {gone[:3]}, new {new[:3]}"
    assert after.host == before.host, _diff(before.host, after.host)
    assert after.host_root == before.host_root, "the simulated host's files changed"


def assert_rolled_back(before: Observation, after: Observation) -> None:
    """A failure leaves the container exactly as it was: mounts, files, device rules."""
    assert after.container_mounts == before.container_mounts, (
        f"mounts left behind: {sorted(set(after.container_mounts) - set(before.container_mounts))}"
    )
    assert after.bundle == before.bundle, _diff(before.bundle, after.bundle)
    assert after.rules == before.rules, "device rules left behind"


def _diff(before: dict, after: dict) -> str:
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return "changed: " + "; ".join(f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed[:10])


def make_canary(path: str, host: dict) -> str:
    """The host tree hostile links point at, shaped like the places the hook writes."""
    version = host["driver_version"]
    for directory in ("usr/lib64", "usr/lib", "usr/lib/x86_64-linux-gnu", "usr/bin", "usr/sbin", "dev",
                      "proc/driver/nvidia", "etc/ld.so.conf.d", "etc/vulkan/icd.d", "var/run/nvidia-persistenced",
                      "lib/firmware/nvidia"):  # fmt: skip
        os.makedirs(os.path.join(path, directory), exist_ok=True)
        with open(os.path.join(path, directory, "canary"), "w") as f:
            f.write(f"canary {directory}\n")
    for name in ("dev/nvidia0", "dev/nvidiactl", "etc/ld.so.cache", "usr/bin/nvidia-smi", "proc/driver/nvidia/params",
                 "etc/vulkan/icd.d/nvidia_icd.json", "usr/lib64/libnvidia-ml.so.1"):  # fmt: skip
        with open(os.path.join(path, name), "w") as f:
            f.write(f"canary {name}\n")
    with open(os.path.join(path, "etc/ld.so.conf.d/canary.conf"), "w") as f:
        f.write(f"{path}/usr/lib64\n")
    # A real driver library without its SONAME link: an ldconfig that reached this directory
    # would create libcuda.so.1 here.
    library = f"usr/lib64/libcuda.so.{version}"
    shutil.copy2(f"{host['root']}/{library}", os.path.join(path, library))
    return path


# --- containers ---------------------------------------------------------------------------------


def hold_namespace(rootfs: str, seconds: int = 600) -> subprocess.Popen:
    """A process standing for a container at prestart, as runc leaves it: its own mount namespace
    (private propagation) in which the rootfs is bind-mounted onto itself; returned once ready."""
    script = 'mount --bind "$1" "$1" && echo ready && exec sleep "$2"'
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", rootfs,
                             str(seconds)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)  # fmt: skip
    if proc.stdout.readline() != b"ready\n":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"cannot make a mount namespace holding {rootfs} (unshare, mount)")
    return proc


def runc_detached(bundle: str, container_id: str, timeout: float = 60) -> int:
    """Start a container that keeps running (`runc run --detach`); returns its init pid. The caller
    removes it with runc_delete."""
    # The container inherits runc's stdio: a pipe there would stay open as long as it runs.
    with tempfile.TemporaryFile() as errors:
        argv = ["runc", "run", "--detach", "--bundle", bundle, container_id]
        proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=errors, timeout=timeout, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            runc_delete(container_id)
            errors.seek(0)
            message = errors.read().decode(errors="replace").strip()
            raise RuntimeError(f"runc run --detach {container_id}: {message}")
    state = subprocess.run(["runc", "state", container_id], capture_output=True, text=True, timeout=timeout)
    return json.loads(state.stdout)["pid"]


def runc_delete(container_id: str) -> None:
    subprocess.run(["runc", "delete", "--force", container_id], capture_output=True, timeout=60)


@contextlib.contextmanager
def cdi_spec_in_etc(host: dict, name: str, *options: str):
    """The path of the spec `cdi generate OPTIONS` writes for the simulated host as /etc/cdi/NAME:
    podman 4.3 reads specs from /etc/cdi and /var/run/cdi only, so a file of the test's own goes
    there. Removed after the block, and /etc/cdi with it where this made it and it is empty."""
    created_dir = not os.path.isdir("/etc/cdi")
    path = f"/etc/cdi/{name}"
    config = f"{host['root']}/config.yaml"
    generate = [*hook_command(config), "cdi", "generate", *options, "--parents", "--output", path]
    try:  # /etc/cdi is the host's: the spec goes whatever fails
        out = subprocess.run(generate, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        yield path
    finally:
        if os.path.exists(path):
            os.unlink(path)
        if created_dir and os.path.isdir("/etc/cdi") and not os.listdir("/etc/cdi"):
            os.rmdir("/etc/cdi")


# --- acting in the container's mount namespace ---------------------------------------------------


def in_container(pid: int, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a host program in the live container's mount namespace (mount, umount, ...)."""
    return subprocess.run(["nsenter", "-t", str(pid), "-m", *argv], capture_output=True, text=True, check=check)


def mount_proc(pid: int, rootfs: str) -> bool:
    """Mount a procfs at rootfs/proc, as runc has done by prestart; only on a real directory."""
    path = os.path.join(rootfs, "proc")
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    in_container(pid, "mount", "-t", "proc", "proc", path)
    return True
