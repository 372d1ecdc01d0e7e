"""The start server (start/server.py) run as a program of the test's own, on a socket in a private
directory, stopped by its pid; the pre-filters that offer it starts (start/csrc/prefilter.c); and
offers written by hand. Shared by tests/start/test_server.py (the server's side),
tests/toolkit/test_prefilter.py (the pre-filter's) and tests/reliability/test_start_server_faults.py
(a server's faults: the socket as systemd holds it, its processes, its cgroups).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import hookcheck

from oci_gpu_hook.start import prefilter_rule
from oci_gpu_hook.start.digits import decimal

# As a unit would run it: this interpreter and this checkout, isolated, in the hooks' environment.
CHECKOUT = hookcheck.checkout_command()
COMMAND = [*CHECKOUT, prefilter_rule.START_SERVER]
ENV = hookcheck.HOOK_ENV
LISTENING = "oci-gpu-hook start-server: listening on "
NOT_TAKEN = "oci-gpu-hook start-server: not taken: "
STOPPED = "oci-gpu-hook start-server: stopped"
GPU_ERROR_ENV = ["NVIDIA_VISIBLE_DEVICES=7"]  # two simulated GPUs: refused by the plan, nothing done
GPU_ENV = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "utility,compute"}


@contextlib.contextmanager
def socket_directory():
    """A directory of root's, mode 0700, for the test's socket and programs: in /tmp itself (a
    socket's path has 108 bytes, and pytest's directories can be longer), removed after."""
    top = tempfile.mkdtemp(prefix="ogh-start-", dir="/tmp")
    try:
        yield top
    finally:
        shutil.rmtree(top)


class Server:
    """`oci-gpu-hook start-server` as a process of the test's own; its log (its stderr) in a file.
    command: another command line (socket activation puts a shell in front); popen: more of
    Popen's arguments (stdin: the socket systemd would pass)."""

    def __init__(self, log_path, socket_path=None, command=None, env=None, **popen):
        self.log_path = str(log_path)
        argv = command or [*COMMAND, "--socket", socket_path]
        popen.setdefault("stdin", subprocess.DEVNULL)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env=env or ENV, **popen)
        self.pid = self.proc.pid

    def log(self) -> list:
        with open(self.log_path) as f:
            return f.read().splitlines()

    def refusals(self) -> list:
        return [line[len(NOT_TAKEN) :] for line in self.log() if line.startswith(NOT_TAKEN)]

    def wait_listening(self, timeout: float = 60) -> Server:
        return self.wait_for(LISTENING, timeout)

    def wait_for(self, start: str, timeout: float = 60) -> Server:
        """Once its log has a line that starts so (timeout: a hang guard, it takes milliseconds)."""
        deadline = time.monotonic() + timeout
        while not any(line.startswith(start) for line in self.log()):
            if self.proc.poll() is not None:
                raise AssertionError(f"the start server exited ({self.proc.returncode}): {self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the start server did not log {start!r} within {timeout} s: {self.log()}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM by its pid; its exit status."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the start server did not stop on SIGTERM within {timeout} s") from None

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def as_its_unit_runs(command: list) -> list:
    """command (a server's) at the scheduling priority its systemd unit gives it (Nice=, in the
    text install writes), as a test or the bench that starts a server without systemd runs it."""
    from oci_gpu_hook.toolkit import install

    unit = install.start_service_text(["x"]).splitlines()
    (nice,) = [line[len("Nice=") :] for line in unit if line.startswith("Nice=")]
    return ["nice", "-n", nice, *command]


def started(socket_path, log_path) -> Server:
    """A server listening on socket_path: a context manager that stops it."""
    return Server(log_path, socket_path).wait_listening()


def prefilter(directory, socket_path, flags=()) -> tuple:
    """(a pre-filter offering to socket_path, the launcher of this checkout it runs otherwise)."""
    os.makedirs(str(directory), exist_ok=True)
    return hookcheck.prefilter_for_this_checkout(directory, start_server=str(socket_path), flags=tuple(flags))


def config(host, directory, extra: str = "") -> str:
    """The simulated host's configuration with a log file and a records directory of the test's
    own (directory/hook.log, directory/records), and the YAML lines extra."""
    directory = str(directory)
    own = f"logging: {{level: info, file: {directory}/hook.log}}\nrecords_directory: {directory}/records\n"
    return hookcheck.config_with(host, directory, own + extra)


def log_records(config_path: str) -> list:
    """The records the hook wrote to the log file of config(...), oldest first."""
    path = os.path.join(os.path.dirname(config_path), "hook.log")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def container_records(config_path: str) -> list:
    directory = os.path.join(os.path.dirname(config_path), "records")
    found = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        with open(os.path.join(directory, name)) as f:
            found.append(json.load(f))
    return found


def gpu_error_state(directory) -> bytes:
    """The state of a container (its bundle in directory) asking for a GPU the host does not have:
    the hook refuses it at its plan, before the container is touched."""
    bundle = os.path.join(str(directory), "bundle")
    os.makedirs(bundle, exist_ok=True)
    doc = {"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {"args": ["sh"], "env": GPU_ERROR_ENV}}
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(doc, f)
    state = {"ociVersion": "1.0.2", "id": "refused", "status": "created", "pid": 4242, "bundle": bundle}
    return json.dumps(state).encode()


def run(program, config_path: str, data: bytes, env=None, **kwargs) -> subprocess.CompletedProcess:
    """program (a pre-filter, or the hook's own argv prefix) as a runtime runs the hook."""
    argv = [program] if isinstance(program, str) else list(program)
    return subprocess.run([*argv, "--config", config_path, "prestart"], input=data, capture_output=True,
                          env={**ENV, **(env or {})}, timeout=120, **kwargs)  # fmt: skip


def python_hook(config_path: str, data: bytes) -> subprocess.CompletedProcess:
    """The Python hook alone, as a runtime runs it without a pre-filter."""
    return run(CHECKOUT, config_path, data)


def version() -> str:
    """The version line of an offer to a server of this checkout's code."""
    from oci_gpu_hook.start import server

    return server.version_line(server.code_identity())


def payload(*argv: str, version: str | None = None) -> bytes:
    """An offer's bytes as the pre-filter writes them (version: its first line; this code's)."""
    return b"".join(item.encode() + b"\0" for item in (version or globals()["version"](), *argv))


def offer(socket_path: str, data: bytes, fds=(), go=None) -> bytes:
    """Send an offer by hand (data, descriptors fds with it, as no pre-filter sends them); the
    reply (b"" if the server closed). go: the descriptors to answer "taken" with "go", as a
    pre-filter does in time; then every reply to the end."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(60)  # a hang guard
        s.connect(socket_path)
        try:
            s.sendmsg([data], _rights(fds))
        except BrokenPipeError:
            pass  # answered and closed at accept: the answer is still there to read
        reply = s.recv(16)
        if go is None or reply != b"a":
            return reply
        s.sendmsg([b"g"], _rights(go))
        while True:
            more = s.recv(16)
            reply += more
            if not more:
                return reply


def _rights(fds) -> list:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []


def state_memfd(data: bytes) -> int:
    fd = os.memfd_create("state")
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def held(pid: int, kind: str) -> set:
    """What the process's descriptors of one kind (socket, pipe, mnt, ...) are on: the part of
    each link between the brackets ("socket:[123]" gives "123")."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed while listed
        if link.startswith(f"{kind}:["):
            found.add(link[len(kind) + 2 : -1])
    return found


def pipe_holders(fd: int) -> list:
    """Pids of the processes with a descriptor on the pipe fd is an end of."""
    pipe = str(os.fstat(fd).st_ino)
    holders = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if pipe in held(int(entry), "pipe"):
                holders.append(int(entry))
        except OSError:
            continue  # gone meanwhile
    return holders


@contextlib.contextmanager
def stalled_start(program, host, tmp_path, server: Server, env=None):
    """A start offered to server (program: a pre-filter) whose worker waits: the hook's log is a
    FIFO, which the worker opens to record the refused GPU, and there it waits until the test
    reads. Yields (the pre-filter's Popen, the worker's pid, the FIFO's path); afterwards a worker
    or pre-filter still there is killed by its pid."""
    config_path = config(host, tmp_path)
    fifo = str(tmp_path / "hook.log")
    os.mkfifo(fifo, 0o600)
    (tmp_path / "state").write_bytes(gpu_error_state(tmp_path))
    with open(tmp_path / "state", "rb") as state:
        offered = subprocess.Popen([program, "--config", config_path, "prestart"], stdin=state, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, env={**ENV, **(env or {})})  # fmt: skip
    worker = None
    try:
        deadline = time.monotonic() + 60  # a hang guard
        while worker is None:
            # The worker: the server's child that holds the pre-filter's stderr (the server itself
            # holds it too for a moment, until the worker has it).
            for pid in set(pipe_holders(offered.stderr.fileno())) - {os.getpid(), offered.pid, server.pid}:
                if parent(pid) == server.pid:
                    worker = pid
            assert worker is not None or offered.poll() is None, offered.communicate()
            assert time.monotonic() < deadline, "no worker took the start"
            time.sleep(0.01)
        yield offered, worker, fifo
    finally:
        if worker is not None and parent(worker) in (server.pid, 1):  # its server's, or orphaned
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if offered.poll() is None:
            offered.kill()
        offered.wait()
        offered.stdout.close()
        offered.stderr.close()


def parent(pid: int):
    """pid's parent's pid, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


# --- faults: the socket as systemd holds it, the server's processes and cgroups -----------------

# systemd's socket activation: the socket at descriptor 3, LISTEN_PID the server's own pid (the
# shell's, which exec keeps), LISTEN_FDS their number. The socket comes in as the shell's stdin.
ACTIVATED = 'export LISTEN_PID=$$ LISTEN_FDS="$1"; shift; exec "$@" 3<&0 </dev/null'


def activated(log, listener: socket.socket, count: str = "1", *more, command=None) -> Server:
    """A server started on listener as systemd starts one (socket activation); command: another
    server's command line than this checkout's (a package copy's: package_command)."""
    argv = ["sh", "-c", ACTIVATED, "sh", count, *(command or COMMAND), *more]
    return Server(log, command=argv, stdin=listener.fileno())


@contextlib.contextmanager
def held_socket(path: str):
    """A listening socket at path, as systemd's socket unit holds it (ListenSequentialPacket=,
    Backlog= the server's own): connections queue there whether a server accepts them or not.
    Closed and removed afterwards."""
    from oci_gpu_hook.start import server

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(path)
        listener.listen(server.LISTEN_BACKLOG)
        yield listener
    finally:
        listener.close()
        if os.path.lexists(path):
            os.unlink(path)


def package_copy(directory) -> str:
    """A copy of this checkout's package in directory/oci_gpu_hook, its bytecode left out (an
    install of its own, whose files a test may change); the copy's path."""
    from oci_gpu_hook.toolkit import launcher

    copy = os.path.join(str(directory), "oci_gpu_hook")
    shutil.copytree(os.path.join(launcher.package_parent(), "oci_gpu_hook"), copy,
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    return copy


def package_command(package: str) -> list:
    """The server's command line (as COMMAND) for the package at package (a package_copy)."""
    parent = os.path.dirname(package)
    return [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {parent!r}); "
            "from oci_gpu_hook.hook import main; sys.exit(main())", prefilter_rule.START_SERVER]  # fmt: skip


def children(pid: int) -> list:
    """The pids of pid's children (of a single-threaded process: the server)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [decimal(child) for child in f.read().split()]
    except FileNotFoundError:
        return []  # gone


def process_state(pid: int) -> str:
    """R, S, T, Z, ... ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return ""


def wait_until(what: str, test, timeout: float = 60):
    """test()'s first true value; fails after timeout seconds (a hang guard)."""
    deadline = time.monotonic() + timeout
    while True:
        value = test()
        if value:
            return value
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.01)


def spare(running: Server, besides=()) -> int:
    """The server's spare worker once it waits (asleep) for an offer: its one child asleep, of
    those not in besides (spares the test stopped)."""

    def waiting():
        asleep = [pid for pid in children(running.pid) if pid not in besides and process_state(pid) == "S"]
        return asleep[0] if len(asleep) == 1 else 0

    return wait_until("spare worker waiting", waiting)


def controller_cgroups(pid: int, controller: str) -> tuple:
    """(pid's own cgroup in the controller's hierarchy, the one a test's cgroup is made in): on
    cgroup v1 both are pid's own in the controller's hierarchy; on v2 the second is the nearest
    from pid's own up to the root that enables the controller for its children (a cgroup with
    processes in it other than the root cannot)."""
    from oci_gpu_hook.start.linux import mountinfo

    with open(f"/proc/{pid}/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    unified = None
    for m in mountinfo.read():
        if m.fstype == "cgroup" and controller in m.super_options:
            (path,) = [p for _, names, p in lines if controller in names.split(",")]
            own = os.path.join(m.mountpoint, path.lstrip("/"))
            return own, own
        if m.fstype == "cgroup2":
            unified = m.mountpoint
    if unified is not None:
        own = path = os.path.join(unified, next(p for h, _, p in lines if h == "0").lstrip("/"))
        while True:
            with open(os.path.join(path, "cgroup.subtree_control")) as f:
                if controller in f.read().split():
                    return own, path
            if os.path.samefile(path, unified):
                break
            path = os.path.dirname(path)
    raise AssertionError(f"no cgroup hierarchy with the {controller} controller for a test's cgroup")


@contextlib.contextmanager
def own_cgroup(pid: int, controller: str):
    """pid moved alone into a new cgroup of the controller's (controller_cgroups; its children stay
    where they are); yields the cgroup's directory, to write its limits in. pid is moved back
    while it lives, and the cgroup removed, afterwards."""
    before, parent = controller_cgroups(pid, controller)
    cgroup = os.path.join(parent, f"oci-gpu-hook-test-{os.getpid()}-{pid}")
    os.mkdir(cgroup)
    try:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        try:
            yield cgroup
        finally:
            try:
                with open(os.path.join(before, "cgroup.procs"), "w") as f:
                    f.write(str(pid))
            except ProcessLookupError:
                pass  # it died there (a zombie cannot be moved)
    finally:
        hookcheck.remove_cgroup(cgroup)


def counted(socket_path: str, **wanted) -> dict:
    """The answer to QUERY (server.ask_status) of the server at socket_path once its counts are
    wanted's, or after 60 s (a hang guard): a worker counts once the server has reaped it, moments
    after its pre-filter heard its last word."""
    from oci_gpu_hook.start import server

    deadline = time.monotonic() + 60
    while True:
        status = server.ask_status(socket_path)
        if all(status.get(name) == n for name, n in wanted.items()) or time.monotonic() > deadline:
            return status
        time.sleep(0.01)
