"""Attacks on the start server's newest checks (start/server.py, start/csrc/prefilter.c; docs/security.md,
"The start server (issue 41): threat model"), each with a real server on a socket of the test's own and
real processes offering to it:
- a uid-0 process whose capabilities were dropped (all of them, through a read-only bind of the
  socket's directory in a mount namespace of its own, as a container's root given a view of /run;
  or one of them, in the server's namespace) borrows none of the server's: "not taken", its
  capability reason in the server's log, no worker forked, nothing of the hook run;
- a process with every capability in another mount namespace: "not taken", the namespace reason;
- the replies: a taken offer hears "a", then "v" and the exit status; an offer queued in a server
  that stops (or is killed) before accepting it hears nothing, and its start is Python's, never 70;
- a pre-filter with any OCI_GPU_HOOK_ variable in its environment offers nothing;
- SIGINT to a waiting spare worker ends that spare alone: the server and its socket go on;
- a worker killed mid-start: the pre-filter's one line and exit 70, the worker and the signal in
  the server's log.
The peer checks run on two kernels' ways: with SO_PEERPIDFD, and as on a kernel without it (RHEL
9's 5.14), checked by pid alone (KERNELS): a good peer is taken and each bad one refused on both.
Each server is stopped by its pid (startservercheck.Server); the socket is in a directory of root's.
"""

from __future__ import annotations

import array
import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys

import hookcheck
import pytest
import startservercheck

from oci_gpu_hook.errors import Exit
from oci_gpu_hook.start import prefilter_rule, server
from oci_gpu_hook.start.apply import FAULT_ENV
from oci_gpu_hook.toolkit import prefilter
from oci_gpu_hook.toolkit.install import interpreter_command

STRICT = ("-Werror",)
HANG_GUARD = 60  # seconds: each wait below ends within one in a working run
STUB_EXIT = 42
# The Python hook of the stub pre-filter: says it ran, with which arguments, and gives back the state
# it was handed (so that the state is seen to come from its first byte).
STUB_HOOK = f'#!/bin/sh\necho "python hook: $*" >&2\ncat\nexit {STUB_EXIT}\n'
DROP_ALL = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
CAP_SYS_ADMIN = 21
# A container's root given a view of the socket's directory: a mount namespace of its own in which
# that directory is bound read-only (that it is, checked), then its capabilities dropped.
READ_ONLY_VIEW = ('mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && ! touch "$1/probe" 2>/dev/null '
                  '&& shift && exec "$@"')  # fmt: skip
OWN_MOUNT_NAMESPACE = ["unshare", "--mount", "--propagation", "private"]
WITHOUT_VERDICT = (b"oci-gpu-hook: the start server's worker ended without a verdict (killed?); the server's log "
                   b"says why (journalctl -u oci-gpu-hook-start.service)\n")  # fmt: skip


@pytest.fixture(scope="module")
def place(require):
    """The module's directory (root's, 0700): the pre-filters, and sock/ (root's, 0700) their socket."""
    require("root", "gcc", "setpriv", "unshare")
    with startservercheck.socket_directory() as top:
        os.mkdir(os.path.join(top, "sock"), 0o700)
        yield top


@pytest.fixture(scope="module")
def socket_path(place):
    return os.path.join(place, "sock", "start.sock")


@pytest.fixture(scope="module")
def stub(place, socket_path):
    """A pre-filter offering to socket_path in front of STUB_HOOK."""
    hook = os.path.join(place, "python-hook")
    with open(hook, "w") as f:
        f.write(STUB_HOOK)
    os.chmod(hook, 0o700)
    return prefilter.build(os.path.join(place, "stub"), hook, start_server=socket_path, flags=STRICT)


@pytest.fixture(scope="module")
def real(place, socket_path):
    """A pre-filter offering to socket_path in front of this checkout's Python hook."""
    return startservercheck.prefilter(os.path.join(place, "real"), socket_path, STRICT)[0]


# The kernels the peer check has a branch for: with SO_PEERPIDFD (Linux 6.5), and without it
# (RHEL 9's 5.14: ENOPROTOOPT), where the server reads procfs by the pid alone. The second is
# forced on this kernel as rootfs's tests force the walk of kernels without openat2: the server's
# module told at its start that the option is missing (server._peerpidfd_works False).
KERNELS = ["SO_PEERPIDFD", "before-6.5"]


def server_command(socket_path: str, kernel: str) -> list | None:
    """The server's command line on that kernel (None: startservercheck's own)."""
    if kernel == "SO_PEERPIDFD":
        return None
    forced = (f"import sys; sys.path.insert(0, {launcher_parent()!r}); from oci_gpu_hook.start import server; "
              "server._peerpidfd_works = False; from oci_gpu_hook.hook import main; sys.exit(main())")  # fmt: skip
    return [sys.executable, "-I", "-c", forced, prefilter_rule.START_SERVER, "--socket", socket_path]


@pytest.fixture
def running(socket_path, tmp_path, request):
    """A server of the test's own; parametrized indirectly with a kernel of KERNELS, one that
    checks its peers as on that kernel (default: this kernel's own way)."""
    kernel = getattr(request, "param", "SO_PEERPIDFD")
    command = server_command(socket_path, kernel)
    with startservercheck.Server(tmp_path / "server.log", socket_path, command=command).wait_listening() as listening:
        yield listening


# --- processes, as procfs shows them ------------------------------------------------------------


def effective_caps(pid) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))


def wait_for(what: str, test):
    """test()'s first true value; fails after HANG_GUARD seconds."""
    return startservercheck.wait_until(what, test, HANG_GUARD)


def the_spare(running: startservercheck.Server) -> int:
    """The server's spare worker, once it waits (asleep) for an offer."""
    return startservercheck.spare(running)


def socket_inodes(pid: int) -> set:
    return startservercheck.held(pid, "socket")


def waits_for_a_reply(pid: int) -> bool:
    """The pre-filter pid has connected and sent its offer: its socket is connected (/proc/net/unix:
    state 03) and it sleeps, which after connect it does only in recv (its sendmsg cannot block on a
    new connection's empty queue)."""
    inodes = socket_inodes(pid)
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f][1:]
    return any(row[6] in inodes and row[5] == "03" for row in rows) and startservercheck.process_state(pid) == "S"


@contextlib.contextmanager
def offering(argv: list, data: bytes, directory):
    """argv (a pre-filter, and what is put in front of it) started as a runtime starts the hook, its
    state data in a file (as runc passes it); yields the Popen, killed by its pid if still there."""
    with open(os.path.join(str(directory), "state"), "wb") as f:
        f.write(data)
    with open(os.path.join(str(directory), "state"), "rb") as state:
        offered = subprocess.Popen(argv, stdin=state, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env=startservercheck.ENV)  # fmt: skip
    try:
        yield offered
    finally:
        if offered.poll() is None:
            offered.kill()
        offered.communicate()


def killed_lines(running: startservercheck.Server) -> list:
    return [line for line in running.log() if " was killed by signal " in line]


# --- who may offer: capabilities, the mount namespace -------------------------------------------


LACKS_CAPS = "it lacks capabilities the worker would use (its effective {:#x}, the server's {:#x})"
OTHER_NAMESPACE = "it is in another mount namespace than the server (its bundle and configuration are named in its own)"
OTHER_USER_NAMESPACE = "it is in another user namespace than the server (its capabilities are not the host's)"


def in_front(case: str, socket_path: str) -> tuple:
    """(the command put in front of the pre-filter, its effective capabilities as a function of
    the server's, the reason the server must give) for each kind of peer."""
    own_view = [*OWN_MOUNT_NAMESPACE, "sh", "-c", READ_ONLY_VIEW, "sh", os.path.dirname(socket_path)]
    drop_one = ["setpriv", "--bounding-set=-sys_admin", "--no-new-privs", "--"]
    return {
        "no-capabilities-read-only-view": ([*own_view, *DROP_ALL], lambda own: 0, LACKS_CAPS),
        "no-capabilities": (DROP_ALL, lambda own: 0, LACKS_CAPS),
        "no-cap_sys_admin": (drop_one, lambda own: own & ~(1 << CAP_SYS_ADMIN), LACKS_CAPS),
        "another-mount-namespace": (OWN_MOUNT_NAMESPACE, None, OTHER_NAMESPACE),
        # uid_map "0 0 1": root there is the host's uid 0, and procfs shows it every capability,
        # of its own namespace only; the server's mount namespace, so only the user's tells.
        "user-namespace-root": (["unshare", "--user", "--map-root-user"], None, OTHER_USER_NAMESPACE),
    }[case]


@pytest.mark.parametrize("running", KERNELS, indirect=True)
@pytest.mark.parametrize("case", ["no-capabilities-read-only-view", "no-capabilities", "no-cap_sys_admin",
                                  "another-mount-namespace", "user-namespace-root"])  # fmt: skip
def test_a_root_peer_that_lacks_what_a_worker_has_is_not_taken(host, stub, socket_path, running, tmp_path, case):
    """uid 0 is not enough: its offer is answered "not taken" and its start is Python's (the stub
    hook's, from the state's first byte); the server's log gives the reason with the peer's pid;
    the spare worker is still the one that waited before (no worker forked), and no hook ran (no
    log record)."""
    front, caps_of, why = in_front(case, socket_path)
    config = startservercheck.config(host, tmp_path)
    data = startservercheck.gpu_error_state(tmp_path)
    spare = the_spare(running)
    own = effective_caps(running.pid)
    with offering([*front, stub, "--config", config, "prestart"], data, tmp_path) as offered:
        out, err = offered.communicate(timeout=HANG_GUARD)
    assert (offered.returncode, err, out) == (STUB_EXIT, f"python hook: --config {config} prestart\n".encode(), data)
    if caps_of is not None:
        why = why.format(caps_of(own), own)
    assert running.refusals() == [f"an offer from pid {offered.pid}: {why}"]  # unshare, sh, setpriv exec it
    assert the_spare(running) == spare
    assert startservercheck.log_records(config) == []


# --- the replies --------------------------------------------------------------------------------


def replies(path: str, data: bytes, fds) -> list:
    """Send an offer by hand, and fds with "go" once it is taken (as a pre-filter that heard "taken"
    in time); every message the server sends back, to its end (b"")."""
    got = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(HANG_GUARD)
        s.connect(path)
        s.send(data)
        while not got or got[-1]:
            got.append(s.recv(16))
            if got[-1] == server.TAKEN:
                s.sendmsg([server.GO], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    return got


@pytest.mark.parametrize("running", KERNELS, indirect=True)
def test_a_taken_offer_hears_taken_then_the_verdict(host, socket_path, running, tmp_path):
    """b"a" once a worker has it, then (after b"g" and the descriptors) b"v" and the Python hook's
    own exit status, then the end; the worker's line on the offer's stderr, as the Python hook says it.
    The peer (this test's process: root, every capability, the server's namespaces) is taken on
    either kernel's check."""
    config = startservercheck.config(host, tmp_path)
    data = startservercheck.gpu_error_state(tmp_path)
    alone = startservercheck.python_hook(config, data)
    state = startservercheck.state_memfd(data)
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    try:
        got = replies(socket_path, startservercheck.payload("--config", config, "prestart"), [state, out_w, err_w])
        for fd in (out_w, err_w):
            os.close(fd)
        out, err = os.read(out_r, 1 << 16), os.read(err_r, 1 << 16)
    finally:
        for fd in (state, out_r, err_r):
            os.close(fd)
    assert alone.returncode == Exit.REQUEST and hookcheck.one_clear_line(alone.stderr)
    assert got == [server.TAKEN, server.VERDICT + bytes([alone.returncode]), b""]
    assert (out, err) == (alone.stdout, alone.stderr)
    assert [r.get("via") for r in startservercheck.log_records(config)] == [None, "start server"]


@pytest.mark.parametrize("then, running", [("sigcont", "SO_PEERPIDFD"), ("sigcont", "before-6.5"),
                                           ("sigterm", "SO_PEERPIDFD"), ("sigkill", "SO_PEERPIDFD")],
                         indirect=["running"])  # fmt: skip
def test_a_stopped_server_holds_no_start(host, real, socket_path, running, tmp_path, then):
    """The server stopped (SIGSTOP), a pre-filter's offer queued behind its accept: the pre-filter
    waits prefilter_rule.START_SERVER_TAKE_MS for "taken", no more, and the start is the Python hook's own,
    whole (the same status and line, no "via"), while the server is still stopped; never exit 70.
    Then the server continues (and takes the queued connection, whose offerer is gone: nothing
    is run for it), or is stopped by SIGTERM, or killed: no second start either way."""
    config = startservercheck.config(host, tmp_path)
    data = startservercheck.gpu_error_state(tmp_path)
    alone = startservercheck.python_hook(config, data)
    the_spare(running)
    os.kill(running.pid, signal.SIGSTOP)
    try:
        wait_for("stopped server", lambda: startservercheck.process_state(running.pid) == "T")
        with offering([real, "--config", config, "prestart"], data, tmp_path) as offered:
            out, err = offered.communicate(timeout=HANG_GUARD)
        assert startservercheck.process_state(running.pid) == "T", "the start waited for the server"
        if then == "sigterm":
            os.kill(running.pid, signal.SIGTERM)  # pending when it continues
    finally:
        os.kill(running.pid, signal.SIGKILL if then == "sigkill" else signal.SIGCONT)
    try:
        if then == "sigcont":
            gone = f"an offer from pid {offered.pid}: "
            wait_for("the late connection refused", lambda: any(r.startswith(gone) for r in running.refusals()))
            assert running.proc.poll() is None
        else:
            assert running.proc.wait(HANG_GUARD) == (0 if then == "sigterm" else -signal.SIGKILL)
    finally:
        if then == "sigkill" and os.path.lexists(socket_path):
            os.unlink(socket_path)  # a killed server's socket, left behind
    assert (offered.returncode, err, out) == (alone.returncode, alone.stderr, alone.stdout)
    assert [r.get("via") for r in startservercheck.log_records(config)] == [None, None]


def test_a_late_taken_starts_nothing(host, real, running, tmp_path):
    """The spare worker stopped (SIGSTOP) when the server hands it an offer: it cannot say "taken"
    in time, and the start is the Python hook's. Continued, it says "taken" to a pre-filter that
    has given up: no "go" comes, and it exits having done nothing (no second log record, no
    verdict anywhere, not killed)."""
    config = startservercheck.config(host, tmp_path)
    data = startservercheck.gpu_error_state(tmp_path)
    alone = startservercheck.python_hook(config, data)
    spare = the_spare(running)
    os.kill(spare, signal.SIGSTOP)
    try:
        fronted = startservercheck.run(real, config, data)
    finally:
        os.kill(spare, signal.SIGCONT)
    assert (fronted.returncode, fronted.stderr, fronted.stdout) == (alone.returncode, alone.stderr, alone.stdout)
    wait_for("the late spare gone", lambda: spare not in startservercheck.children(running.pid))
    assert [r.get("via") for r in startservercheck.log_records(config)] == [None, None]
    assert killed_lines(running) == [] and running.refusals() == []


@contextlib.contextmanager
def no_forks(pid: int):
    """pid alone in a cgroup of its own whose pids.max is 1: it can fork nothing. Moved back to
    where it was, and the cgroup removed, afterwards."""
    with startservercheck.own_cgroup(pid, "pids") as cgroup:
        with open(os.path.join(cgroup, "pids.max"), "w") as f:
            f.write("1")
        yield


def test_a_server_that_cannot_fork_passes_its_starts_to_python(host, real, running, tmp_path):
    """pids.max reached: the spare forked before takes one start; the next finds no spare and no
    worker can be forked: "not taken", and the start is the Python hook's own, never 70."""
    config = startservercheck.config(host, tmp_path)
    data = startservercheck.gpu_error_state(tmp_path)
    alone = startservercheck.python_hook(config, data)
    the_spare(running)
    with no_forks(running.pid):
        first = startservercheck.run(real, config, data)
        second = startservercheck.run(real, config, data)
    for done in (first, second):
        assert (done.returncode, done.stderr, done.stdout) == (alone.returncode, alone.stderr, alone.stdout)
    assert [r.get("via") for r in startservercheck.log_records(config)] == [None, "start server", None]
    assert running.refusals() == ["no worker for it"]
    assert any(line.startswith("oci-gpu-hook start-server: cannot fork") for line in running.log()), running.log()


IDLE = """
import os, socket, sys, time
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(sys.argv[1])
    held.append(s)
print("connected", flush=True)
sys.stdin.read()  # until the test is done
for s in held:
    s.settimeout(10)
    print(s.recv(16).decode() or "-", flush=True)
"""


@pytest.mark.parametrize("who", ["root", "no-capabilities"])
def test_idle_connections_hold_no_start(live_container, real, socket_path, running, tmp_path, who):
    """20 connections that never offer (root's, or a capability-less uid 0's: a container's root
    given /run), then a GPU start with deadline_seconds 3: it is served ("via": "start server")
    and gets its GPU. A server that waited for each connection's offer before it looked at the
    next (1 s each) made such a start fail with "the hook's deadline passed". The stranger's are
    answered "not taken" at accept, before anything of theirs is read; root's once they had their
    moment."""
    container = live_container(startservercheck.GPU_ENV)
    config = startservercheck.config(container[4], tmp_path, "deadline_seconds: 3\n")
    front = DROP_ALL if who == "no-capabilities" else []
    idle = subprocess.Popen([*front, sys.executable, "-I", "-c", IDLE, socket_path, "20"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert idle.stdout.readline() == "connected\n"
        served = startservercheck.run(real, config, container[0].encode())
        out, _ = idle.communicate("", timeout=HANG_GUARD)
    finally:
        if idle.poll() is None:
            idle.kill()
            idle.communicate()
    assert (served.returncode, served.stderr) == (0, b""), served.stderr
    (record,) = startservercheck.log_records(config)
    assert (record["message"], record["via"]) == ("GPU devices configured", "start server"), record
    assert any(m[0].endswith("/dev/nvidia0") for m in hookcheck.mountinfo(container[2]))
    assert out.split() == ["p"] * 20
    if who == "no-capabilities":
        assert len(running.refusals()) == 20 and all(LACKS_CAPS.split(" (")[0] in r for r in running.refusals())
    else:
        assert running.refusals() == ["no offer came within the time a pre-filter waits"] * 20


BLOCKING_STATE = """
import array, os, socket, sys
from oci_gpu_hook.start.linux import _linux
_linux.unshare(0x20000)  # CLONE_NEWNS: tracefs mounted here alone
_linux.mount("none", "/", None, 0x40000 | 0x4000)  # MS_PRIVATE | MS_REC
top = sys.argv[2]  # the test's own directory: nothing is left in /tmp
_linux.mount("nodev", top, "tracefs", 0)
fd = os.open(os.path.join(top, "trace_pipe"), os.O_RDONLY)
channel = socket.socket(fileno=int(sys.argv[1]))
channel.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
"""


def test_a_state_whose_read_blocks_holds_no_worker(host, socket_path, running, tmp_path):
    """A root peer (every capability, the server's namespaces) offers tracefs' trace_pipe as its
    state: a regular file whose read blocks. The worker's kill timer, armed before the read, ends
    it: "taken", then the end without a verdict, and the worker killed by SIGKILL in the log."""
    config = startservercheck.config(host, tmp_path)
    (tmp_path / "tracefs").mkdir()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with ours, theirs:
        done = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {launcher_parent()!r})\n"
                               + BLOCKING_STATE, str(theirs.fileno()), str(tmp_path / "tracefs")],
                              pass_fds=[theirs.fileno()],
                              capture_output=True, timeout=HANG_GUARD)  # fmt: skip
        assert done.returncode == 0, done.stderr
        fds = array.array("i")
        _, ancillary, _, _ = ours.recvmsg(1, socket.CMSG_SPACE(fds.itemsize))
        fds.frombytes(ancillary[0][2])
    (state,) = fds
    assert stat.S_ISREG(os.fstat(state).st_mode)
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    try:
        got = replies(socket_path, startservercheck.payload("--config", config, "prestart"), [state, out_w, err_w])
    finally:
        for fd in (state, out_r, out_w, err_r, err_w):
            os.close(fd)
    assert got == [server.TAKEN, b""]
    wait_for("the worker reaped", lambda: killed_lines(running))
    (line,) = killed_lines(running)
    assert line.endswith(f"was killed by signal {signal.SIGKILL.value}")
    assert startservercheck.log_records(config) == []


def launcher_parent() -> str:
    from oci_gpu_hook.toolkit import launcher

    return launcher.package_parent()


# --- the pre-filter's environment ---------------------------------------------------------------


@pytest.mark.parametrize("variable", ["OCI_GPU_HOOK_DEBUG=1", "OCI_GPU_HOOK_NOT_A_SETTING="])
def test_a_prefilter_with_a_hook_variable_offers_nothing(host, real, running, tmp_path, variable):
    """A worker has the server's environment, not the pre-filter's: with any OCI_GPU_HOOK_
    variable set (even empty, even one the hook does not know), the start is the Python hook's in
    that environment; the server takes nothing (its spare still waiting, nothing in its log)."""
    name, _, value = variable.partition("=")
    config = startservercheck.config(host, tmp_path)
    data = startservercheck.gpu_error_state(tmp_path)
    spare = the_spare(running)
    alone = startservercheck.run(interpreter_command(), config, data, {name: value})
    fronted = startservercheck.run(real, config, data, {name: value})
    assert alone.returncode == Exit.REQUEST and hookcheck.one_clear_line(alone.stderr)
    assert (fronted.returncode, fronted.stderr, fronted.stdout) == (alone.returncode, alone.stderr, alone.stdout)
    assert [r.get("via") for r in startservercheck.log_records(config)] == [None, None]
    assert the_spare(running) == spare
    assert running.log()[1:] == []


# --- signals to the server's children -----------------------------------------------------------


@pytest.mark.parametrize("spare_kind", ["cold", "warm"])
def test_sigint_to_a_waiting_spare_ends_that_spare_alone(host, real, socket_path, running, tmp_path, spare_kind):
    """An operator's SIGINT (or a terminal's) to the spare: it dies of it, as a hook's process
    would, without running any of the server's code (which removes the socket on its way out);
    the server logs it and goes on, on the same socket file, taking the next start. cold: the
    spare forked at the server's start; warm: one forked after a start, warmed with its settings."""
    config = startservercheck.config(host, tmp_path)
    data = startservercheck.gpu_error_state(tmp_path)
    first = the_spare(running)
    if spare_kind == "warm":
        startservercheck.run(real, config, data)
        wait_for("new spare", lambda: the_spare(running) != first)
    spare = the_spare(running)
    identity = os.lstat(socket_path).st_ino
    os.kill(spare, signal.SIGINT)
    wait_for("spare reaped", lambda: spare not in startservercheck.children(running.pid))
    assert running.proc.poll() is None
    assert os.path.lexists(socket_path), "the server's socket was removed"
    assert os.lstat(socket_path).st_ino == identity
    alone = startservercheck.python_hook(config, data)
    served = startservercheck.run(real, config, data)
    assert (served.returncode, served.stderr, served.stdout) == (alone.returncode, alone.stderr, alone.stdout)
    assert startservercheck.log_records(config)[-1]["via"] == "start server"
    # The server reaped the spare in its SIGCHLD handler, which logs before it returns: done, since
    # the server has served a start since.
    line = f"oci-gpu-hook start-server: worker {spare} was killed by signal {signal.SIGINT.value}"
    assert killed_lines(running) == [line]
    assert running.refusals() == []


def test_a_worker_killed_mid_start_is_one_line_exit_70_and_logged(live_container, real, socket_path, tmp_path):
    """The server's environment reaches its workers: OCI_GPU_HOOK_FAULT_AT=1:kill there makes the
    worker SIGKILL itself at the plan's first operation, after "taken". The pre-filter never runs
    Python then: its one line and exit 70; the server's log names that worker (the spare that took
    the start) and the signal."""
    container = live_container(startservercheck.GPU_ENV)
    config = startservercheck.config(container[4], tmp_path)
    pending = os.path.join(container[4]["root"], "pending")  # the journals of the host, which later tests share
    before = set(os.listdir(pending)) if os.path.isdir(pending) else set()
    env = {**startservercheck.ENV, FAULT_ENV: "1:kill"}
    with startservercheck.Server(tmp_path / "server.log", socket_path, env=env).wait_listening() as running:
        spare = the_spare(running)
        done = startservercheck.run(real, config, container[0].encode())
        # The pre-filter hears the end when the worker's descriptors close, before the server is
        # told: stopped once it has reaped the worker (in the handler that logs it).
        wait_for("worker reaped", lambda: spare not in startservercheck.children(running.pid))
    line = f"oci-gpu-hook start-server: worker {spare} was killed by signal {signal.SIGKILL.value}"
    assert killed_lines(running) == [line]
    assert running.refusals() == []
    assert (done.returncode, done.stdout, done.stderr) == (Exit.INTERNAL, b"", WITHOUT_VERDICT)
    assert [r.get("via") for r in startservercheck.log_records(config)] == []
    # The killed start's journal, left as a killed hook leaves one (the next start of that rootfs
    # recovers it: tests/reliability/test_killed_hook.py); taken away, so that the host is left as
    # found (a test that runs later and asserts that no journal is left would see this one).
    left = set(os.listdir(pending)) - before
    assert len(left) == 1, left
    for name in left:
        os.unlink(os.path.join(pending, name))
