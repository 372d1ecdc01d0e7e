"""MPS sharing (`sharing.mps` in the device plugin's configuration): one MPS control daemon per
shared resource, and what its clients are told.

A resource shared through MPS with N replicas: each GPU of it gets a daemon-wide default pinned
device memory limit of its memory / N and an active thread percentage of 100 / N, set through the
control program's stdin commands (set_default_device_pinned_mem_limit,
set_default_active_thread_percentage) right after `nvidia-cuda-mps-control -d` starts the daemon;
`quit` stops it. The daemon's directories, as NVIDIA's plugin lays them out under flags.mpsRoot:
<root>/<resource>/pipe and <root>/<resource>/log, and <root>/shm (a tmpfs of its own, as NVIDIA's
mount-shm makes it), which the daemon sees as its /dev/shm (a private mount namespace), as its
clients do. The pipe directory and shm are the client pods' to write: the plugin reads nothing
there after a daemon's start (alive), and makes the directories through descriptors
(make_directories). A client container gets the three
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
# The clients' and the daemon's /dev/shm (<root>/shm): a tmpfs of its own of this size, as NVIDIA's
# mount-shm makes it, so that no pod can fill the filesystem mpsRoot lies on (/run by default).
SHM_BYTES = 64 << 20


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
    """One running MPS control daemon: what it was started for and told, and which process it is."""

    __slots__ = ("resource_name", "root", "program", "commands", "process", "mounted_shm")
    _defaults = {"process": None, "mounted_shm": False}
    resource_name: str
    root: str
    program: str
    commands: tuple
    process: tuple | None  # (pid, start ticks) as launch() found it; None: not found, not watched
    mounted_shm: bool  # launch() mounted <root>/shm's tmpfs (Daemons unmounts it when no daemon uses it)


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
    make_directories(((pipe_dir(root, name), 0o755), (log_dir(root, name), 0o755), (shm_dir(root), 0o1777)))
    daemon = daemon.replace(mounted_shm=mount_shm(root))
    try:
        return _run_daemon(daemon)
    except BaseException:
        if daemon.mounted_shm:  # a start that failed leaves nothing mounted
            unmount_shm(root)
        raise


def _run_daemon(daemon: Daemon) -> Daemon:
    root, name = daemon.root, daemon.resource_name
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
    return daemon.replace(process=_process(daemon))


def make_directories(wanted) -> None:
    """Each (path, mode) of wanted a directory of root's with that mode, made where absent with the
    directories above it (0755); MpsError (flags.mpsRoot) where it cannot be done safely.

    They are made and chmodded as root, shm world-writable, and mounted into every client pod: a
    directory on the way that a local user owns or can change (an mpsRoot under /tmp that they
    made first), or a symlink there, would have that chmod and those mounts land on a directory
    of their choosing (shm -> /etc). So each is made and chmodded through a descriptor, never
    through a symlink, in a directory root alone can change (sources.HostSources: sticky /tmp
    counts), and must be root's."""
    from oci_gpu_hook.start.linux.sources import HostSources, UntrustedSource

    sources = HostSources()
    try:
        for path, mode in wanted:
            _make_directory(sources, os.path.normpath(path), mode)
    except UntrustedSource as e:
        raise MpsError(f"flags.mpsRoot: {e.path}: {e.why}: the MPS directories must be root's alone") from None
    except OSError as e:
        raise MpsError(f"flags.mpsRoot: {e.filename or path}: {e.strerror or e}") from None
    finally:
        sources.close()


def _make_directory(sources, path: str, mode: int) -> None:
    import errno
    import stat

    from oci_gpu_hook.start.linux.sources import UntrustedSource

    parent, name = os.path.split(path)
    if not name:
        return
    if not os.path.lexists(parent):  # made below, checked there; what counts is the check through fds
        _make_directory(sources, parent, 0o755)
    parent_fd = sources.directory(parent)
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW on a symlink, or another kind of file
            raise UntrustedSource(path, "a symlink or not a directory") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != 0 or not stat.S_ISDIR(st.st_mode):
            raise UntrustedSource(path, f"owned by uid {st.st_uid}, not root")
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def mount_shm(root: str) -> bool:
    """A tmpfs of SHM_BYTES at <root>/shm (mode 1777, nosuid, nodev, noexec), where none is mounted
    yet; True when this call mounted it. Its directories are root's alone (make_directories): the
    path names what was checked."""
    from oci_gpu_hook.start.linux import _linux

    shm = shm_dir(root)
    if os.stat(shm).st_dev != os.stat(root).st_dev:
        return False  # a filesystem of its own already (an earlier start's, or the administrator's)
    try:
        _linux.mount("shm", shm, "tmpfs", _linux.MS_NOSUID | _linux.MS_NODEV | _linux.MS_NOEXEC,
                     f"mode=1777,size={SHM_BYTES >> 10}k")  # fmt: skip
    except OSError as e:
        raise MpsError(f"flags.mpsRoot: mounting a tmpfs on {shm}: {e.strerror or e}") from None
    return True


def unmount_shm(root: str) -> None:
    """Detach the tmpfs mount_shm() made: pods that still have it keep theirs."""
    from oci_gpu_hook.start.linux import _linux

    try:
        _linux.umount2(shm_dir(root), _linux.MNT_DETACH)
    except OSError:
        pass


def stop(daemon: Daemon) -> None:
    send(daemon, ["quit"])


PID_FILE = "nvidia-cuda-mps-control.pid"  # in the pipe directory while the daemon runs (the real one's)


def _process(daemon: Daemon) -> tuple | None:
    """(pid, start ticks) of the daemon just started, from its pid file; None when the file names
    no process running daemon.program from the host's root.

    The pipe directory is mounted read-write into every client pod: the file there is the pods' to
    remove or replace, and a FIFO, a device node or a symlink (to /dev/watchdog, say) put there is
    not to be opened by the root plugin. So it is read once, right after the daemon wrote it, only
    if it is a regular file (not a symlink), and what it names must be the control program (the
    same file) with the plugin's own root (no pod's process, whose root is its container's); from then on
    the daemon is watched through /proc alone (alive)."""
    import stat

    from oci_gpu_hook.start import files, pids

    path = os.path.join(pipe_dir(daemon.root, daemon.resource_name), PID_FILE)
    try:
        # What is there is looked at first (O_PATH opens nothing): a device node a pod made there
        # (CAP_MKNOD) is never opened, and the plugin is in no device cgroup.
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            pid = int(files.read_bounded(f"/proc/self/fd/{fd}", 32, regular=True).strip())
        finally:
            os.close(fd)
        ticks = pids.start_ticks(pid)
        exe, program = os.stat(f"/proc/{pid}/exe"), os.stat(daemon.program)
        root, own = os.stat(f"/proc/{pid}/root"), os.stat("/proc/self/root")
    except (OSError, ValueError):
        return None
    if ticks is None or (exe.st_dev, exe.st_ino) != (program.st_dev, program.st_ino):
        return None
    return (pid, ticks) if (root.st_dev, root.st_ino) == (own.st_dev, own.st_ino) else None


def alive(daemon: Daemon) -> bool:
    """Whether the daemon still runs: the process launch() found is (same pid, same start time,
    not a zombie). Asked of /proc, not of the pipe directory, which pods may write; nor of the
    daemon: a connection per round would fill the real daemon's log. A daemon whose process was
    not found counts as running."""
    from oci_gpu_hook.start import pids

    return daemon.process is None or pids.is_same_process(*daemon.process)


class Daemons:
    """The daemons of the plugin's MPS resources: sync() starts, restarts (new defaults) and stops
    them to match the resources offered; stop_all() when the plugin stops."""

    def __init__(self, say):
        self.running: dict = {}  # resource name -> Daemon
        self.mounted: set = set()  # the roots whose shm tmpfs a launch() here mounted
        self.say = say

    def sync(self, resources, inventory) -> None:
        wanted = {r.name: r for r in resources if r.mps_root}
        for name in [n for n in self.running if n not in wanted or self._changed(wanted[n])]:
            self._stop(name)
        for name, resource in wanted.items():
            if name not in self.running:
                self.running[name] = start(resource, inventory)
                if self.running[name].mounted_shm:
                    self.mounted.add(resource.mps_root)
                self.say(f"{name}: MPS daemon started ({pipe_dir(resource.mps_root, name)}; "
                         f"{'; '.join(self.running[name].commands)})")  # fmt: skip
                if self.running[name].process is None:
                    self.say(f"{name}: the MPS daemon's {PID_FILE} names no process of {self.running[name].program}: "
                             "if the daemon dies, it is not started again")  # fmt: skip

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
        if daemon.root in self.mounted and all(d.root != daemon.root for d in self.running.values()):
            self.mounted.discard(daemon.root)
            unmount_shm(daemon.root)

    def stop_all(self) -> None:
        for name in list(self.running):
            self._stop(name)
        for root in sorted(self.mounted):  # those of daemons that died and were not started again
            unmount_shm(root)
        self.mounted.clear()
