"""MPS sharing (`sharing.mps` in the device plugin's configuration): one MPS control daemon per
shared resource, and what its clients are told.

A resource shared through MPS with N replicas: each GPU of it gets a daemon-wide default pinned
device memory limit of its memory / N and an active thread percentage of 100 / N, set through the
control program's stdin commands (set_default_device_pinned_mem_limit,
set_default_active_thread_percentage) right after `nvidia-cuda-mps-control -d` starts the daemon;
`quit` stops it. A client container gets the daemon's pipe directory (read-write), its log
directory (read-only) and its /dev/shm mounted, CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY
naming them, and its own limits in CUDA_MPS_PINNED_DEVICE_MEM_LIMIT and
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (a client may lower them, never raise them past the daemon's).

Where the daemon's files are, and why. The daemon runs as root and writes by name into its pipe
directory and its /dev/shm, which every client pod has read-write: NVIDIA's 550 daemon opens
control_lock and its pid file with O_CREAT and no O_NOFOLLOW, makes its log FIFO and chmods it,
binds its sockets (seen with strace). A pod running as uid 0 may `quit` the daemon and leave links
or sockets of its own at those names for the next daemon. So a daemon never gets a directory a pod
has had: each start makes a generation of its own, <root>/<resource>/daemon-<random>/, a tmpfs
(IPC_BYTES) mounted on a directory made for it, never reused, all of it made through descriptors:
- pipe/: the daemon's pipe directory, and its clients'.
- plugin/ (0700, never mounted into a pod): hard links to the daemon's control sockets. The
  plugin's control program talks to the daemon through them, never through a name in the pipe
  directory that a pod may have replaced.
- shm/: a tmpfs of its own (SHM_BYTES, 1777), the daemon's /dev/shm (a mount namespace of its
  own) and its clients': each resource's, and each start's, own.
- process: the daemon's pid and start time, written by the plugin, so that a later plugin finds
  and stops a daemon an earlier one left running.
Clients are given stable names, <root>/<resource>/pipe and .../shm: links (root's, in a directory
root alone can change) to the current generation's, replaced by rename once its daemon has its
defaults. The runtime resolves them when it creates a container (containerd and CRI-O resolve a
mount's host path), so a container started or restarted later reaches the daemon of then, and a
link to a generation that is gone makes the container fail to start rather than run without the
daemon. <root>/<resource>/log, the daemon's log directory, is one directory for every generation:
pods have it read-only. A generation goes (its tmpfs detached: pods that have it keep their view)
when its daemon stops or is found dead, or when the next start finds it left by an earlier plugin.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import subprocess
import tempfile

from oci_gpu_hook.errors import PrerequisiteError
from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.start.digits import decimal
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
# Stopping a daemon: `quit` waits this long for its answer, then the process this long to go, and
# one still there is killed (a daemon busy with a client's connection may not answer at all).
_QUIT_TIMEOUT = 10
_GONE_WAIT = 5.0
# The clients' and the daemon's /dev/shm: a tmpfs of this size per generation, as NVIDIA's
# mount-shm makes it, so that no pod can fill the filesystem mpsRoot lies on (/run by default),
# nor the /dev/shm of another resource's clients.
SHM_BYTES = 64 << 20
# A generation's tmpfs, the pipe directory's: sockets, FIFOs, a pid file and a lock file.
IPC_BYTES = 4 << 20
GENERATION = "daemon-"  # a generation's directory name: this, then 12 random hex digits
# A socket's path may have 107 bytes (sun_path): the daemon's in its generation must fit.
_SOCKET_PATH_MAX = 107
PID_FILE = "nvidia-cuda-mps-control.pid"  # in the pipe directory while the daemon runs (the real one's)
# The control sockets the control program connects to (NVIDIA's, run as root: control_privileged).
SOCKETS = ("control", "control_privileged")
_PROCESS_FILE = "process"


class MpsError(PrerequisiteError):
    pass


def resource_dir(root: str, resource_name: str) -> str:
    return os.path.join(root, resource_name)


def pipe_dir(root: str, resource_name: str) -> str:
    """The clients' pipe directory: a link to the current generation's."""
    return os.path.join(root, resource_name, "pipe")


def log_dir(root: str, resource_name: str) -> str:
    return os.path.join(root, resource_name, "log")


def shm_dir(root: str, resource_name: str) -> str:
    """The clients' /dev/shm: a link to the current generation's."""
    return os.path.join(root, resource_name, "shm")


def daemon_pipe(generation: str) -> str:
    """The pipe directory the daemon of generation (its directory) is told."""
    return os.path.join(generation, "pipe")


def daemon_shm(generation: str) -> str:
    return os.path.join(generation, "shm")


def _plugin_pipe(generation: str) -> str:
    return os.path.join(generation, "plugin")


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
    container sees them). The mounts name the stable links, which the runtime resolves to the
    generation of the daemon that runs when it creates the container."""
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
        (SHM, shm_dir(root, name), False),
    )
    return envs, mounts


def control_program(inventory) -> str:
    """The driver's nvidia-cuda-mps-control, as the inventory found it (host path)."""
    for f in inventory.files_for(("compute",), ("binary",)):
        if os.path.basename(f.path) == CONTROL:
            return host_path(inventory.driver_root, f.path)
    raise MpsError(f"sharing.mps: the driver has no {CONTROL} (it is part of the driver's compute files)")


class Daemon(Frozen):
    """One MPS control daemon: what it was started for and told, where, and which process it is."""

    __slots__ = ("resource_name", "root", "program", "commands", "generation", "process")
    _defaults = {"process": None}
    resource_name: str
    root: str
    program: str
    commands: tuple
    generation: str  # <root>/<resource>/daemon-<id>: this start's directories, never another's
    process: tuple | None  # (pid, start ticks) as launch() found it; None: not found, not watched


def send(daemon: Daemon, commands, timeout: float = _TIMEOUT) -> str:
    """The control program's answer to commands, written to its stdin; MpsError when it fails (the
    daemon does not answer). It reaches the daemon through the generation's plugin directory, the
    links to the sockets the daemon bound: a pod may replace the names in the pipe directory (with
    a socket of its own that never answers, or a link to another), never those."""
    env = dict(_ENV, **{PIPE_ENV: _plugin_pipe(daemon.generation), LOG_ENV: log_dir(daemon.root, daemon.resource_name)})
    # Into a file, read bounded: the answer is a few lines.
    with tempfile.TemporaryFile("w+") as output:
        try:
            returncode = subprocess.run([daemon.program], input="".join(c + "\n" for c in commands), text=True,
                                        env=env, stdout=output, stderr=subprocess.STDOUT, timeout=timeout,
                                        check=False).returncode  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsError(f"{daemon.program}: {getattr(e, 'strerror', None) or e}") from None
        output.seek(0)
        text = output.read(65536)
    if returncode != 0:
        last = (text.strip().splitlines() or ["(no output)"])[-1]
        raise MpsError(f"{daemon.program} ({daemon.resource_name}): exit status {returncode}: {last[:200]}")
    return text


def start(resource, inventory) -> Daemon:
    """Start resource's daemon with the driver's control program in a new generation (stopping one
    an earlier plugin left) and set its defaults; MpsError when it cannot."""
    return launch(resource, control_program(inventory))


def launch(resource, program: str) -> Daemon:
    """start() with the control program at program (a host path). The generations found are
    retired first (their daemons stopped if they still run); the clients' links name the new one
    once its daemon has its defaults. A start that fails leaves no generation and no daemon."""
    root, name = resource.mps_root, resource.name
    home = resource_dir(root, name)
    longest = os.path.join(_plugin_pipe(os.path.join(home, GENERATION + "0" * 12)), SOCKETS[-1])
    if len(os.fsencode(longest)) > _SOCKET_PATH_MAX:
        raise MpsError(f"flags.mpsRoot: {root} is too long for the MPS daemon's sockets: {longest} is more than "
                       f"the {_SOCKET_PATH_MAX} bytes a socket's path may have")  # fmt: skip
    make_directories(((home, 0o755), (log_dir(root, name), 0o755)))
    place = _open_place(root, name)
    try:
        for leftover in _generations(place):
            _retire(place, leftover, Daemon(name, root, program, (), os.path.join(home, leftover)))
        _set_aside_old_layout(place)
        generation = _make_generation(place)
        daemon = Daemon(name, root, program, daemon_commands(resource), os.path.join(home, generation))
        try:
            daemon = _run_daemon(daemon)
        except BaseException:
            _remove_generation(place, generation)
            raise
        try:
            _publish(place, generation)
        except BaseException:
            _halt(daemon)
            _remove_generation(place, generation)
            raise
        return daemon
    except OSError as e:
        raise MpsError(f"flags.mpsRoot: {e.filename or home}: {e.strerror or e}") from None
    finally:
        os.close(place)


def _run_daemon(daemon: Daemon) -> Daemon:
    generation = daemon.generation
    unshare = next((p for p in ("/usr/bin/unshare", "/bin/unshare") if os.access(p, os.X_OK)), None)
    if unshare is None:
        raise MpsError("sharing.mps needs unshare (util-linux) to give the MPS daemon its own /dev/shm")
    # The daemon's /dev/shm is its generation's, which its clients get too: a mount namespace of
    # its own (private, so nothing reaches the host's), made before `-d` forks the daemon off.
    script = 'mount --bind "$1" /dev/shm && exec "$2" -d'
    argv = [unshare, "--mount", "--propagation", "private", "/bin/sh", "-c", script, "sh", daemon_shm(generation),
            daemon.program]  # fmt: skip
    env = dict(_ENV, **{PIPE_ENV: daemon_pipe(generation), LOG_ENV: log_dir(daemon.root, daemon.resource_name)})
    # Its output in a file, not a pipe: a daemon that kept the pipe open would hold the read forever.
    with tempfile.TemporaryFile("w+") as output:
        try:
            returncode = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                        stderr=subprocess.STDOUT, timeout=_TIMEOUT, check=False).returncode  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsError(f"starting the MPS daemon for {daemon.resource_name}: "
                           f"{getattr(e, 'strerror', None) or e}") from None  # fmt: skip
        output.seek(0)
        text = output.read(65536)
    if returncode != 0:
        first = (text.strip().splitlines() or ["(no output)"])[0]  # mount's or the program's own words
        raise MpsError(f"starting the MPS daemon for {daemon.resource_name} failed: {first[:200]}")
    # The daemon runs: whatever fails from here on stops it.
    daemon = daemon.replace(process=_process(daemon))
    try:
        _link_sockets(daemon)
        _record_process(generation, daemon.process)
        send(daemon, daemon.commands)
    except BaseException:
        _halt(daemon)
        raise
    return daemon


def make_directories(wanted) -> None:
    """Each (path, mode) of wanted a directory of root's with that mode, made where absent with the
    directories above it (0755); MpsError (flags.mpsRoot) where it cannot be done safely.

    They are made and chmodded as root, and what is made in them is mounted into every client pod:
    a directory on the way that a local user owns or can change (an mpsRoot under /tmp that they
    made first), or a symlink there, would have that chmod and those mounts land on a directory
    of their choosing (a resource directory -> /etc). So each is made and chmodded through a
    descriptor, never through a symlink, in a directory root alone can change
    (sources.HostSources: sticky /tmp counts), and must be root's."""
    path = None
    with _host_sources(lambda: path) as sources:
        for path, mode in wanted:
            _make_directory(sources, os.path.normpath(path), mode)


@contextlib.contextmanager
def _host_sources(where):
    """HostSources for the MPS directories, closed after; an untrusted or failed directory as
    MpsError (flags.mpsRoot). where: a callable, the path an OSError without a file name is about."""
    from oci_gpu_hook.start.linux.sources import HostSources, UntrustedSource

    sources = HostSources()
    try:
        yield sources
    except UntrustedSource as e:
        raise MpsError(f"flags.mpsRoot: {e.path}: {e.why}: the MPS directories must be root's alone") from None
    except OSError as e:
        raise MpsError(f"flags.mpsRoot: {e.filename or where()}: {e.strerror or e}") from None
    finally:
        sources.close()


def _make_directory(sources, path: str, mode: int) -> None:
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


# --- a resource's generations, each through descriptors of its directory ------------------------


def _open_place(root: str, name: str) -> int:
    """A descriptor (to read and to make entries through) of <root>/<resource>, which
    make_directories made: checked again, as every directory on the way, through descriptors."""
    place = resource_dir(root, name)
    with _host_sources(lambda: place) as sources:
        return _open_directory(".", sources.directory(place))


def _open_directory(name: str, dir_fd: int | None, flags: int = os.O_RDONLY) -> int:
    return os.open(name, flags | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _make(dir_fd: int, name: str, mode: int) -> None:
    """A new directory name in dir_fd, with exactly mode (whatever the umask)."""
    os.mkdir(name, 0o700, dir_fd=dir_fd)
    fd = _open_directory(name, dir_fd)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _mount_tmpfs(dir_fd: int, name: str, mode: str, size: int) -> None:
    """A tmpfs on the directory name in dir_fd (mounted on its descriptor: no path walked again)."""
    from oci_gpu_hook.start.linux import _linux

    target = _open_directory(name, dir_fd, os.O_PATH)
    try:
        flags = _linux.MS_NOSUID | _linux.MS_NODEV | _linux.MS_NOEXEC
        _linux.mount("oci-gpu-hook-mps", f"/proc/self/fd/{target}", "tmpfs", flags, f"mode={mode},size={size >> 10}k")
    finally:
        os.close(target)


def _make_generation(place: int) -> str:
    """A new generation's directory in place (its name): its tmpfs mounted, pipe/, plugin/ and
    shm/ (a tmpfs of its own) made. The name is new (mkdir made it), and so is what is mounted
    there: nothing of an earlier daemon's, nor of a pod's, is in it."""
    import secrets

    for _ in range(16):
        name = GENERATION + secrets.token_hex(6)
        try:
            os.mkdir(name, 0o700, dir_fd=place)
            break
        except FileExistsError:
            continue
    else:
        raise OSError(errno.EEXIST, "no new generation name", GENERATION)
    try:
        _mount_tmpfs(place, name, "0755", IPC_BYTES)  # MPS servers run as their clients' users: 0755
        generation = _open_directory(name, place)
        try:
            _make(generation, "pipe", 0o755)
            _make(generation, "plugin", 0o700)
            _make(generation, "shm", 0o700)
            _mount_tmpfs(generation, "shm", "1777", SHM_BYTES)
        finally:
            os.close(generation)
    except BaseException:
        _remove_generation(place, name)
        raise
    return name


def _generations(place: int) -> list:
    return sorted(n for n in os.listdir(place) if n.startswith(GENERATION))


def _set_aside_old_layout(place: int) -> None:
    """Where an earlier version left a real directory at pipe or shm (pods wrote there), it goes
    out of the way of the links: removed where empty, else renamed to old-<name>-<random> and left
    (pods' files are not walked by root; mpsRoot's /run is emptied at boot)."""
    import secrets

    for name in ("pipe", "shm"):
        try:
            st = os.stat(name, dir_fd=place, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue
        try:
            os.rmdir(name, dir_fd=place)
        except OSError:
            os.rename(name, f"old-{name}-{secrets.token_hex(8)}", src_dir_fd=place, dst_dir_fd=place)


def _link_sockets(daemon: Daemon) -> None:
    """Hard links in the plugin directory to the control sockets the daemon just bound in its pipe
    directory, which no pod has seen yet; at least `control`."""
    generation = _open_directory(daemon.generation, None)
    try:
        pipe, plugin = _open_directory("pipe", generation), _open_directory("plugin", generation)
        try:
            linked = []
            for name in SOCKETS:
                try:
                    st = os.stat(name, dir_fd=pipe, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISSOCK(st.st_mode) and st.st_uid == 0:
                    os.link(name, name, src_dir_fd=pipe, dst_dir_fd=plugin, follow_symlinks=False)
                    linked.append(name)
        finally:
            os.close(pipe)
            os.close(plugin)
    finally:
        os.close(generation)
    if "control" not in linked:
        raise MpsError(f"the MPS daemon for {daemon.resource_name} made no control socket in "
                       f"{daemon_pipe(daemon.generation)}")  # fmt: skip


def _record_process(generation: str, process) -> None:
    if process is None:
        return
    fd = os.open(os.path.join(generation, _PROCESS_FILE),
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)  # fmt: skip
    with os.fdopen(fd, "w") as f:
        f.write(f"{process[0]} {process[1]}\n")


def _recorded_process(place: int, name: str) -> tuple | None:
    """(pid, start ticks) the generation's process file names, if that process still runs."""
    from oci_gpu_hook.start import pids

    try:
        generation = _open_directory(name, place, os.O_PATH)
        try:
            fd = os.open(_PROCESS_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=generation)
        finally:
            os.close(generation)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            numbers = [decimal(v) for v in os.read(fd, 64).decode("ascii", "replace").split()]
        finally:
            os.close(fd)
    except OSError:
        return None
    if len(numbers) != 2 or None in numbers:
        return None
    pid, ticks = numbers
    return (pid, ticks) if pids.is_same_process(pid, ticks) else None


def _publish(place: int, generation: str) -> None:
    """The clients' links name generation's pipe directory and shm (each replaced at once)."""
    for link, target in (("shm", f"{generation}/shm"), ("pipe", f"{generation}/pipe")):
        temporary = f".{link}.new"
        try:
            os.unlink(temporary, dir_fd=place)
        except FileNotFoundError:
            pass
        os.symlink(target, temporary, dir_fd=place)
        os.rename(temporary, link, src_dir_fd=place, dst_dir_fd=place)


def _remove_generation(place: int, name: str) -> None:
    """The generation's tmpfs detached (pods that have its pipe directory or shm keep theirs) and
    its directory removed. Nothing in it is walked: below the mount is the empty directory made
    for it."""
    from oci_gpu_hook.start.linux import _linux

    # By place's descriptor, the generation's name never followed if a link: nothing else is detached.
    for path in (f"/proc/self/fd/{place}/{name}/shm", f"/proc/self/fd/{place}/{name}"):
        for _ in range(8):  # every mount stacked there (one, unless something failed halfway)
            try:
                _linux.umount2(path, _linux.MNT_DETACH | _linux.UMOUNT_NOFOLLOW)
            except OSError:
                break  # none left (EINVAL), or nothing there
    try:
        os.rmdir(name, dir_fd=place)
    except FileNotFoundError:
        pass


def _retire(place: int, name: str, daemon: Daemon) -> None:
    """A generation an earlier plugin left: its daemon stopped if it still runs, then removed."""
    process = _recorded_process(place, name)
    if process is not None:
        _halt(daemon.replace(process=process))
    _remove_generation(place, name)


# --- stopping ----------------------------------------------------------------------------------


def _halt(daemon: Daemon):
    """Send the daemon `quit`; killed if its process is still there after that. What `quit` failed
    with (MpsError), or None."""
    problem = None
    try:
        send(daemon, ["quit"], _QUIT_TIMEOUT)
    except MpsError as e:
        problem = e
    if daemon.process is not None and not _gone(daemon.process, _GONE_WAIT):
        _kill(daemon.process)
    return problem


def _gone(process: tuple, wait: float) -> bool:
    import time

    from oci_gpu_hook.start import pids

    deadline = time.monotonic() + wait
    while pids.is_same_process(*process):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _kill(process: tuple) -> None:
    """SIGKILL to that process (its pidfd: never to another that got its pid)."""
    import signal

    from oci_gpu_hook.start import pids
    from oci_gpu_hook.start.linux import _linux

    try:
        fd = _linux.pidfd_open(process[0])
    except OSError:
        return
    try:
        if pids.is_same_process(*process):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)


def discard(daemon: Daemon) -> None:
    """Remove the generation of a daemon that no longer runs; MpsError when it cannot be."""
    place = _open_place(daemon.root, daemon.resource_name)
    try:
        _remove_generation(place, os.path.basename(daemon.generation))
    except OSError as e:
        raise MpsError(f"removing {daemon.generation}: {e.strerror or e}") from None
    finally:
        os.close(place)


def stop(daemon: Daemon) -> None:
    """Send the daemon `quit` (killed if it does not go) and remove its generation; MpsError, after
    that, when `quit` failed."""
    problem = _halt(daemon)
    discard(daemon)
    if problem is not None:
        raise problem


def _process(daemon: Daemon) -> tuple | None:
    """(pid, start ticks) of the daemon just started, from its pid file; None when the file names
    no process running daemon.program from the host's root.

    The file is read once, right after the daemon wrote it into its new pipe directory, which no
    pod has had yet; still it is read only if it is a regular file (O_PATH first: a device node
    is never opened), and what it names must be the control program (the same file) with the
    plugin's own root (no pod's process, whose root is its container's). From then on the daemon
    is watched through /proc alone (alive)."""
    from oci_gpu_hook.start import files, pids

    path = os.path.join(daemon_pipe(daemon.generation), PID_FILE)
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            text = files.read_bounded(f"/proc/self/fd/{fd}", 32, regular=True)
            pid = decimal(text.decode("ascii", "replace").strip())
        finally:
            os.close(fd)
        if pid is None:
            return None
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
        self.say = say

    def sync(self, resources, inventory) -> None:
        wanted = {r.name: r for r in resources if r.mps_root}
        for name in [n for n in self.running if n not in wanted or self._changed(wanted[n])]:
            self._stop(name)
        for name, resource in wanted.items():
            if name not in self.running:
                self.running[name] = start(resource, inventory)
                self.say(f"{name}: MPS daemon started ({self.running[name].generation}; "
                         f"{'; '.join(self.running[name].commands)})")  # fmt: skip
                if self.running[name].process is None:
                    self.say(f"{name}: the MPS daemon's {PID_FILE} names no process of {self.running[name].program}: "
                             "if the daemon dies, it is not started again")  # fmt: skip

    def lost(self) -> bool:
        """Forget the daemons that died (killed, crashed, or told `quit` by a client) and remove
        their generations: the next sync() starts them again, in new ones, as their clients need
        them. True when there were any."""
        dead = [name for name, daemon in self.running.items() if not alive(daemon)]
        for name in dead:
            daemon = self.running.pop(name)
            self.say(f"{name}: the MPS daemon is gone ({daemon.generation}): starting it again")
            try:
                discard(daemon)
            except MpsError as e:
                self.say(f"{name}: {e.message}")
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
