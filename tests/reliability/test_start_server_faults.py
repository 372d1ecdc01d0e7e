"""Issue 51, item 1a: every fault of the start server falls back to the Python hook within a
bounded time, measured.

The pre-filter (start/csrc/prefilter.c, offer_to_server) offers a GPU start to the server and
waits prefilter_rule.START_SERVER_TAKE_MS for "taken"; whatever else comes (a refusal, the end of
the connection, nothing), or a connect that fails, and it execs the Python hook. Each fault below
is made real, against a real server (start/server.py) and a real pre-filter:
- hung: the server stopped (SIGSTOP); the offer waits in its listen queue;
- held-no-server: systemd holds the socket and no server accepts (one is being started);
- killed-stale-socket: the server killed (SIGKILL) with its own socket, which stays behind;
- killed-socket-held: the server killed on the socket systemd holds, which keeps listening;
- oom-killed: the server alone in a memory cgroup limited to what it holds: the offer's accept
  needs more, and the kernel's OOM killer kills it then (a new server for each start);
- no-fork: pids.max 1 for the server alone, its spare used up: no worker can be forked;
- other-code: a server of other code (an install changed since; its identity is not the one the
  pre-filter was built with);
- code-changed: the server's package changed on disk: it stops itself (server.CodeWatch), and
  systemd holds the socket;
- spare-stopped: the spare worker stopped before each start: "taken" would come late;
- out-of-descriptors: RLIMIT_NOFILE at the server's own use: accept() fails;
- directory-at-socket-path: a directory where the socket belongs, as dockerd makes one for a bind
  mount (`-v /run/oci-gpu-hook/start.sock:...`) whose source did not exist yet: systemd cannot
  bind there, nor can `start-server`, which refuses it.
Per fault, PAIRS pairs, interleaved: the start offered to the faulty server, and the same start
from a pre-filter whose socket does not exist (the Python hook at once). Each start ends as the
Python hook's own (status, stdout, stderr), no log record says "via": "start server", no faulted
start is held (each under HELD_SECONDS of wall time), and the median of what the fault adds to the
pre-filter's part of its start (from its exec to its exec of the Python hook, which the kernel's
process events time; REAL_TIME says why both run real-time) is at most BOUND_MS + SLACK_MS. The
medians and maxima, and the same in wall time, are reported under 'measurements'.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import socket
import stat
import statistics
import struct
import subprocess
import threading
import time

import pytest
import startservercheck

from oci_gpu_hook.errors import Exit
from oci_gpu_hook.start.digits import decimal
from oci_gpu_hook.start.prefilter_rule import START_SERVER_TAKE_MS as TAKE_MS

PAIRS = 5
HELD_SECONDS = 1.0  # a faulted start that takes longer was held (no fault of these takes a tenth of it)
# Issue 51: what a faulty server may add to a start, at most. The pre-filter's wait for "taken"
# (prefilter_rule.START_SERVER_TAKE_MS) must be within it: the bound is the issue's, not the code's.
BOUND_MS = 250
# What the pre-filter adds past its wait, from its code (offer_to_server): its deadline is read
# before socket(), so the connect and the offer's send are within it; then one poll() of the whole
# milliseconds left (ms_until rounds down: it ends early rather than late), which the kernel ends on
# time for a real-time task (fs/select.c, select_estimate_accuracy: no slack; a task of the default
# policy gets 0.1% of the timeout, 0.25 ms); then close(), lseek() and execv(), which the pair
# without a socket makes too. Nothing, then.
SLACK_MS = 0.0
# Both starts of each pair run SCHED_FIFO (chrt; the Python hook the pre-filter execs inherits it):
# the pre-filter is run the moment its poll() ends, and what is measured is what the fault and the
# pre-filter add, not how long a busy machine keeps a woken process waiting for a CPU. Under the
# default policy the kernel's 0.25 ms of slack and that wait come on top, and on a busy machine
# they are more than the margin the pre-filter's rounding down leaves under BOUND_MS.
REAL_TIME = ["chrt", "--fifo", "1"]
SO_RCVBUFFORCE = 33  # asm-generic/socket.h: root's buffer size past rmem_max (socket names it not)
NLMSG_DONE = 3  # the type of a connector message's netlink header


def _nothing() -> None:
    """Arms nothing: the fault stays as it was made."""


@contextlib.contextmanager
def hung(socket_path: str, directory):
    with startservercheck.started(socket_path, directory / "server.log") as running:
        startservercheck.spare(running)
        os.kill(running.pid, signal.SIGSTOP)
        try:
            startservercheck.wait_until("stopped server", lambda: startservercheck.process_state(running.pid) == "T")
            yield _nothing
            assert startservercheck.process_state(running.pid) == "T", "the server ran meanwhile"
        finally:
            os.kill(running.pid, signal.SIGCONT)


@contextlib.contextmanager
def held_no_server(socket_path: str, directory):
    with startservercheck.held_socket(socket_path):
        yield _nothing


@contextlib.contextmanager
def killed_stale_socket(socket_path: str, directory):
    with startservercheck.started(socket_path, directory / "server.log") as running:
        startservercheck.spare(running)
        os.kill(running.pid, signal.SIGKILL)
        assert running.proc.wait(60) == -signal.SIGKILL
    try:
        assert stat.S_ISSOCK(os.lstat(socket_path).st_mode), "the killed server's socket is gone"
        yield _nothing
    finally:
        os.unlink(socket_path)


@contextlib.contextmanager
def killed_socket_held(socket_path: str, directory):
    with startservercheck.held_socket(socket_path) as listener:
        with startservercheck.activated(directory / "server.log", listener).wait_listening() as running:
            startservercheck.spare(running)
            os.kill(running.pid, signal.SIGKILL)
            assert running.proc.wait(60) == -signal.SIGKILL
        yield _nothing


def _limit_memory_to_its_use(cgroup: str) -> None:
    """The cgroup's memory limit at what is charged to it now. A process moved in brings none of
    its charges (v2 never moves them, v1 not without move_charge_at_immigrate), so its next page,
    or kernel object (a socket accept()ed), is more than it may have: the cgroup's OOM killer
    then kills it, the only process in it. No swap for it to go to instead."""
    v2 = os.path.exists(os.path.join(cgroup, "memory.max"))
    if v2 and os.path.exists(os.path.join(cgroup, "memory.swap.max")):
        _write(cgroup, "memory.swap.max", "0")
    with open(os.path.join(cgroup, "memory.current" if v2 else "memory.usage_in_bytes")) as f:
        used = f.read().strip()
    _write(cgroup, "memory.max" if v2 else "memory.limit_in_bytes", used)


def _oom_kills(cgroup: str) -> int:
    """The processes the kernel's OOM killer killed in the cgroup (v2 memory.events, v1 memory.oom_control)."""
    name = "memory.events" if os.path.exists(os.path.join(cgroup, "memory.events")) else "memory.oom_control"
    with open(os.path.join(cgroup, name)) as f:
        return next(decimal(line.split()[1]) for line in f if line.startswith("oom_kill "))


def _write(cgroup: str, name: str, value: str) -> None:
    with open(os.path.join(cgroup, name), "w") as f:
        f.write(value)


@contextlib.contextmanager
def oom_killed(socket_path: str, directory):
    kills = []  # (the server, the OOM kills in its cgroup)
    with startservercheck.held_socket(socket_path) as listener, contextlib.ExitStack() as servers:

        def arm():
            if kills:  # the previous start's server: the start it was offered was its end
                check_killed(*kills[-1])
            running = servers.enter_context(
                startservercheck.activated(directory / f"server-{len(kills)}.log", listener).wait_listening()
            )
            startservercheck.spare(running)  # forked outside the cgroup: not the OOM killer's to choose
            cgroup = servers.enter_context(startservercheck.own_cgroup(running.pid, "memory"))
            _limit_memory_to_its_use(cgroup)
            kills.append((running, cgroup))
            assert running.proc.poll() is None

        def check_killed(running, cgroup):
            startservercheck.wait_until("end of the server out of memory", lambda: running.proc.poll() is not None)
            ended = (running.proc.returncode, _oom_kills(cgroup))
            assert ended == (-signal.SIGKILL, 1), f"not killed by the OOM killer (exit status, OOM kills): {ended}"

        yield arm
        check_killed(*kills[-1])


@contextlib.contextmanager
def no_fork(socket_path: str, directory):
    with startservercheck.started(socket_path, directory / "server.log") as running:
        startservercheck.spare(running)
        with startservercheck.own_cgroup(running.pid, "pids") as cgroup:
            _write(cgroup, "pids.max", "1")
            # The spare forked before takes one offer (a pre-filter that then gave up: no "go");
            # the next spare cannot be forked.
            taken = startservercheck.offer(socket_path, startservercheck.payload("--config", "-", "prestart"))
            assert taken == b"a"
            running.wait_for("oci-gpu-hook start-server: cannot fork a spare worker")
            yield _nothing
        assert running.refusals() == ["no worker for it"] * PAIRS


@contextlib.contextmanager
def other_code(socket_path: str, directory):
    copy = startservercheck.package_copy(directory / "install")
    with open(os.path.join(copy, "start", "report.py"), "a") as f:
        f.write("# another version\n")
    command = [*startservercheck.package_command(copy), "--socket", socket_path]
    with startservercheck.Server(directory / "server.log", command=command).wait_listening() as running:
        startservercheck.spare(running)
        yield _nothing
    assert [why.split(" (")[0] for why in running.refusals()] == ["an offer of another version or code"] * PAIRS


@contextlib.contextmanager
def code_changed(socket_path: str, directory):
    copy = startservercheck.package_copy(directory / "install")
    command = startservercheck.package_command(copy)
    with startservercheck.held_socket(socket_path) as listener:
        server = startservercheck.activated(directory / "server.log", listener, command=command)
        with server.wait_listening() as running:
            startservercheck.spare(running)
            with open(os.path.join(copy, "start", "report.py"), "a") as f:
                f.write("# an upgrade\n")
            assert running.proc.wait(60) == 0
        assert running.log()[-2].startswith("oci-gpu-hook start-server: the installed code changed")
        yield _nothing


@contextlib.contextmanager
def spare_stopped(socket_path: str, directory):
    with startservercheck.started(socket_path, directory / "server.log") as running:
        stopped = []

        def arm():
            # The spare the server forked after the last start (a warm one, past the first).
            spare = startservercheck.spare(running, besides=stopped)
            os.kill(spare, signal.SIGSTOP)
            stopped.append(spare)
            startservercheck.wait_until("stopped spare", lambda: startservercheck.process_state(spare) == "T")

        try:
            yield arm
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)

        # Continued, each says "taken" to a pre-filter long gone, hears no "go" and exits.
        def none_left():
            return not set(stopped) & set(startservercheck.children(running.pid))

        startservercheck.wait_until("stopped spares gone", none_left)
        assert running.refusals() == [] and not [line for line in running.log() if " was killed by signal " in line]


@contextlib.contextmanager
def out_of_descriptors(socket_path: str, directory):
    with startservercheck.started(socket_path, directory / "server.log") as running:
        startservercheck.spare(running)
        # The limit bounds descriptor numbers, and a new one takes the lowest free: the lowest
        # free is the limit, just above what the server holds, and it can open none.
        held = {decimal(fd) for fd in os.listdir(f"/proc/{running.pid}/fd")}
        soft, hard = resource.prlimit(running.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(running.pid, resource.RLIMIT_NOFILE, (min(set(range(len(held) + 1)) - held), hard))
        try:
            yield _nothing
        finally:
            resource.prlimit(running.pid, resource.RLIMIT_NOFILE, (soft, hard))
        assert any(line.startswith("oci-gpu-hook start-server: cannot accept") for line in running.log()), running.log()


@contextlib.contextmanager
def directory_at_socket_path(socket_path: str, directory):
    os.mkdir(socket_path, 0o755)
    try:
        with startservercheck.Server(directory / "server.log", socket_path) as refused:
            assert refused.proc.wait(60) == Exit.GENERAL
        assert refused.log() == [f"oci-gpu-hook start-server: {socket_path}: exists and is not a socket"]
        yield _nothing
    finally:
        os.rmdir(socket_path)


FAULTS = {
    "hung": hung,
    "held-no-server": held_no_server,
    "killed-stale-socket": killed_stale_socket,
    "killed-socket-held": killed_socket_held,
    "oom-killed": oom_killed,
    "no-fork": no_fork,
    "other-code": other_code,
    "code-changed": code_changed,
    "spare-stopped": spare_stopped,
    "out-of-descriptors": out_of_descriptors,
    "directory-at-socket-path": directory_at_socket_path,
}


@pytest.fixture(scope="module")
def place(require):
    """The module's directory (root's, 0700): the pre-filters, and sock/ (root's, 0700) their socket."""
    require("root", "gcc", "sh", "chrt")
    may = subprocess.run([*REAL_TIME, "true"], capture_output=True, text=True)
    assert may.returncode == 0, f"the starts cannot be run real-time here: {may.stderr.strip()}"
    with startservercheck.socket_directory() as top:
        os.mkdir(os.path.join(top, "sock"), 0o700)
        yield top


@pytest.fixture(scope="module")
def socket_path(place) -> str:
    return os.path.join(place, "sock", "start.sock")


@pytest.fixture(scope="module")
def offering(place, socket_path) -> str:
    """A pre-filter offering its starts at socket_path, in front of this checkout's Python hook."""
    return startservercheck.prefilter(os.path.join(place, "offering"), socket_path)[0]


@pytest.fixture(scope="module")
def bare(place) -> str:
    """The same pre-filter, offering at a path where there is never a socket: the Python hook at once."""
    return startservercheck.prefilter(os.path.join(place, "bare"), os.path.join(place, "sock", "none.sock"))[0]


class ExecTimes:
    """When each process exec'd (CLOCK_MONOTONIC, ns), from the kernel's process events (the proc
    connector: NETLINK_CONNECTOR, root's), read by a thread of its own while the test runs: every
    process on the machine sends them, and the socket's buffer must not fill. What the pre-filter
    adds to a start is then the time from its own exec to its exec of the Python hook, without the
    Python hook's own run, which varies by more than the fault's time on a busy machine."""

    _CONNECTOR, _PROC_IDX, _LISTEN, _IGNORE, _EXEC = 11, 1, 1, 2, 2
    _EVENT_AT = 16 + 20  # after nlmsghdr and cn_msg: proc_event (what, cpu, timestamp_ns, pid, tgid)

    def __init__(self):
        self.seen, self.lost = {}, False  # tgid: [its execs' times]; whether events were dropped
        self._socket = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, self._CONNECTOR)
        self._socket.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
        self._socket.bind((0, self._PROC_IDX))
        self._socket.settimeout(0.1)  # how soon the thread sees it is done
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def _tell(self, op: int) -> None:
        body = struct.pack("=I", op)
        message = struct.pack("=IIIIHH", self._PROC_IDX, 1, 0, 0, len(body), 0) + body
        self._socket.send(struct.pack("=IHHII", 16 + len(message), NLMSG_DONE, 0, 0, 0) + message)

    def _read(self) -> None:
        while not self._done.is_set():
            try:
                data = self._socket.recv(1 << 16)
            except socket.timeout:
                continue
            except OSError:  # ENOBUFS: the buffer filled, events were dropped
                self.lost = True
                continue
            what, _, at, _, tgid = struct.unpack_from("=IIQII", data, self._EVENT_AT)
            if what == self._EXEC:
                self.seen.setdefault(tgid, []).append(at)

    def execs(self, pid: int, since: int, count: int) -> list:
        """pid's exec times since the time since (ns): count of them, or fewer where fewer came
        within a second (the events may come a moment after the process ended)."""
        deadline = time.monotonic() + 1
        while True:
            found = [at for at in self.seen.get(pid, ()) if at >= since]
            if len(found) >= count or time.monotonic() > deadline:
                return found[:count]
            time.sleep(0.005)

    def __enter__(self) -> ExecTimes:
        self._tell(self._LISTEN)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        try:
            self._tell(self._IGNORE)
        finally:
            self._socket.close()


def timed(program: str, config: str, data: bytes, execs: ExecTimes) -> tuple:
    """(the start as a runtime runs it, as startservercheck.run does, but real-time; its wall time
    in ms; the time in ms from the pre-filter's exec to its exec of the Python hook, None if it did
    not exec it or the kernel's events of it were dropped)."""
    since = time.monotonic_ns()
    argv = [program, "--config", config, "prestart"]
    with subprocess.Popen([*REAL_TIME, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=startservercheck.ENV) as proc:  # fmt: skip
        out, err = proc.communicate(data, timeout=120)
    wall = (time.monotonic_ns() - since) / 1e6
    found = execs.execs(proc.pid, since, 3)  # chrt's, the pre-filter's, the Python hook's
    python = (found[2] - found[1]) / 1e6 if len(found) == 3 else None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), wall, python


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_faulty_server_adds_at_most_250_ms_to_a_start_it_leaves_to_python(fault, host, offering, bare, socket_path,
                                                                           tmp_path, report_measurement):  # fmt: skip
    """The fault (FAULTS) made real, then PAIRS pairs of the same start: offered to the faulty server,
    and from a pre-filter with no socket. Each ends as the Python hook's own, none is served, none
    is held, and the fault adds at most BOUND_MS (+ SLACK_MS) to the pre-filter's part, median."""
    config = startservercheck.config(host, tmp_path)
    data = startservercheck.gpu_error_state(tmp_path)
    alone = startservercheck.python_hook(config, data)
    (tmp_path / "fault").mkdir()
    faulted, plain = [], []
    with ExecTimes() as execs, FAULTS[fault](socket_path, tmp_path / "fault") as arm:
        for pair in range(PAIRS):
            arm()
            if pair % 2:  # either first in turn: what a first run pays, both pay alike
                plain.append(timed(bare, config, data, execs))
                faulted.append(timed(offering, config, data, execs))
            else:
                faulted.append(timed(offering, config, data, execs))
                plain.append(timed(bare, config, data, execs))
    for done, _, _ in faulted + plain:
        assert (done.returncode, done.stderr, done.stdout) == (alone.returncode, alone.stderr, alone.stdout)
    assert [r.get("via") for r in startservercheck.log_records(config)] == [None] * (1 + 2 * PAIRS)
    walls = [wall for _, wall, _ in faulted]
    assert all(python is not None for _, _, python in faulted + plain), f"an exec not seen (dropped: {execs.lost})"
    added = [f - p for (_, _, f), (_, _, p) in zip(faulted, plain)]
    added_wall = [f - p for (_, f, _), (_, p, _) in zip(faulted, plain)]
    report_measurement(
        f"start server fault {fault}: it added {statistics.median(added):.2f} ms (median; max {max(added):.2f}) to "
        f"the pre-filter's part of {PAIRS} starts it left to Python, exec to exec, paired each with one whose socket "
        f"does not exist; in wall time {statistics.median(added_wall):.1f} ms (max {max(added_wall):.1f}); the "
        f"faulted starts took {min(walls):.0f} to {max(walls):.0f} ms"
    )
    assert max(walls) < HELD_SECONDS * 1000, f"a faulted start was held: {walls} ms"
    assert statistics.median(added) <= BOUND_MS + SLACK_MS, f"the fault added {added} ms"


# strace -ttt's line for the pre-filter's wait for "taken": when it began (CLOCK_REALTIME, s), its timeout (ms).
POLL = re.compile(r"(\d+\.\d+) poll\(\[\{fd=\d+, events=POLLIN\}\], 1, (\d+)\) = ")


def test_the_prefilter_waits_no_longer_than_take_ms_across_a_whole_second(host, offering, socket_path, tmp_path,
                                                                         require):  # fmt: skip
    """The pre-filter's poll() for "taken" is given the whole milliseconds left to its deadline,
    rounded down, so that its wait ends by TAKE_MS. A wait that spans a whole second of
    CLOCK_MONOTONIC (the deadline's nanoseconds below now's) was rounded up, C's division truncating
    the negative part toward zero: the pre-filter waited up to 1 ms past TAKE_MS in about a quarter
    of the starts a faulty server had, and the medians above read 250.1 ms now and then. Here each
    start (the socket held, no server: held-no-server) is launched 200 ms before a whole second,
    its poll() traced: it spans the second (the case is met), and its timeout is under TAKE_MS."""
    require("strace")
    config = startservercheck.config(host, tmp_path)
    data = startservercheck.gpu_error_state(tmp_path)
    alone = startservercheck.python_hook(config, data)
    trace = str(tmp_path / "trace")
    waits = []
    with startservercheck.held_socket(socket_path):
        for _ in range(3):
            now = time.monotonic_ns()
            second = (now + 200_000_000) // 10**9 + 1  # the next whole second at least 200 ms away
            time.sleep((second * 10**9 - 200_000_000 - now) / 1e9)
            offset = time.clock_gettime(time.CLOCK_REALTIME) - time.monotonic()
            done = startservercheck.run(["strace", "-qq", "-ttt", "-e", "trace=poll", "-o", trace, offering], config,
                                        data)  # fmt: skip
            assert (done.returncode, done.stderr, done.stdout) == (alone.returncode, alone.stderr, alone.stdout)
            with open(trace) as f:
                began, timeout = next(POLL.match(line).groups() for line in f if POLL.match(line))
            waits.append((second - (float(began) - offset), decimal(timeout)))
    assert all(0.005 < before < 0.24 for before, _ in waits), f"a wait that did not span a second: {waits}"
    assert all(timeout < TAKE_MS for _, timeout in waits), f"(s before the second, poll()'s timeout): {waits}"
