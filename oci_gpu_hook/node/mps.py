"""MPS sharing (`sharing.mps` in the device plugin's configuration): one MPS control daemon per
shared resource, and what its clients are told.

A resource shared through MPS with N replicas: each GPU of it gets a daemon-wide default pinned
device memory limit of its memory / N and an active thread percentage of 100 / N, set through the
control program's stdin commands (set_default_device_pinned_mem_limit,
set_default_active_thread_percentage) right after `nvidia-cuda-mps-control -d` starts the daemon;
`quit` stops it. The daemon's directories, as NVIDIA's plugin lays them out under flags.mpsRoot:
<root>/<resource>/pipe and <root>/<resource>/log, and <root>/shm, which the daemon sees as its
/dev/shm (a private mount namespace), as its clients do. A client container gets the three
mounted, CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY naming them, and its own limits in
CUDA_MPS_PINNED_DEVICE_MEM_LIMIT and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (a client may lower them,
never raise them past the daemon's defaults).
"""

from __future__ import annotations

import os
import subprocess
import tempfile

from oci_gpu_hook.errors import PrerequisiteError
from oci_gpu_hook.record import Record
from oci_gpu_hook.start.inventory import host_path

CONTROL = "nvidia-cuda-mps-control"
# Where a client container finds the daemon's directories: NVIDIA's plugin's container root.
CONTAINER_ROOT = "/mps"
SHM = "/dev/shm"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
MEMORY_ENV, THREADS_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
# The control program runs with this environment only, as every child of ours does.
_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
_TIMEOUT = 30


class MpsError(PrerequisiteError):
    pass


def pipe_dir(root: str, resource_name: str) -> str:
    return os.path.join(root, resource_name, "pipe")


def log_dir(root: str, resource_name: str) -> str:
    return os.path.join(root, resource_name, "log")


def shm_dir(root: str) -> str:
    return os.path.join(root, "shm")


def memory_limit_mib(memory_total: int | None, replicas: int) -> int | None:
    """A replica's share of a GPU's memory, in MiB (rounded down, as NVIDIA's plugin does)."""
    return memory_total // replicas >> 20 if memory_total else None


def thread_percentage(replicas: int) -> int:
    return 100 // replicas


def _gpus(resource) -> list:
    """The resource's GPUs, each once, in NVML index order."""
    return sorted({d.unit.gpu.index: d.unit.gpu for d in resource.devices}.values(), key=lambda g: g.index)


def daemon_commands(resource) -> tuple:
    """The control commands that set the daemon's defaults for resource, in order."""
    commands = []
    for gpu in _gpus(resource):
        limit = memory_limit_mib(gpu.memory_total, resource.replicas)
        if limit is not None:
            commands.append(f"set_default_device_pinned_mem_limit {gpu.index} {limit}M")
    commands.append(f"set_default_active_thread_percentage {thread_percentage(resource.replicas)}")
    return tuple(commands)


def client_answer(resource, units) -> tuple:
    """(envs, mounts) a client container of resource gets for units (its GPUs, in the order the
    container sees them)."""
    name = resource.name
    envs = {
        PIPE_ENV: pipe_dir(CONTAINER_ROOT, name),
        LOG_ENV: log_dir(CONTAINER_ROOT, name),
        THREADS_ENV: str(thread_percentage(resource.replicas)),
    }
    limits = [memory_limit_mib(u.memory_total, resource.replicas) for u in units]
    if all(limit is not None for limit in limits):
        envs[MEMORY_ENV] = ",".join(f"{ordinal}={limit}M" for ordinal, limit in enumerate(limits))
    root = resource.mps_root
    mounts = (
        (pipe_dir(CONTAINER_ROOT, name), pipe_dir(root, name), False),
        (log_dir(CONTAINER_ROOT, name), log_dir(root, name), True),
        (SHM, shm_dir(root), False),
    )
    return envs, mounts


def control_program(inventory) -> str:
    """The driver's nvidia-cuda-mps-control, as the inventory found it (host path)."""
    for f in inventory.files_for(("compute",), ("binary",)):
        if os.path.basename(f.path) == CONTROL:
            return host_path(inventory.driver_root, f.path)
    raise MpsError(f"sharing.mps: the driver has no {CONTROL} (it is part of the driver's compute files)")


class Daemon(Record):
    """One running MPS control daemon: what it was started for and told."""

    __slots__ = ("resource_name", "root", "program", "commands")
    resource_name: str
    root: str
    program: str
    commands: tuple


def _env(root: str, name: str) -> dict:
    return dict(_ENV, **{PIPE_ENV: pipe_dir(root, name), LOG_ENV: log_dir(root, name)})


def send(daemon: Daemon, commands) -> str:
    """The control program's answer to commands, written to its stdin; MpsError when it fails
    (no daemon answers on the pipe directory)."""
    try:
        result = subprocess.run([daemon.program], input="".join(c + "\n" for c in commands), text=True,
                                env=_env(daemon.root, daemon.resource_name), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, timeout=_TIMEOUT, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MpsError(f"{daemon.program}: {getattr(e, 'strerror', None) or e}") from None
    if result.returncode != 0:
        last = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
        raise MpsError(f"{daemon.program} ({daemon.resource_name}): exit status {result.returncode}: {last[:200]}")
    return result.stdout


def start(resource, inventory) -> Daemon:
    """Start resource's daemon with the driver's control program (stopping one left on its pipe
    directory by an earlier run) and set its defaults; MpsError when it cannot."""
    return launch(resource, control_program(inventory))


def launch(resource, program: str) -> Daemon:
    """start() with the control program at program (a host path)."""
    root, name = resource.mps_root, resource.name
    daemon = Daemon(name, root, program, daemon_commands(resource))
    for directory, mode in ((pipe_dir(root, name), 0o755), (log_dir(root, name), 0o755), (shm_dir(root), 0o1777)):
        os.makedirs(directory, mode=0o755, exist_ok=True)
        os.chmod(directory, mode)
    try:
        send(daemon, ["quit"])  # one an earlier run left behind gets no say in the new defaults
    except MpsError:
        pass
    unshare = next((p for p in ("/usr/bin/unshare", "/bin/unshare") if os.access(p, os.X_OK)), None)
    if unshare is None:
        raise MpsError("sharing.mps needs unshare (util-linux) to give the MPS daemon its own /dev/shm")
    # The daemon's /dev/shm is <root>/shm, which its clients get too: a mount namespace of its
    # own (private, so nothing reaches the host's), made before `-d` forks the daemon off.
    script = 'mount --bind "$1" /dev/shm && exec "$2" -d'
    argv = [unshare, "--mount", "--propagation", "private", "/bin/sh", "-c", script, "sh", shm_dir(root),
            daemon.program]  # fmt: skip
    # Its output in a file, not a pipe: a daemon that kept the pipe open would hold the read forever.
    with tempfile.TemporaryFile("w+") as output:
        try:
            returncode = subprocess.run(argv, env=_env(root, name), stdin=subprocess.DEVNULL, stdout=output,
                                        stderr=subprocess.STDOUT, timeout=_TIMEOUT, check=False).returncode  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsError(f"starting the MPS daemon for {name}: {getattr(e, 'strerror', None) or e}") from None
        output.seek(0)
        text = output.read(65536)
    if returncode != 0:
        first = (text.strip().splitlines() or ["(no output)"])[0]  # mount's or the program's own words
        raise MpsError(f"starting the MPS daemon for {name} failed: {first[:200]}")
    send(daemon, daemon.commands)
    return daemon


def stop(daemon: Daemon) -> None:
    send(daemon, ["quit"])


PID_FILE = "nvidia-cuda-mps-control.pid"  # in the pipe directory while the daemon runs (the real one's)


def alive(daemon: Daemon) -> bool:
    """Whether the daemon still runs: the pid its pid file names is a control program. Read, not
    asked: a connection per round would fill the real daemon's log."""
    try:
        with open(os.path.join(pipe_dir(daemon.root, daemon.resource_name), PID_FILE)) as f:
            pid = int(f.read(32).strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            program = f.read(4096).split(b"\0")[0]
    except (OSError, ValueError):
        return False
    return os.path.basename(program) == CONTROL.encode()


class Daemons:
    """The daemons of the plugin's MPS resources: sync() starts, restarts (new defaults) and stops
    them to match the resources offered; stop_all() when the plugin stops."""

    def __init__(self, say):
        self.running: dict = {}  # resource name -> Daemon
        self.say = say

    def sync(self, resources, inventory) -> None:
        wanted = {r.name: r for r in resources if r.mps_root}
        for name in [n for n in self.running if n not in wanted or self._changed(wanted[n])]:
            self._stop(name)
        for name, resource in wanted.items():
            if name not in self.running:
                self.running[name] = start(resource, inventory)
                self.say(f"{name}: MPS daemon started ({pipe_dir(resource.mps_root, name)}; "
                         f"{'; '.join(self.running[name].commands)})")  # fmt: skip

    def lost(self) -> bool:
        """Forget the daemons that died (killed, crashed): the next sync() starts them again, as
        their clients need them. True when there were any."""
        dead = [name for name, daemon in self.running.items() if not alive(daemon)]
        for name in dead:
            self.say(f"{name}: the MPS daemon is gone ({pipe_dir(self.running.pop(name).root, name)}): "
                     "starting it again")  # fmt: skip
        return bool(dead)

    def _changed(self, resource) -> bool:
        daemon = self.running[resource.name]
        return daemon.root != resource.mps_root or daemon.commands != daemon_commands(resource)

    def _stop(self, name: str) -> None:
        daemon = self.running.pop(name)
        try:
            stop(daemon)
            self.say(f"{name}: MPS daemon stopped")
        except MpsError as e:
            self.say(f"{name}: stopping the MPS daemon: {e.message}")

    def stop_all(self) -> None:
        for name in list(self.running):
            self._stop(name)
