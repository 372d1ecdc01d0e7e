"""`oci-gpu-hook start-server`: the warm start server the pre-filter offers GPU starts to.

Most of a GPU start in a process of its own is the interpreter's start and the imports, not the
work (docs/performance.md, round 4). This process pays for both once. The pre-filter built with
its socket (`install --start-server`, csrc/prefilter.c: offer_to_server) offers it every start it
would hand to Python, in one SOCK_SEQPACKET message: a version line, the hook's arguments, and
three descriptors (the state, the pre-filter's stdout and stderr). The server checks the offer,
forks a worker and goes back to listening. The worker becomes what the Python hook's process
would have been (the same descriptors 0 to 2, the same arguments, the budget counted from the
pre-filter's own start), runs the hook (hook.py) and replies with its exit status.

Why a worker per start: joining a container's mount namespace takes a process of its own
(single-threaded, not sharing its filesystem context), and a worker that fails, hangs or is
killed by its deadline takes nothing of the server with it. The server itself only accepts,
checks, forks and reaps: it reads no configuration and no inventory (each worker reads them as
the hook does, so an edit or a refresh counts from the next start) and never runs the hook.

Trust (docs/security.md, "The start server"): only root may offer (the socket is root's, mode
0600 in a root directory, and the peer's credentials are checked here), and the pre-filter only
offers to a peer that is root. An offer the server will not take (another version, a command
that is not a runtime's, the wrong descriptors) is answered "not taken" before anything is done,
and the pre-filter starts the Python hook as it would without a server.

Replies: b"v" and the exit status (one byte); b"p": not taken.
"""

from __future__ import annotations

import array
import gc
import os
import signal
import socket
import stat
import sys
import time

from oci_gpu_hook.start import rule

VERSION = rule.START_SERVER_VERSION.encode()  # the pre-filter's START_SERVER_VERSION, from the same line
DEFAULT_SOCKET = rule.START_SERVER_SOCKET
MAX_OFFER_BYTES = len(VERSION) + 1 + 8192  # the pre-filter's payload room
DESCRIPTORS = 3  # the state, stdout, stderr
PASS = b"p"
TAKEN = b"a"
VERDICT = b"v"
WARM_AFTER_SECONDS = 0.05
OFFER_TIMEOUT_SECONDS = 1.0
LISTEN_BACKLOG = 128  # a node starting many containers at once queues them here, not in refusals
_SYSTEMD_FIRST_FD = 3  # sd_listen_fds(3): passed sockets start here


class ServerError(Exception):
    """The server cannot listen: one line for its log."""


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


# --- one offer ----------------------------------------------------------------------------------


class Offer:
    """A checked offer: the hook's arguments, the three descriptors and the offering process."""

    def __init__(self, argv: list, fds: list, pid: int):
        self.argv, self.fds, self.pid = argv, fds, pid


def _peer(conn: socket.socket) -> tuple:
    pid, uid, gid = array.array("i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid, gid


_SO_PEERPIDFD = 77  # Linux 6.5: a pidfd of the peer as it connected (socket.SO_PEERPIDFD from Python 3.13)


def _caps_and_mount_ns(pid) -> tuple:
    """(effective capabilities, mount namespace inode) of a process, from procfs."""
    with open(f"/proc/{pid}/status", "rb") as f:
        caps = next(int(line.split()[1], 16) for line in f if line.startswith(b"CapEff:"))
    return caps, os.stat(f"/proc/{pid}/ns/mnt").st_ino


def _peer_lacks(conn: socket.socket, pid: int) -> str:
    """What the offering process lacks to have its start run by this server ("" when nothing).

    uid 0 is not enough: a worker acts with the server's capabilities, so the peer must hold all of
    them (a container's root with its capabilities dropped, given a view of /run, must not borrow
    them), and in the server's mount namespace, where the worker reads the bundle and the
    configuration the offer names (a runtime in a namespace of its own gets its start from Python,
    in its own). Read from procfs by the pid the kernel gave at connect time; where the kernel gives
    a pidfd of the peer, that it is still the same process after the reads is checked through it."""
    try:
        pidfd = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
    except OSError:
        pidfd = None  # an older kernel (RHEL 9's 5.14): the pid alone (docs/security.md)
    try:
        caps, mount_ns = _caps_and_mount_ns(pid)
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, 0)  # raises ProcessLookupError: it exited meanwhile
    except (OSError, StopIteration, ValueError):
        return "cannot read what it may do (gone?)"
    finally:
        if pidfd is not None:
            os.close(pidfd)
    own_caps, own_mount_ns = _caps_and_mount_ns("self")
    if caps & own_caps != own_caps:
        return f"it lacks capabilities the worker would use (its effective {caps:#x}, the server's {own_caps:#x})"
    if mount_ns != own_mount_ns:
        return "it is in another mount namespace than the server (its bundle and configuration are named in its own)"
    return ""


def receive(conn: socket.socket) -> tuple:
    """(Offer or None, why not): the offer on conn, checked. Descriptors of an offer that is not
    taken are closed here."""
    fds = array.array("i")
    # The pre-filter sends its offer as soon as it is connected: a peer that connects and sends
    # nothing would otherwise hold every start behind it.
    conn.settimeout(OFFER_TIMEOUT_SECONDS)
    try:
        payload, ancillary, flags, _ = conn.recvmsg(MAX_OFFER_BYTES + 1, socket.CMSG_SPACE(DESCRIPTORS * fds.itemsize))
    except OSError as e:
        return None, f"cannot read the offer: {e.strerror or e}"
    finally:
        conn.settimeout(None)
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    fds = list(fds)

    def refuse(why: str):
        for fd in fds:
            os.close(fd)
        return None, why

    if not payload and not fds:
        return None, ""  # connected and closed, offering nothing (a second server's probe): no offer
    pid, uid, _ = _peer(conn)
    if uid != 0:  # the socket's mode keeps others out; this holds even if that mode were changed
        return refuse(f"an offer from uid {uid} (pid {pid}): only root's are taken")
    lacks = _peer_lacks(conn, pid)
    if lacks:
        return refuse(f"an offer from pid {pid}: {lacks}")
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        return refuse("an offer larger than the pre-filter sends")
    if len(fds) != DESCRIPTORS:
        return refuse(f"an offer with {len(fds)} descriptors, not {DESCRIPTORS}")
    if not stat.S_ISREG(os.fstat(fds[0]).st_mode):
        # The pre-filter's state is a memfd, read to its end at once; a pipe could keep a worker
        # waiting past every deadline (the budget starts counting after the state is read).
        return refuse("an offer whose state is not a file")
    head, _, rest = payload.partition(b"\0")
    if head != VERSION:
        return refuse(f"an offer of another version ({head[:40]!r}; this server: {VERSION.decode()})")
    if not rest.endswith(b"\0"):
        return refuse("an offer whose arguments do not end")
    argv = [os.fsdecode(a) for a in rest[:-1].split(b"\0")]
    if not rule.is_runtime_command(argv):
        return refuse("an offer of a command that is not a runtime's (prestart, createRuntime)")
    return Offer(argv, fds, pid), ""


def work(conn: socket.socket, offer: Offer) -> None:
    """In a worker: become the hook's process for this start, run it, reply, exit."""
    code = 70
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in the hook's own process
        for target, fd in enumerate(offer.fds):
            os.dup2(fd, target)  # inheritable, as the hook's own 0 to 2 are
        for fd in offer.fds:
            if fd > 2:
                os.close(fd)
        from oci_gpu_hook.errors import answer
        from oci_gpu_hook.start import budget, prestart, report

        # The budget counts from the pre-filter's start, as it counts from the hook's own
        # process's start without a server: the runtime's clock started there.
        started = time.monotonic() - budget.process_age(offer.pid)
        report.VIA = "start server"
        config = rule.split_config(offer.argv)[0]
        # One line and an exit status whatever happens, as the hook's own process answers (hook.py).
        code = answer(lambda: prestart.run(config, started=started))
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        try:
            conn.send(VERDICT + bytes([code & 0xFF]))
        finally:
            os._exit(0)


def _become_worker(listener: socket.socket) -> None:
    """In a freshly forked child: nothing of the server's own is kept (its socket, its handlers)."""
    listener.close()
    os.umask(0o022)  # what runtimes give their hooks, whatever the server was started with
    for name in ("SIGCHLD", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a spare waits; work() answers a SIGINT as the hook does


class Spare:
    """A worker forked before its offer comes, waiting on its end of a socket pair: the fork (its
    page tables, ~0.5 ms here) is then off the start's path. The server hands it an offer with
    the pre-filter's connection; a spare whose server is gone (the pair's other end closed) exits."""

    def __init__(self, listener: socket.socket, config: str | None = None, warm: bool = False):
        """warm: before its offer comes, read the settings of config (the last start's) and the
        inventory they name, once the start that made this spare has had its moment."""
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
                _become_worker(listener)
                if warm:
                    self._warm(theirs, config)
                self._wait(theirs)  # never returns
            finally:
                os._exit(70)
        theirs.close()
        self.pid, self.socket = pid, ours

    @staticmethod
    def _warm(pair: socket.socket, config: str | None) -> None:
        import select

        from oci_gpu_hook.start import prestart

        # Forked while the previous start's worker runs: on a small machine, reading now would
        # take a CPU from it. An offer that comes first is served cold, as without a spare.
        if not select.select([pair], [], [], WARM_AFTER_SECONDS)[0]:
            prestart.warm(config)

    @staticmethod
    def _wait(pair: socket.socket) -> None:
        fds = array.array("i")
        try:
            payload, ancillary, flags, _ = pair.recvmsg(MAX_OFFER_BYTES + 8, socket.CMSG_SPACE(4 * fds.itemsize))
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        except OSError:
            os._exit(0)
        if not payload or len(fds) != 1 + DESCRIPTORS:  # the server went away: no offer
            os._exit(0)
        pair.close()
        pid = int.from_bytes(payload[:4], sys.byteorder)
        argv = [os.fsdecode(a) for a in payload[4:].split(b"\0")]
        work(socket.socket(fileno=fds[0]), Offer(argv, list(fds[1:]), pid))

    def hand(self, conn: socket.socket, offer: Offer) -> bool:
        """Give the spare this offer; False when it cannot take it (it died)."""
        payload = offer.pid.to_bytes(4, sys.byteorder) + b"\0".join(os.fsencode(a) for a in offer.argv)
        fds = array.array("i", [conn.fileno(), *offer.fds])
        try:
            self.socket.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            return True
        except OSError:
            return False
        finally:
            self.socket.close()


def serve(listener: socket.socket) -> None:
    """Accept offers until SIGTERM. Single-threaded: workers are forked, and a fork of a process
    with other threads could inherit a lock one of them held."""
    from oci_gpu_hook.start import prestart

    prestart.preload()  # everything a GPU start imports, once, before the first fork
    gc.collect()
    gc.freeze()  # what exists now is never collected: a worker touches none of it to scan it
    gc.disable()  # workers live milliseconds and make no cycles they need freed (hook.main)
    stopping = []

    def reap(*_):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if os.WIFSIGNALED(status):
                # os.write, not _log: this handler may run while _log writes through sys.stderr.
                line = f"oci-gpu-hook start-server: worker {pid} was killed by signal {os.WTERMSIG(status)}\n"
                try:
                    os.write(2, line.encode())
                except OSError:
                    pass

    def stop(*_):
        stopping.append(True)
        listener.close()  # accept() fails at once; running workers finish on their own

    signal.signal(signal.SIGCHLD, reap)
    signal.signal(signal.SIGTERM, stop)
    _log(f"listening on {listener.getsockname() or 'the socket systemd passed'}")
    spare, config = None, None
    while not stopping:
        if spare is None:
            try:
                spare = Spare(listener, config, warm=config is not None)
            except OSError as e:
                _log(f"cannot fork a spare worker: {e.strerror}")
        try:
            conn, _ = listener.accept()
        except OSError:
            if stopping:
                break
            raise
        with conn:
            offer, why = receive(conn)
            if offer is None:
                if why:
                    _log(f"not taken: {why}")
                    _reply(conn, PASS)
                continue
            # Said before any worker has it: a pre-filter that hears nothing (a server stopped
            # with offers queued) knows nothing was done, and gives its start to Python.
            taken = _reply(conn, TAKEN)
            if taken and not (spare is not None and spare.hand(conn, offer)):
                if not _fork_worker(listener, conn, offer):
                    _say(offer.fds[2], "the start server could not start a worker for this start (its log says why)")
                    _reply(conn, VERDICT + bytes([70]))
            spare, config = None, rule.split_config(offer.argv)[0]  # the next spare warms with it
            for fd in offer.fds:
                os.close(fd)
    if spare is not None:
        spare.socket.close()  # it sees the pair closed and exits
    _log("stopped")


def _fork_worker(listener: socket.socket, conn: socket.socket, offer: Offer) -> bool:
    """A worker forked for this offer (no spare could take it); False when none could be."""
    try:
        pid = os.fork()
    except OSError as e:
        _log(f"not taken: cannot fork a worker: {e.strerror}")
        return False
    if pid == 0:
        try:  # nothing raised here may unwind into the server's code (its socket's removal)
            _become_worker(listener)
            work(conn, offer)  # never returns
        finally:
            os._exit(70)
    return True


def _reply(conn: socket.socket, message: bytes) -> bool:
    """False when the pre-filter is gone (its runtime's timeout): nothing is done for it then."""
    try:
        conn.send(message)
        return True
    except OSError:
        return False


def _say(fd: int, message: str) -> None:
    """One line to the runtime, on the pre-filter's stderr (the offer's), as the hook says it."""
    from oci_gpu_hook.errors import PROG, printable

    try:
        os.write(fd, f"{PROG}: {printable(message)}\n".encode())
    except OSError:
        pass


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
    identity = _identity(bound) if bound else None
    try:
        serve(listener)
    finally:
        # A socket of its own goes with it (systemd's stays: it listens there for the next start).
        # Its own: the same file, whatever mode it was given meanwhile (a chmod leaves it ours).
        if identity is not None and _identity(bound) == identity:
            os.unlink(bound)
    return Exit.SUCCESS


def _identity(path: str):
    """(device, inode) of path itself, or None where there is nothing."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
