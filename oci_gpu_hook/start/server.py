"""`oci-gpu-hook start-server`: the warm start server the pre-filter offers GPU starts to.

Most of a GPU start in a process of its own is the interpreter's start and the imports, not the
work (docs/performance.md, round 4). This process pays for both once. The pre-filter built with
its socket (`install --start-server`, csrc/prefilter.c: offer_to_server) offers it every start it
would hand to Python, in one SOCK_SEQPACKET message: a version line (the protocol's, and the
identity of the code install built it for) and the hook's arguments. The server checks the
offering process when it connects and the offer when it comes, gives it to a worker and goes back
to listening. The worker gets the pre-filter's three descriptors (the state, its stdout and stderr)
with "go", below. The worker
becomes what the Python hook's process would have been (the same descriptors 0 to 2, the same
arguments, the budget counted from the pre-filter's own start), runs the hook (hook.py) and
replies with its exit status.

Why a worker per start: joining a container's mount namespace takes a process of its own
(single-threaded, not sharing its filesystem context), and a worker that fails, hangs or is
killed by its deadline takes nothing of the server with it. The server itself only accepts,
checks, forks and reaps: it reads no configuration and no inventory (each worker reads them as
the hook does, so an edit or a refresh counts from the next start) and never runs the hook.

Trust (docs/security.md, "The start server"): only root may offer (the socket is root's, mode
0600 in a root directory, and the peer is checked here: uid 0, every capability the server has,
in the server's user, PID and mount namespaces), and the pre-filter only offers to a peer that is
root. An offer the server will not take (another version or code, a command that is not a
runtime's, the wrong descriptors) is answered "not taken" before anything is done, and the
pre-filter starts the Python hook as it would without a server.

No start waits on the server (issue 46). The exchange: the worker, once it holds the offer, says
b"a" (taken); the pre-filter answers b"g" (go), with its three descriptors, only if b"a" came
within prefilter_rule.START_SERVER_TAKE_MS of its connect, and the worker does nothing before b"g"; then
b"v" and the exit status. b"p": not taken. The descriptors travel only with b"g": a runtime waits
for the end of the hook's stdout and stderr, and copies of them queued in a stopped server's
socket would hold it there. So a pre-filter that hears nothing in time (a server stopped, busy, out of workers, or
a late b"a") closes the connection and gives the start to Python, and the worker that would have
had it sees the connection closed instead of b"g" and exits having done nothing.

What became of the offers since the server started (served, taken too late, not taken and why:
Counts) is said, with the identity of the code it serves, to QUERY, which only a peer that
passes the same check at accept() may send (doctor's `start-server` check).
"""

from __future__ import annotations

import array
import errno
import gc
import os
import select
import signal
import socket
import stat
import sys
import time

from oci_gpu_hook.start import prefilter_rule
from oci_gpu_hook.start.digits import decimal
from oci_gpu_hook.start.linux import scm_rights

DEFAULT_SOCKET = prefilter_rule.START_SERVER_SOCKET
# The pre-filter's payload room, and its version line.
MAX_OFFER_BYTES = len(prefilter_rule.START_SERVER_VERSION) + 64 + 8192
DESCRIPTORS = 3  # the state, stdout, stderr
PASS = b"p"
TAKEN = b"a"
GO = b"g"
VERDICT = b"v"
IDENTITY = b"i"  # and the server's code identity and counts: the answer to QUERY (doctor; Counts.answer)
QUERY = f"{prefilter_rule.START_SERVER_VERSION} ?".encode()
ANSWER_MAX_BYTES = 1024  # the answer to QUERY is some 200
VIA = "start server"  # the start's log entry and container record say so (report.VIA)
WARM_AFTER_SECONDS = 0.05
# A warm spare that has waited this long with no offer collects the records of containers that
# are gone (prestart.collect_records), and again after each COLLECT_EVERY_SECONDS of waiting: off
# every start's path, and stopped as soon as an offer comes.
COLLECT_IDLE_SECONDS = 1.0
COLLECT_EVERY_SECONDS = 60.0
WORKER_NICE = 0  # a taken start's worker runs at the niceness of a runtime's hook (_as_a_runtimes_hook)
SPARE_RETRY_SECONDS = 1.0  # after a spare could not be forked (a worker is still forked per offer)
# After accept() failed for want of a descriptor or memory: the listener stays readable, so polling
# it again at once would spin the loop (and log a line each turn) until a descriptor is freed.
ACCEPT_RETRY_SECONDS = 0.1
# A pre-filter sends its offer as it connects and waits prefilter_rule.START_SERVER_TAKE_MS for "taken":
# a connection whose offer has not come by then serves no start.
OFFER_TIMEOUT_SECONDS = prefilter_rule.START_SERVER_TAKE_MS / 1000
GO_TIMEOUT_SECONDS = 5.0  # a worker's wait for "go", far past any pre-filter's wait for "taken"
STATE_READ_SECONDS = 2.0  # a memfd's read; the bound of a state that is no memfd
MAX_DEADLINE_SECONDS = 300  # config.schema.json's largest deadline_seconds
KILL_GRACE_SECONDS = 5.0  # apply's own kill timer's, past the deadline
LISTEN_BACKLOG = 128  # a node starting many containers at once queues them here, not in refusals
MAX_PENDING = LISTEN_BACKLOG  # connections whose offer has not come yet
_SYSTEMD_FIRST_FD = 3  # sd_listen_fds(3): passed sockets start here
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the oci_gpu_hook package
IDENTITY_DIGITS = 16
_BYTECODE = "__pycache__"
_IN_Q_OVERFLOW, _IN_IGNORED, _IN_ISDIR = 0x4000, 0x8000, 0x40000000
_IN_GONE = 0x400 | 0x800 | _IN_IGNORED  # a watched directory removed or moved: IN_DELETE_SELF, IN_MOVE_SELF


class ServerError(Exception):
    """The server cannot listen: one line for its log."""


# Why a start is not taken, in the order the server checks: the process that connects (at
# accept(), before anything it sent is read), its offer, a worker for it. Each is said in the
# server's log as "not taken: " and its line, fields filled in; docs/cli.md lists them all, as
# tests/test_docs.py checks.
NOT_TAKEN = {
    "not root": "an offer from uid {uid} (pid {pid}): only root's are taken",
    "unknown peer": "an offer from pid {pid}: cannot tell who offered ({error})",
    "gone": "an offer from pid {pid}: cannot read what it may do (gone?)",
    # Capabilities are a user namespace's: a root that made its own (uid_map "0 0 1") shows every
    # one of them in procfs, and holds none of the host's.
    "other user namespace": "an offer from pid {pid}: it is in another user namespace than the server "
                            "(its capabilities are not the host's)",
    "other pid namespace": "an offer from pid {pid}: it is in another PID namespace than the server "
                           "(the pid it gave names another process here)",
    "capabilities": "an offer from pid {pid}: it lacks capabilities the worker would use "
                    "(its effective {caps:#x}, the server's {own_caps:#x})",
    "other mnt namespace": "an offer from pid {pid}: it is in another mount namespace than the server "
                           "(its bundle and configuration are named in its own)",
    "too many": "too many connections wait for their offer",
    "no offer": "no offer came within the time a pre-filter waits",
    "unreadable": "cannot read the offer: {error}",
    "too large": "an offer larger than the pre-filter sends",
    "descriptors": "an offer with descriptors (they come with go, once it is taken)",
    "other code": "an offer of another version or code ({head!r}; this server: {version})",
    "unended": "an offer whose arguments do not end",
    "no runtime command": "an offer of a command that is not a runtime's (prestart, createRuntime)",
    "no worker": "no worker for it",
}  # fmt: skip


# Each reason in NOT_TAKEN counts in one class of Counts: the peer's, at accept() ("stranger", "gone"
# among them: a pre-filter that gave up and exited), or the offer's own; those not named here, "other".
NOT_TAKEN_COUNT = {"too many": "too_many", "no offer": "no_offer", "other code": "other_code",
                   "no worker": "no_worker"}  # fmt: skip

# A worker's exit status says what became of its offer, for the server's Counts (a child's end is
# all the server hears of it). Any other end (70 for an error that escaped, a signal) is "lost".
WORKER_SERVED = 0  # it had "go" and ran the hook; the hook's own status went in its verdict
WORKER_LATE = 3  # it said "taken" and no "go" came: the pre-filter had given its start to Python
WORKER_IDLE = 4  # a spare whose server went away before an offer came


class Counts:
    """What the server did since it started, said in its answer to QUERY (doctor): starts served,
    taken too late, workers lost, and the starts not taken, by class. A worker's part is counted
    once it has exited (its exit status: WORKER_SERVED, WORKER_LATE), by the SIGCHLD handler:
    nothing there but adding to an int."""

    NAMES = ("served", "late", "lost", "stranger", "too_many", "no_offer", "other_code", "no_worker", "other")

    def __init__(self):
        self.started = time.monotonic()
        self.n = dict.fromkeys(self.NAMES, 0)

    def ended(self, status: int) -> None:
        """A child (a worker or a spare) reaped with this wait status."""
        code = os.waitstatus_to_exitcode(status)
        name = {WORKER_SERVED: "served", WORKER_LATE: "late", WORKER_IDLE: None}.get(code, "lost")
        if name is not None:
            self.n[name] += 1

    def not_taken(self, key: str) -> None:
        """One start not taken, for NOT_TAKEN's reason key (or "stranger": any at accept())."""
        self.n[key if key == "stranger" else NOT_TAKEN_COUNT.get(key, "other")] += 1

    def answer(self, identity: str) -> bytes:
        """IDENTITY, then words one space apart, ASCII: the code identity, then NAME=N for
        "up" (whole seconds since the server started) and each of NAMES, N in decimal digits
        (docs/cli.md, "start-server"). A reader takes the names it knows and ignores others."""
        counts = " ".join(f"{name}={self.n[name]}" for name in self.NAMES)
        return IDENTITY + f"{identity} up={int(time.monotonic() - self.started)} {counts}".encode()


# A worker's line (on the offer's stderr, exit 70) for a state that is no regular file: the
# pre-filter's is a memfd, and a pipe's read could keep the worker waiting.
STATE_NOT_A_FILE = "internal error: the state the start server was given is not a file"


def not_taken(why: str, **fields) -> str:
    """The line NOT_TAKEN[why] says, with its fields."""
    return NOT_TAKEN[why].format(**fields)


def _log(message: str) -> None:
    # The server's stderr is its log (the journal, under systemd); never a start's: each worker
    # says what it says on the descriptors the pre-filter passed.
    from oci_gpu_hook.errors import printable

    sys.stderr.write(f"oci-gpu-hook start-server: {printable(message)}\n")
    sys.stderr.flush()


# --- listening ----------------------------------------------------------------------------------


def from_systemd() -> socket.socket | None:
    """The socket systemd passed (socket activation: LISTEN_PID is this process, LISTEN_FDS 1),
    or None when it passed none."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()) or os.environ.get("LISTEN_FDS") is None:
        return None
    if os.environ.get("LISTEN_FDS") != "1":
        raise ServerError(f"systemd passed {os.environ['LISTEN_FDS']} sockets; the start server takes one")
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):  # not for the workers' children
        os.environ.pop(name, None)
    listener = socket.socket(fileno=_SYSTEMD_FIRST_FD)
    if listener.family != socket.AF_UNIX or listener.type != socket.SOCK_SEQPACKET:
        raise ServerError("systemd passed a socket that is not a Unix SOCK_SEQPACKET socket (ListenSequentialPacket=)")
    listener.set_inheritable(False)
    return listener


def bind(path: str) -> socket.socket:
    """A listening socket of its own at path, mode 0600, in a directory that is root's and that
    no one else may write (the pre-filter trusts what answers there). A socket that no server
    answers on (one left by a server that was killed) is replaced; a live one is refused."""
    directory = os.path.dirname(path) or "/"
    try:
        st = os.lstat(directory)
    except OSError as e:
        raise ServerError(f"{directory}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise ServerError(f"{directory}: not a directory that root owns and only root may write; "
                          "the start server's socket must be in one")  # fmt: skip
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ServerError(f"{path}: exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # nothing listens: left behind
        except OSError as e:
            raise ServerError(f"{path}: {e.strerror}") from None
        else:
            raise ServerError(f"{path}: another start server listens there")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)  # made 0600: never a moment with more
    try:
        listener.bind(path)
    except OSError as e:
        listener.close()
        raise ServerError(f"{path}: {e.strerror}") from None
    finally:
        os.umask(old)
    listener.listen(LISTEN_BACKLOG)
    return listener


# --- the code it serves -------------------------------------------------------------------------


def code_identity(package: str = PACKAGE) -> str:
    """A digest of the package's Python sources (their paths and bytes): what install compiles into
    the pre-filter's version line, and what a server computes of the code it loaded. A server of
    other code (an upgrade since it started, or a pre-filter built for another) takes no start."""
    import hashlib

    digest = hashlib.sha256()
    for path in _sources(package):
        with open(path, "rb") as f:
            data = f.read()
        digest.update(os.fsencode(os.path.relpath(path, package)) + b"\0" + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:IDENTITY_DIGITS]


def _sources(package: str) -> list:
    found = []
    for directory, dirs, names in os.walk(package):
        dirs[:] = [d for d in dirs if d != _BYTECODE]
        found.extend(os.path.join(directory, n) for n in names if n.endswith(".py"))
    return sorted(found)


class CodeWatch:
    """Whether the package's sources changed since the server loaded them, from inotify: watched
    before the identity is read and the modules are preloaded, so that no change slips between.
    A worker is a fork of the server: it runs the preloaded modules, and imports from the files
    whatever it was not given. After an upgrade in place (pip, a copy) those files are another
    version's, and a start would run a mix of both. So a change ends the server's serving; the
    next start's offer finds a new server (systemd starts one for it) or none (Python's)."""

    def __init__(self, package: str = PACKAGE):
        from oci_gpu_hook.start.linux import _linux

        self.fd = _linux.inotify_init1(_linux.IN_NONBLOCK | _linux.IN_CLOEXEC)
        self.changed = False
        try:
            for directory, dirs, _ in os.walk(package):
                dirs[:] = [d for d in dirs if d != _BYTECODE]
                _linux.inotify_add_watch(self.fd, directory, _linux.IN_CHANGES)
        except BaseException:
            os.close(self.fd)
            raise

    def read(self) -> bool:
        """Drain the events; True once a source (or a directory of sources) changed. Bytecode
        caches written by imports are not changes of the code."""
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return self.changed
            except OSError:
                self.changed = True  # an overflow or a lost watch: the code cannot be vouched for
                return True
            at = 0
            while at + 16 <= len(data):
                mask, length = (
                    int.from_bytes(data[at + 4 : at + 8], sys.byteorder),
                    int.from_bytes(data[at + 12 : at + 16], sys.byteorder),
                )
                name = data[at + 16 : at + 16 + length].rstrip(b"\0")
                at += 16 + length
                if mask & _IN_Q_OVERFLOW or (not name and mask & _IN_GONE):
                    self.changed = True  # events lost, or a watched directory moved or removed
                elif name.endswith(b".py") or (mask & _IN_ISDIR and name != _BYTECODE.encode()):
                    self.changed = True

    def close(self) -> None:
        os.close(self.fd)


# --- who offers ---------------------------------------------------------------------------------


def _peer(conn: socket.socket) -> tuple:
    pid, uid, gid = array.array("i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid, gid


_SO_PEERPIDFD = 77  # Linux 6.5: a pidfd of the peer as it connected (socket.SO_PEERPIDFD from Python 3.13)
_peerpidfd_works = None  # unknown until asked; False on kernels before 6.5 (RHEL 9's 5.14): the pid alone
_NAMESPACES = ("user", "pid", "mnt")


def _caps_and_namespaces(pid) -> tuple:
    """(effective capabilities, {namespace: inode}) of a process, from procfs."""
    namespaces = {name: os.stat(f"/proc/{pid}/ns/{name}").st_ino for name in _NAMESPACES}
    with open(f"/proc/{pid}/status", "rb") as f:
        caps = next(int(line.split()[1], 16) for line in f if line.startswith(b"CapEff:"))
    return caps, namespaces


def peer_lacks(conn: socket.socket) -> str:
    """What the connected process lacks to have a start run by this server ("" when nothing),
    checked at accept(), before anything it sends is read.

    uid 0 is not enough: a worker acts with the server's capabilities, so the peer must hold all of
    them (a container's root with its capabilities dropped, given a view of /run, must not borrow
    them), in the server's user namespace (where those capabilities are the host's), its PID
    namespace (where its pid names it) and its mount namespace (where the worker reads the bundle
    and the configuration the offer names). Read from procfs by the pid the kernel recorded at
    connect time; where the kernel gives a pidfd of the peer, that it is still the same process
    after the reads is checked through it. Only a kernel without SO_PEERPIDFD (ENOPROTOOPT: RHEL
    9's 5.14) gets the check by pid alone (docs/security.md)."""
    global _peerpidfd_works
    pid, uid, _ = _peer(conn)
    if uid != 0:  # the socket's mode keeps others out; this holds even if that mode were changed
        return not_taken("not root", uid=uid, pid=pid)
    pidfd = None
    if _peerpidfd_works is not False:
        try:
            pidfd = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
            _peerpidfd_works = True
        except OSError as e:
            if e.errno != errno.ENOPROTOOPT:  # the kernel knows the option and cannot say who (it exited)
                return not_taken("unknown peer", pid=pid, error=e.strerror)
            _peerpidfd_works = False
    try:
        caps, namespaces = _caps_and_namespaces(pid)
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, 0)  # raises ProcessLookupError: it exited meanwhile
    except (OSError, StopIteration, ValueError):
        return not_taken("gone", pid=pid)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    own_caps, own_namespaces = _caps_and_namespaces("self")
    for name in ("user", "pid"):  # what the capabilities and the pid mean, before they are compared
        if namespaces[name] != own_namespaces[name]:
            return not_taken(f"other {name} namespace", pid=pid)
    if caps & own_caps != own_caps:
        return not_taken("capabilities", pid=pid, caps=caps, own_caps=own_caps)
    if namespaces["mnt"] != own_namespaces["mnt"]:
        return not_taken("other mnt namespace", pid=pid)
    return ""


# --- one offer ----------------------------------------------------------------------------------


class Offer:
    """A checked offer: the hook's arguments, the offering process, and when the server accepted
    its connection (time.monotonic(): the pre-filter's wait for "taken" began a little before).
    Its three descriptors come with "go", to the worker alone (_until_go)."""

    def __init__(self, argv: list, pid: int, accepted: float):
        self.argv, self.pid, self.accepted = argv, pid, accepted


def receive(conn: socket.socket, identity: str, counts: Counts, accepted: float) -> tuple:
    """(Offer or None, why not, its NOT_TAKEN key) from a connection whose peer passed
    peer_lacks() and whose message has come (the read does not wait); accepted: when its
    connection was. An offer carries no descriptor: any that came are closed here. A query
    (doctor) is answered here, with the code identity and counts, and is no offer."""
    try:
        payload, fds, flags = scm_rights.receive(conn, MAX_OFFER_BYTES + 1, DESCRIPTORS, socket.MSG_DONTWAIT)
    except OSError as e:
        return None, not_taken("unreadable", error=e.strerror or e), "unreadable"

    def refuse(key: str, **fields):
        for fd in fds:
            os.close(fd)
        return None, not_taken(key, **fields), key

    if not payload and not fds:
        return None, "", ""  # connected and closed, offering nothing (a second server's probe): no offer
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        return refuse("too large")
    head, _, rest = payload.partition(b"\0")
    if head == QUERY and not rest and not fds:
        _reply(conn, counts.answer(identity))
        return None, "", ""
    if fds:
        # The runtime's pipes, queued unread in a stopped server's socket, would keep the runtime
        # waiting for their end: they go to a worker that has said "taken", with "go".
        return refuse("descriptors")
    if head != version_line(identity).encode():
        return refuse("other code", head=head[:60], version=version_line(identity))
    if not rest.endswith(b"\0"):
        return refuse("unended")
    argv = [os.fsdecode(a) for a in rest[:-1].split(b"\0")]
    if not prefilter_rule.is_runtime_command(argv):
        return refuse("no runtime command")
    return Offer(argv, _peer(conn)[0], accepted), "", ""


def version_line(identity: str) -> str:
    """The first line of every offer to a server of this code (the pre-filter's START_SERVER_VERSION)."""
    return f"{prefilter_rule.START_SERVER_VERSION} {identity}"


def _until_go(conn: socket.socket) -> list | None:
    """In a worker that holds an offer: say "taken", then wait for the pre-filter's "go" and its
    three descriptors (the state, its stdout, its stderr). None when it never comes (the
    pre-filter's wait for "taken" ended first, and the start is Python's): nothing may be done
    then, and nothing was."""
    try:
        conn.setblocking(True)  # the server's copy was not: one open file, shared
        conn.send(TAKEN)
        if not select.select([conn], [], [], GO_TIMEOUT_SECONDS)[0]:
            return None
        message, fds, flags = scm_rights.receive(conn, 2, DESCRIPTORS)
    except OSError:
        return None
    if message == GO and len(fds) == DESCRIPTORS and not flags & socket.MSG_CTRUNC:
        return fds
    for fd in fds:
        os.close(fd)
    return None


def read_state(fd: int = 0) -> bytes:
    """The state the offer carried, at most one byte more than the hook reads: the pre-filter wrote
    it to a memfd before offering, so its read is immediate. A file whose read blocks (tracefs'
    trace_pipe is a regular file) is cut by a kill timer armed before the read."""
    from oci_gpu_hook.start import files
    from oci_gpu_hook.start import state as state_module
    from oci_gpu_hook.start.linux import _linux

    timer = _linux.kill_timer(STATE_READ_SECONDS, signal.SIGKILL)
    try:
        return files.read_up_to(fd, state_module.MAX_STATE_BYTES)
    finally:
        _linux.timer_delete(timer)


def work(conn: socket.socket, offer: Offer) -> None:
    """In a worker: say "taken", wait for "go", become the hook's process for this start, run it,
    reply, exit. Without "go" it exits having done nothing (WORKER_LATE)."""
    taken = time.monotonic()  # _until_go says "taken" first
    fds = _until_go(conn)
    if fds is None:
        # To the server's log (the worker's stderr is still the server's): a pre-filter waits
        # TAKE_MS from its connect, a little before the accept this counts from.
        _log(f"worker {os.getpid()}: taken too late ({(taken - offer.accepted) * 1000:.0f} ms after the server "
             f"accepted its connection; a pre-filter waits {prefilter_rule.START_SERVER_TAKE_MS} ms): no go came, "
             "and its start went to Python")  # fmt: skip
        _exit_worker(WORKER_LATE)
    _as_a_runtimes_hook()
    code = 70
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in the hook's own process
        for target, fd in enumerate(fds):
            os.dup2(fd, target)  # inheritable, as the hook's own 0 to 2 are
        for fd in fds:
            if fd > 2:
                os.close(fd)
        if not stat.S_ISREG(os.fstat(0).st_mode):
            _say(2, STATE_NOT_A_FILE)  # a file's read is bounded: read_state
            return
        import io

        from oci_gpu_hook.errors import exit_status_of
        from oci_gpu_hook.start import budget, prestart, report
        from oci_gpu_hook.start.linux import _linux

        # The budget counts from the pre-filter's start, as it counts from the hook's own
        # process's start without a server: the runtime's clock started there.
        age = budget.process_age(offer.pid)
        started = time.monotonic() - age
        # No runtime's hook timeout stands over a worker (it kills the pre-filter, not this
        # process): a kill timer at the longest budget a configuration may give, from the
        # pre-filter's start, armed before anything of the offer is read. The start's own
        # deadline (apply) is the configured one, within it.
        _linux.kill_timer(max(1.0, MAX_DEADLINE_SECONDS + KILL_GRACE_SECONDS - age), signal.SIGKILL)
        report.VIA = VIA
        config = prefilter_rule.split_config(offer.argv)[0]
        # One line and an exit status whatever happens, as the hook's own process answers (hook.py).
        code = exit_status_of(lambda: prestart.run(config, stdin=io.BytesIO(read_state()), started=started))
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        _let_go_of_the_runtimes_pipes()
        try:
            conn.send(VERDICT + bytes([code & 0xFF]))
        finally:
            _exit_worker(WORKER_SERVED)


def _let_go_of_the_runtimes_pipes() -> None:
    """In a worker that has answered its start, before it replies: its descriptors 0 to 2, the
    pre-filter's (the runtime's pipes), put on /dev/null. A runtime reads its hook's output until
    the end (runc: Go's exec waits for its pipes as well as for the process), so while the worker
    held them the start ended only once the worker's own exit was over (its memory torn down, an
    unused ldconfig helper reaped); now it ends when the pre-filter exits."""
    try:
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        null = None
    for fd in range(3):
        try:
            if null is None:
                os.close(fd)
            else:
                os.dup2(null, fd)
        except OSError:
            pass
    if null is not None:
        os.close(null)


def _exit_worker(status: int) -> None:
    """os._exit, once the ldconfig helper this worker holds unused, if any (Spare._warm), is
    stopped and reaped: nothing of the worker's is left for another process to reap."""
    ldconfig = sys.modules.get("oci_gpu_hook.start.linux.ldconfig")  # imported where one was made
    try:
        if ldconfig is not None:
            ldconfig.drop_helper()
    finally:
        os._exit(status)


def _as_a_runtimes_hook() -> None:
    """In a worker that has said "taken" and had "go": back to the scheduling priority a hook the
    runtime starts has (nice 0). The server and its spares run ahead of other work (the unit's
    Nice=), so that under load "taken" comes within the pre-filter's wait; the start itself then
    takes its CPU as the runtime's own hook would, and a flood of GPU starts cannot crowd out the
    rest of the node from above. Where the policy refuses it (setsched), the start goes on as is."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) < WORKER_NICE:
            os.setpriority(os.PRIO_PROCESS, 0, WORKER_NICE)
    except OSError:
        pass


def _become_worker(listener: socket.socket, closing=()) -> None:
    """In a freshly forked child: nothing of the server's own is kept (its sockets, its handlers)."""
    listener.close()
    signal.set_wakeup_fd(-1)
    for fd in closing:
        try:
            os.close(fd)
        except OSError:
            pass
    os.umask(0o022)  # what runtimes give their hooks, whatever the server was started with
    for name in ("SIGCHLD", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a spare waits; work() answers a SIGINT as the hook does


def _only_child() -> bool:
    """In a spare: no other worker of its server's runs (the spare is the server's one child), so
    what the spare does while it waits takes no CPU from a start. True where the kernel does not
    list a process's children (CONFIG_PROC_CHILDREN), as before the question was asked."""
    server = os.getppid()
    try:
        with open(f"/proc/{server}/task/{server}/children") as f:
            return f.read().split() == [str(os.getpid())]
    except FileNotFoundError:
        return True
    except OSError:
        return False


class Spare:
    """A worker forked before its offer comes, waiting on its end of a socket pair: the fork (its
    page tables, ~0.5 ms here) is then off the start's path. The server hands it an offer with
    the pre-filter's connection; a spare whose server is gone (the pair's other end closed) exits."""

    def __init__(self, listener: socket.socket, config: str | None = None, warm: bool = False, closing=()):
        """warm: before its offer comes, read the settings of config (the last start's) and the
        inventory they name, once the start that made this spare has had its moment. closing: the
        server's other descriptors, closed in the spare."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            raise
        if pid == 0:
            try:  # nothing raised here may unwind into the server's code (its socket's removal)
                ours.close()
                _become_worker(listener, closing)
                if warm:
                    self._warm(theirs, config)
                self._wait(theirs)  # never returns
            finally:
                _exit_worker(70)
        theirs.close()
        self.pid, self.socket = pid, ours

    @staticmethod
    def _warm(pair: socket.socket, config: str | None) -> None:
        from oci_gpu_hook.start import prestart
        from oci_gpu_hook.start.linux import ldconfig

        # Forked while the previous start's worker runs: on a small machine, reading now would
        # take a CPU from it. So it waits for a quiet moment: WARM_AFTER_SECONDS with no offer,
        # and no other worker of the server's running. Under load there is none, and each offer
        # is served cold: one that came to a spare still warming would wait for it, behind every
        # busy worker, past the pre-filter's wait for "taken" (issue 51's load test: a warm took
        # up to 1.7 s there, and its offer went to Python).
        while True:
            if select.select([pair], [], [], WARM_AFTER_SECONDS)[0]:
                return
            if _only_child():
                break
        prestart.warm(config)
        if not select.select([pair], [], [], 0)[0]:  # still quiet: its start would wait on none of this
            ldconfig.hold_helper(WORKER_NICE)
        wait = COLLECT_IDLE_SECONDS
        while not select.select([pair], [], [], wait)[0]:
            if not _only_child():
                wait = COLLECT_IDLE_SECONDS
                continue
            prestart.collect_records(config, stop=lambda: bool(select.select([pair], [], [], 0)[0]))
            wait = COLLECT_EVERY_SECONDS

    @staticmethod
    def _wait(pair: socket.socket) -> None:
        try:
            payload, fds, _ = scm_rights.receive(pair, MAX_OFFER_BYTES + 16, 1)
        except OSError:
            _exit_worker(WORKER_IDLE)
        if not payload or len(fds) != 1:  # the server went away: no offer
            _exit_worker(WORKER_IDLE)
        pair.close()
        pid = int.from_bytes(payload[:4], sys.byteorder)
        accepted = int.from_bytes(payload[4:12], sys.byteorder) / 1e9
        argv = [os.fsdecode(a) for a in payload[12:].split(b"\0")]
        work(socket.socket(fileno=fds[0]), Offer(argv, pid, accepted))

    def hand(self, conn: socket.socket, offer: Offer) -> bool:
        """Give the spare this offer; False when it cannot take it (it died). Never waits: the
        pair holds one offer, and a spare takes one."""
        payload = (offer.pid.to_bytes(4, sys.byteorder) + int(offer.accepted * 1e9).to_bytes(8, sys.byteorder)
                   + b"\0".join(os.fsencode(a) for a in offer.argv))  # fmt: skip
        fds = array.array("i", [conn.fileno()])
        try:
            self.socket.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)], socket.MSG_DONTWAIT)
            return True
        except OSError:
            return False
        finally:
            self.socket.close()


def _fork_worker(listener: socket.socket, conn: socket.socket, offer: Offer, closing=()) -> bool:
    """A worker forked for this offer (no spare could take it); False when none could be."""
    try:
        pid = os.fork()
    except OSError as e:
        _log(f"cannot fork a worker: {e.strerror}")
        return False
    if pid == 0:
        try:  # nothing raised here may unwind into the server's code (its socket's removal)
            _become_worker(listener, [fd for fd in closing if fd != conn.fileno()])
            work(conn, offer)  # never returns
        finally:
            os._exit(70)
    return True


# --- the loop -----------------------------------------------------------------------------------


class _Watchdog:
    """systemd's watchdog (WatchdogSec= in the unit): told the server is alive at half its period,
    from the loop, so that a server that stops looping (stopped, hung) is killed and, by socket
    activation, replaced. Nothing where systemd set none."""

    def __init__(self):
        usec, pid = decimal(os.environ.pop("WATCHDOG_USEC", "")), os.environ.pop("WATCHDOG_PID", None)
        self.address = os.environ.pop("NOTIFY_SOCKET", None)  # not for the workers' children
        self.period = None
        if self.address and usec and pid in (None, str(os.getpid())):
            self.period = usec / 2e6
        self.next = 0.0

    def due_in(self, now: float) -> float | None:
        return None if self.period is None else max(0.0, self.next - now)

    def tell(self, now: float) -> None:
        if self.period is None or now < self.next:
            return
        self.next = now + self.period
        address = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(b"WATCHDOG=1", address)
        except OSError:
            pass  # systemd gone (a shutdown): nothing to tell


def serve(listener: socket.socket, package: str = PACKAGE) -> None:
    """Accept offers until SIGTERM, or until the code it serves changes on disk (CodeWatch).
    Single-threaded: workers are forked, and a fork of a process with other threads could inherit
    a lock one of them held. No peer can hold the loop: the listener and every connection are
    non-blocking, a peer is checked at accept() before anything it sends is read, a connection
    whose offer has not come within OFFER_TIMEOUT_SECONDS is closed, and a worker is had (a spare,
    or a fork) before anything is said; with none, the start is "not taken"."""
    from oci_gpu_hook.start import prestart
    from oci_gpu_hook.start.linux import ldconfig, userns

    counts = Counts()
    watch = CodeWatch(package)
    identity = code_identity(package)
    prestart.preload()  # everything a GPU start imports, once, before the first fork
    if not ldconfig.hold_empty_namespace() and not userns.unprivileged():  # what every sandbox copies
        _log("no empty mount namespace could be made: each ldconfig sandbox copies its container's mounts")
    gc.collect()
    gc.freeze()  # what exists now is never collected: a worker touches none of it to scan it
    gc.disable()  # workers live milliseconds and make no cycles they need freed (hook.main)
    watchdog = _Watchdog()
    stopping = []
    listener.setblocking(False)

    def reap(*_):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            counts.ended(status)
            if os.WIFSIGNALED(status):
                # os.write, not _log: this handler may run while _log writes through sys.stderr.
                line = f"oci-gpu-hook start-server: worker {pid} was killed by signal {os.WTERMSIG(status)}\n"
                try:
                    os.write(2, line.encode())
                except OSError:
                    pass

    def stop(*_):
        stopping.append(True)

    # A signal wakes the poll (Python retries it after a handler that returns): SIGTERM is seen at
    # once, and a reaped worker's slot too.
    woken, wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, reap)
    signal.signal(signal.SIGTERM, stop)
    poller = select.poll()
    for fd in (listener.fileno(), watch.fd, woken):
        poller.register(fd, select.POLLIN)
    own = [watch.fd, woken, wake]  # closed in every worker
    pending = {}  # fileno: (connection, when it was accepted)
    _log(f"listening on {listener.getsockname() or 'the socket systemd passed'} (code {identity})")
    spare, config = None, None
    spare_after = 0.0  # after a failed fork, the next try: not at every wake-up, nor a line each time
    accept_after = None  # while the listener is set aside after a failed accept(), when to take it back
    try:
        while not stopping:
            now = time.monotonic()
            watchdog.tell(now)
            if watch.read():
                _log("the installed code changed since this server started; stopping (the next start starts a new one)")
                break
            if accept_after is not None and now >= accept_after:
                poller.register(listener.fileno(), select.POLLIN)
                accept_after = None
            if spare is None and now >= spare_after:
                try:
                    spare = Spare(listener, config, warm=config is not None, closing=[*own, *pending])
                except OSError as e:
                    _log(f"cannot fork a spare worker: {e.strerror}")
                    spare_after = now + SPARE_RETRY_SECONDS
            waits = [accepted + OFFER_TIMEOUT_SECONDS - now for _, accepted in pending.values()]
            if spare is None:
                waits.append(max(0.0, spare_after - now))
            if accept_after is not None:
                waits.append(max(0.0, accept_after - now))
            if watchdog.due_in(now) is not None:
                waits.append(watchdog.due_in(now))
            timeout = None if not waits else max(0, int(min(waits) * 1000) + 1)
            try:
                events = poller.poll(timeout)
            except InterruptedError:
                continue
            for fd, _ in events:
                if fd == woken:
                    _drain(woken)
                elif fd == listener.fileno():
                    if not _accept(listener, pending, poller, counts):
                        poller.unregister(fd)
                        accept_after = time.monotonic() + ACCEPT_RETRY_SECONDS
                elif fd in pending:
                    conn, accepted = pending.pop(fd)
                    poller.unregister(fd)
                    spare, config = _take(listener, conn, accepted, identity, counts, spare, config,
                                          [*own, *pending])  # fmt: skip
            now = time.monotonic()
            for fd in [fd for fd, (_, accepted) in pending.items() if accepted + OFFER_TIMEOUT_SECONDS <= now]:
                conn, _ = pending.pop(fd)
                poller.unregister(fd)
                _not_taken(counts, "no offer", not_taken("no offer"))
                _pass_and_close(conn)
    finally:
        for conn, _ in pending.values():
            conn.close()
        if spare is not None:
            spare.socket.close()  # it sees the pair closed and exits
        signal.set_wakeup_fd(-1)
        for fd in (woken, wake):
            os.close(fd)
        watch.close()
    _log("stopped")


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except OSError:
        pass


def _not_taken(counts: Counts, key: str, why: str) -> None:
    """A start not taken (why: its line; key: its NOT_TAKEN reason, or "stranger"), counted and said."""
    counts.not_taken(key)
    _log(f"not taken: {why}")


def _accept(listener: socket.socket, pending: dict, poller, counts: Counts) -> bool:
    """Every connection waiting: its peer checked now, before its offer is read; a stranger's is
    answered "not taken" and closed at once. False when accept() failed for want of a resource
    (EMFILE, say): the connections left queued wait, and their pre-filters go to Python in time."""
    while True:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return True
        except ConnectionAbortedError:
            continue  # that peer is gone; the next may not be
        except OSError as e:
            if e.errno == errno.EPROTO:
                continue  # likewise
            _log(f"cannot accept: {e.strerror}; trying again in {ACCEPT_RETRY_SECONDS} s")
            return False
        conn.setblocking(False)
        lacks = peer_lacks(conn)
        if lacks or len(pending) >= MAX_PENDING:
            _not_taken(counts, "stranger" if lacks else "too many", lacks or not_taken("too many"))
            _pass_and_close(conn)
            continue
        pending[conn.fileno()] = (conn, time.monotonic())
        poller.register(conn, select.POLLIN)


def _take(listener: socket.socket, conn: socket.socket, accepted: float, identity: str, counts: Counts, spare,
          config, closing) -> tuple:  # fmt: skip
    """The offer on conn (accepted then), to a worker; (the spare left, the configuration the next
    spare warms with)."""
    with conn:
        offer, why, key = receive(conn, identity, counts, accepted)
        if offer is None:
            if why:
                _not_taken(counts, key, why)
                _reply(conn, PASS)
            return spare, config
        # A worker first: it says "taken" itself, once it holds the offer. Without one, nothing
        # was done, and the pre-filter hears "not taken".
        if not (spare is not None and spare.hand(conn, offer)) and not _fork_worker(listener, conn, offer, closing):
            _not_taken(counts, "no worker", not_taken("no worker"))
            _reply(conn, PASS)
        return None, prefilter_rule.split_config(offer.argv)[0]  # the next spare warms with it


def _pass_and_close(conn: socket.socket) -> None:
    """Answer "not taken" and close, unread: what the peer sent is dropped first (its descriptors
    closed), for a Unix socket closed with a message still queued resets the connection, and the
    peer would read the reset instead of the answer."""
    _reply(conn, PASS)
    try:
        fds = scm_rights.receive(conn, 1, DESCRIPTORS, socket.MSG_DONTWAIT)[1]
    except OSError:
        fds = []
    for fd in fds:
        os.close(fd)
    conn.close()


def _say(fd: int, message: str) -> None:
    """One line to the runtime, on the pre-filter's stderr (the offer's), as the hook says it."""
    from oci_gpu_hook.errors import PROG, printable

    try:
        os.write(fd, f"{PROG}: {printable(message)}\n".encode())
    except OSError:
        pass


def _reply(conn: socket.socket, message: bytes) -> bool:
    """False when the pre-filter is gone (its runtime's timeout): nothing is done for it then."""
    try:
        conn.send(message, socket.MSG_DONTWAIT)
        return True
    except OSError:
        return False


def ask_status(path: str = DEFAULT_SOCKET, timeout: float = 2.0) -> dict:
    """What the server listening at path says of itself (doctor): {"identity": its code identity,
    and each count its answer has (Counts.answer), as an int}. A server from before the counts
    (one that kept running through an upgrade) says its identity alone. OSError where none
    answers, or the answer is not one."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.send(QUERY + b"\0")
        reply = s.recv(ANSWER_MAX_BYTES)
    return read_answer(reply, path)


def read_answer(reply: bytes, path: str = DEFAULT_SOCKET) -> dict:
    """ask_status's reading of an answer to QUERY."""
    try:
        words = reply[len(IDENTITY) :].decode("ascii").split(" ")
    except UnicodeDecodeError:
        words = [""]
    if not reply.startswith(IDENTITY) or not words[0]:
        raise OSError(f"{path}: the server did not tell its code (it answered {reply[:16]!r})")
    status = {"identity": words[0]}
    for word in words[1:]:
        name, equals, value = word.partition("=")
        number = decimal(value)
        if not (equals and name) or name in status or number is None:
            raise OSError(f"{path}: the server's answer holds {word[:40]!r}, not NAME=N once each")
        status[name] = number
    return status


def main(socket_path: str | None) -> int:
    """The command: listen on the socket systemd passed, else on socket_path (DEFAULT_SOCKET)."""
    from oci_gpu_hook.errors import Exit

    try:
        listener = from_systemd()
        bound = None if listener is not None else socket_path or DEFAULT_SOCKET
        if bound is not None:
            listener = bind(bound)
    except ServerError as e:
        _log(str(e))
        return Exit.GENERAL
    own = _file_identity(bound) if bound else None
    try:
        serve(listener)
    finally:
        # A socket of its own goes with it (systemd's stays: it listens there for the next start).
        # Its own: the same file, whatever mode it was given meanwhile (a chmod leaves it ours).
        if own is not None and _file_identity(bound) == own:
            os.unlink(bound)
    return Exit.SUCCESS


def _file_identity(path: str):
    """(device, inode) of path itself, or None where there is nothing."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
