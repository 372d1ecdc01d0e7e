"""The start server (start/server.py, `oci-gpu-hook start-server`) run as a program, offered starts
by real pre-filters over its socket (the pre-filter's own side: tests/toolkit/test_prefilter.py):
- a start it takes is the Python hook's: the same exit status and line, the same container, log
  records that say "via": "start server", the budget counted from the pre-filter's own start;
- an offer it does not take (another version, other descriptors, not a runtime's command, not
  root's) is answered "not taken", with nothing done and none of its descriptors kept, and said
  in its log;
- it listens on the socket systemd passes, or on one of its own (bind: in a directory only root
  may write, mode 0600, a stale socket replaced, a live one refused); SIGTERM stops it, removes
  its own socket, and a worker in flight finishes its start.
The pre-filter the server's tests use runs a Python hook that does not exist: a start that went
to Python instead would end in its "cannot run" line, so a result equal to the Python hook's is
the server's. Every server listens in a directory of the test's own and is stopped by its pid.
"""

from __future__ import annotations

import errno
import json
import os
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import hookcheck
import pytest
import startservercheck
from startservercheck import COMMAND, GPU_ENV, Server, activated

from oci_gpu_hook.errors import Exit
from oci_gpu_hook.start import budget, digits, inventory_cache, prefilter_rule, server, settings
from oci_gpu_hook.start.apply import FAULT_ENV
from oci_gpu_hook.toolkit import launcher, prefilter
from oci_gpu_hook.toolkit.install import interpreter_command
from oci_gpu_hook.toolkit.simulate import control

STRICT = ("-Werror",)  # as tests/toolkit/test_prefilter.py builds it: a new warning fails here
NO_PYTHON = "/nonexistent/oci-gpu-hook-python"


@pytest.fixture(scope="module")
def place(require):
    """The module's directory (root's, 0700): the socket its pre-filters offer to, and them."""
    require("root", "gcc")
    with startservercheck.socket_directory() as top:
        yield top


@pytest.fixture(scope="module")
def socket_path(place):
    return os.path.join(place, "start.sock")


@pytest.fixture(scope="module")
def offering(place, socket_path):
    """A pre-filter offering to socket_path whose Python hook does not exist."""
    return prefilter.build(os.path.join(place, "offering"), NO_PYTHON, start_server=socket_path, flags=STRICT)


@pytest.fixture
def running(socket_path, tmp_path):
    with startservercheck.started(socket_path, tmp_path / "server.log") as listening:
        yield listening


def same_as_python(program, config: str, data: bytes) -> subprocess.CompletedProcess:
    """program's run of this start, asserted to end as the Python hook's own run of it does."""
    alone = startservercheck.python_hook(config, data)
    fronted = startservercheck.run(program, config, data)
    assert alone.returncode != 0 and hookcheck.one_clear_line(alone.stderr), alone.stderr
    assert (fronted.returncode, fronted.stderr, fronted.stdout) == (alone.returncode, alone.stderr, alone.stdout)
    return fronted


def without_time(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "time"}


def identity_of(path: str) -> tuple:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


# --- a start the server takes -------------------------------------------------------------------


@pytest.mark.parametrize("case", ["no-such-gpu", "broken-config"])
def test_a_refused_start_is_the_python_hooks_own(host, offering, running, tmp_path, case):
    """The worker's exit status and line reach the runtime through the pre-filter as the Python
    hook's own; its log record is the hook's, with "via": "start server"."""
    config = startservercheck.config(host, tmp_path)
    if case == "broken-config":
        with open(config, "a") as f:
            f.write("deadline_seconds: banana\n")  # a GPU request fails on it, before any log
    data = startservercheck.gpu_error_state(tmp_path)
    same_as_python(offering, config, data)
    records = startservercheck.log_records(config)
    if case == "no-such-gpu":
        alone, served = records
        assert "no GPU 7" in alone["message"] and "via" not in alone
        assert served.pop("via") == "start server"
        assert without_time(served) == without_time(alone)
    else:
        assert records == []
    assert running.log()[1:] == []  # taken: no refusal, and nothing of the start in the server's log


def mounts_in(container) -> list:
    """(mount point under the rootfs, the source's root, type) of the container's mounts."""
    _, bundle, pid, _, _ = container
    rootfs = os.path.realpath(os.path.join(bundle, "rootfs"))
    return sorted((m[0][len(rootfs) :], *m[1:]) for m in hookcheck.mountinfo(pid) if m[0].startswith(rootfs + "/"))


def test_a_gpu_start_is_the_python_hooks_own(live_container, offering, running, tmp_path):
    """Two live containers asking for GPU 0, one started by the Python hook, one through the
    server: the same mounts in its namespace, the same device rules, the same rootfs files."""
    containers = {"python": live_container(GPU_ENV), "server": live_container(GPU_ENV)}
    config = startservercheck.config(containers["python"][4], tmp_path)
    seen = {}
    for name, container in containers.items():
        state, bundle, pid, cgroup, _ = container
        program = offering if name == "server" else interpreter_command()
        done = startservercheck.run(program, config, state.encode())
        assert (done.returncode, done.stderr, done.stdout) == (0, b"", b""), done.stderr
        rootfs = hookcheck.tree(os.path.join(bundle, "rootfs"), contents=True)
        seen[name] = (mounts_in(container), hookcheck.device_rules(cgroup), rootfs)
    assert any(m[0] == "/dev/nvidia0" for m in seen["server"][0]), seen["server"][0]
    assert seen["server"] == seen["python"]
    alone, served = startservercheck.log_records(config)
    assert served["message"] == alone["message"] == "GPU devices configured"
    assert served["via"] == "start server" and "via" not in alone
    assert served["devices"] == alone["devices"] and "/dev/nvidia0" in served["devices"][0], served
    records = startservercheck.container_records(config)
    assert sorted(r["pid"] for r in records if r["outcome"] == "started") == sorted(c[2] for c in containers.values())


def test_an_idle_spare_collects_the_records_of_containers_that_are_gone(live_container, offering, running, tmp_path):
    """After a served start, the spare that waits for the next one, once idle for
    COLLECT_IDLE_SECONDS, removes the record of a container that is gone (its init process
    exited) once it was written over KEEP_FOR_READERS_SECONDS ago, and keeps the record of the one
    that runs and a gone one's the exporter may not have counted yet: with the server, no record
    outlives its container for long, however few the records (the hook itself looks only past 512)."""
    from oci_gpu_hook.start import container_record

    state, _, pid, _, host = live_container(GPU_ENV)
    config = startservercheck.config(host, tmp_path)
    directory = os.path.join(os.path.dirname(config), "records")
    done = startservercheck.run(offering, config, state.encode())
    assert (done.returncode, done.stderr) == (0, b""), done.stderr
    (record,) = startservercheck.container_records(config)
    assert record["pid"] == pid and record["outcome"] == "started", record
    # A record as the hook writes them, of a container whose init process has exited.
    gone = subprocess.Popen(["true"])
    gone.wait()
    old, new = container_record.file_name("gone-long-ago"), container_record.file_name("gone-just-now")
    for name in (old, new):
        data = container_record.encode(dict(record, id=name, pid=gone.pid))
        settings.write_trusted(os.path.join(directory, name), data)
    long_ago = time.time() - container_record.KEEP_FOR_READERS_SECONDS - 1
    os.utime(os.path.join(directory, old), (long_ago, long_ago))
    running_record = container_record.file_name(json.loads(state)["id"])
    assert sorted(os.listdir(directory)) == sorted([running_record, old, new])
    startservercheck.wait_until("collection of the gone container's record",
                                lambda: old not in os.listdir(directory),
                                timeout=server.COLLECT_IDLE_SECONDS + 30)  # fmt: skip
    assert sorted(os.listdir(directory)) == sorted([running_record, new])


def helper_of(spare_pid: int) -> int:
    """The ldconfig helper a warm spare holds (ldconfig.Helper): its one child, running
    ldconfig.helper_main, once it has made its namespaces and waits (asleep)."""

    def waiting():
        kids = startservercheck.children(spare_pid)
        if len(kids) != 1 or startservercheck.process_state(kids[0]) != "S":
            return 0
        with open(f"/proc/{kids[0]}/cmdline", "rb") as f:
            return kids[0] if b"ldconfig.helper_main(3, 0)" in f.read() else 0

    return startservercheck.wait_until("the spare's ldconfig helper", waiting, timeout=server.WARM_AFTER_SECONDS + 30)


def gone(pid: int) -> bool:
    return startservercheck.process_state(pid) == ""


def test_a_warm_spare_starts_ldconfig_through_its_helper(live_container, offering, running, tmp_path):
    """The first start finds a cold spare and forks ldconfig's sandbox itself; the spare after it,
    warm, holds a helper that the next start hands its sandbox to: both records say which, and
    both containers are the same. A helper killed while it waits is not used: that start forks
    its own, and succeeds. A spare's unused helper is stopped with it: after the server stops,
    none is left, not even a zombie. The forks copy the server's empty mount namespace, which the
    server holds and its spares inherit."""
    containers = [live_container(GPU_ENV) for _ in range(3)]
    config = startservercheck.config(containers[0][4], tmp_path)
    first = startservercheck.spare(running)
    assert startservercheck.children(first) == []  # cold: warmed by no start yet
    # The empty mount namespace that the forks copy (not the container's table), the server's and
    # its spares' by inheritance.
    held = [startservercheck.held(pid, "mnt") for pid in (running.pid, first)]
    assert len(held[0]) == 1 and held[1] == held[0], held
    assert held[0] != {os.readlink(f"/proc/{running.pid}/ns/mnt")[len("mnt:[") : -1]}
    done = startservercheck.run(offering, config, containers[0][0].encode())
    assert (done.returncode, done.stderr) == (0, b""), done.stderr
    second = startservercheck.spare(running, besides=[first])
    held = helper_of(second)
    with open(f"/proc/{held}/status") as f:
        status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
    assert status["NSpid"].split() == [str(held), "1"], status  # pid 1 of a PID namespace of its own
    assert os.readlink(f"/proc/{held}/ns/net") != os.readlink("/proc/self/ns/net")
    done = startservercheck.run(offering, config, containers[1][0].encode())
    assert (done.returncode, done.stderr) == (0, b""), done.stderr
    startservercheck.wait_until("the used helper reaped", lambda: gone(held))
    third = startservercheck.spare(running, besides=[first, second])
    killed = helper_of(third)
    os.kill(killed, signal.SIGKILL)
    done = startservercheck.run(offering, config, containers[2][0].encode())
    assert (done.returncode, done.stderr) == (0, b""), done.stderr
    startservercheck.wait_until("the killed helper reaped", lambda: gone(killed))
    records = startservercheck.log_records(config)
    assert [r["message"] for r in records] == ["GPU devices configured"] * 3, records
    assert [r["ldconfig_sandbox"] for r in records] == ["fork", "helper", "fork"], records
    assert len({tuple(mounts_in(c)) for c in containers}) == 1
    last = helper_of(startservercheck.spare(running, besides=[first, second, third]))
    assert running.stop() == 0
    startservercheck.wait_until("the last spare's helper gone", lambda: gone(last))


def test_a_worker_lets_go_of_the_runtimes_pipes_before_it_replies():
    """The pipes a runtime reads its hook's output from (runc: until their end, as well as the
    process's exit) are at their end once the worker has answered, while the worker itself still
    runs: the start then ends with the pre-filter, not with the worker's own exit."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    hold_r, hold_w = os.pipe()
    worker = os.fork()
    if worker == 0:
        try:
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (out_r, out_w, err_r, err_w, hold_w):
                os.close(fd)
            server._let_go_of_the_runtimes_pipes()
            os.read(hold_r, 1)  # the worker's exit, held until the test has looked
        finally:
            os._exit(0)
    for fd in (out_w, err_w, hold_r):
        os.close(fd)
    try:
        for end in (out_r, err_r):
            ready, _, _ = select.select([end], [], [], 30)
            assert ready and os.read(end, 1) == b""  # the end of the pipe, not a timeout
        assert os.waitpid(worker, os.WNOHANG) == (0, 0)  # and the worker still runs
    finally:
        os.close(hold_w)
        os.waitpid(worker, 0)
        os.close(out_r)
        os.close(err_r)


def test_the_budget_counts_from_the_prefilters_start(live_container, offering, running, tmp_path):
    """deadline_seconds 2.5. A pre-filter that offers at once to a server (and any spare worker)
    older than that: the start is made. One that waited 3.5 s for its state before offering: the
    worker finds the budget spent before the container is changed, and the record counts the
    wait. Neither the server's age nor the worker's own start is the budget's start."""
    deadline, held = 2.5, 3.5
    fresh, late = live_container(GPU_ENV), live_container(GPU_ENV)
    config = startservercheck.config(fresh[4], tmp_path, f"deadline_seconds: {deadline}\n")
    inventory_cache.load(settings.load(config))  # a fresh cache: the budget goes to the start alone
    before = hookcheck.observe(late)
    # Started now, it offers once it has its state: when it is older than the deadline.
    waiting = subprocess.Popen([offering, "--config", config, "prestart"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=startservercheck.ENV)  # fmt: skip
    while budget.process_age(running.pid) < held:
        time.sleep(0.05)
    done = startservercheck.run(offering, config, fresh[0].encode())
    assert (done.returncode, done.stderr) == (0, b""), done.stderr
    while budget.process_age(waiting.pid) < held:
        time.sleep(0.05)
    out, err = waiting.communicate(late[0].encode(), timeout=120)
    assert waiting.returncode == Exit.APPLY, err
    assert "the hook's deadline passed before the container was changed" in hookcheck.one_clear_line(err)
    hookcheck.assert_rolled_back(before, hookcheck.observe(late))
    (record,) = [r for r in startservercheck.container_records(config) if r["pid"] == late[2]]
    assert record["outcome"] == "failed" and record["duration_seconds"] >= held, record


# --- offers it does not take --------------------------------------------------------------------


def refused_offer(case: str, config: str) -> tuple:
    """(the payload, how many descriptors come with it) of an offer the server must refuse."""
    runtime = ("--config", config, "prestart")
    return {
        "another-version": (startservercheck.payload(*runtime, version="oci-gpu-hook start 0"), 0),
        "descriptors-with-the-offer": (startservercheck.payload(*runtime), 3),
        "one-descriptor": (startservercheck.payload(*runtime), 1),
        "eight-descriptors": (startservercheck.payload(*runtime), 8),
        "not-a-runtime-command": (startservercheck.payload("--config", config, "info"), 0),
        "two-commands": (startservercheck.payload("--config", config, "prestart", "prestart"), 0),
        "unended": (startservercheck.payload(*runtime)[:-1], 0),
        "too-large": (startservercheck.payload("--config", "/" + "x" * 9000, "prestart"), 0),
    }[case]


def another(head: str, own: str | None = None) -> str:
    """The refusal of an offer whose version line is head, by a server whose own is own (this code's)."""
    return f"an offer of another version or code ({head.encode()!r}; this server: {own or startservercheck.version()})"


WHY = {
    "another-version": another("oci-gpu-hook start 0"),
    "descriptors-with-the-offer": "an offer with descriptors (they come with go, once it is taken)",
    "one-descriptor": "an offer with descriptors (they come with go, once it is taken)",
    "eight-descriptors": "an offer larger than the pre-filter sends",
    "not-a-runtime-command": "an offer of a command that is not a runtime's (prestart, createRuntime)",
    "two-commands": "an offer of a command that is not a runtime's (prestart, createRuntime)",
    "unended": "an offer whose arguments do not end",
    "too-large": "an offer larger than the pre-filter sends",
}


@pytest.mark.parametrize("case", sorted(WHY))
def test_an_offer_it_does_not_take_is_answered_and_kept_nowhere(host, offering, socket_path, running, tmp_path, case):
    """Reply "p" (the pre-filter then runs Python), its reason in the server's log, no hook run
    (no log record), and every descriptor it came with closed at once: the server keeps none.
    The server then takes the next offer as before."""
    config = startservercheck.config(host, tmp_path)
    data, count = refused_offer(case, config)
    state = startservercheck.state_memfd(startservercheck.gpu_error_state(tmp_path))
    read, write = os.pipe()
    try:
        fds = ([state] + [write] * 7)[:count]
        assert startservercheck.offer(socket_path, data, fds) == server.PASS
        os.close(write)
        write = None
        os.set_blocking(read, False)
        assert os.read(read, 1) == b"", "nothing may be written to a descriptor of an offer not taken"
    finally:
        for fd in (state, read, write):
            if fd is not None:
                os.close(fd)
    assert running.refusals() == [WHY[case]]
    assert startservercheck.log_records(config) == []
    same_as_python(offering, config, startservercheck.gpu_error_state(tmp_path))
    assert running.refusals() == [WHY[case]]


@pytest.mark.parametrize("built_for", ["another-version", "other-code"])
def test_a_prefilter_built_for_another_server_gets_the_python_hook(host, running, socket_path, tmp_path, monkeypatch,
                                                                   built_for):  # fmt: skip
    """After an upgrade, a pre-filter built for another protocol, or for other code than the
    server runs (a server that kept running through an upgrade, or a pre-filter install built
    before one): its offer is refused, and the start is the Python hook's, as without a server."""
    own = startservercheck.version()
    if built_for == "another-version":
        monkeypatch.setattr(prefilter_rule, "START_SERVER_VERSION", "oci-gpu-hook start 0")
    else:
        monkeypatch.setattr(server, "code_identity", lambda package=None: "0123456789abcdef")
    head = server.version_line(server.code_identity())
    program, _ = startservercheck.prefilter(tmp_path / "old", socket_path, STRICT)
    config = startservercheck.config(host, tmp_path)
    same_as_python(program, config, startservercheck.gpu_error_state(tmp_path))
    assert running.refusals() == [another(head, own)]
    assert [r.get("via") for r in startservercheck.log_records(config)] == [None, None]


def test_the_server_tells_the_code_it_serves(running, socket_path):
    """doctor asks it: the identity of the code it loaded, the one install compiles into the
    pre-filter it builds from the same files."""
    assert server.ask_status(socket_path)["identity"] == server.code_identity()
    assert f"(code {server.code_identity()})" in running.log()[0]


LATE = re.compile(r"oci-gpu-hook start-server: worker \d+: taken too late \((\d+) ms after the server accepted its "
                  r"connection; a pre-filter waits 250 ms\): no go came, and its start went to Python")  # fmt: skip


def test_the_server_counts_what_became_of_its_offers(host, offering, socket_path, running, tmp_path):
    """Its answer to QUERY (doctor's) carries, beside its code identity, how long it has run and
    what became of the offers since: one start served (a real pre-filter's), one offer of other
    code not taken, one taken too late (its peer closed on "taken", as a pre-filter that gave up
    does: the worker says so in the server's log and runs nothing). Nothing else is counted."""
    before = server.ask_status(socket_path)
    assert before == {"identity": server.code_identity(), "up": before["up"], **dict.fromkeys(server.Counts.NAMES, 0)}
    config = startservercheck.config(host, tmp_path)
    data = startservercheck.gpu_error_state(tmp_path)
    same_as_python(offering, config, data)
    other = startservercheck.payload("--config", config, "prestart", version="oci-gpu-hook start 0")
    assert startservercheck.offer(socket_path, other) == server.PASS
    late = startservercheck.offer(socket_path, startservercheck.payload("--config", config, "prestart"))
    assert late == server.TAKEN
    status = startservercheck.counted(socket_path, served=1, late=1)
    assert status == {**before, "up": status["up"], "served": 1, "late": 1, "other_code": 1}
    assert 0 <= status["up"] <= budget.process_age(running.pid) + 1
    (line,) = [line for line in running.log() if "taken too late" in line]
    assert LATE.fullmatch(line) and int(LATE.fullmatch(line).group(1)) < 60_000, line
    assert [r.get("via") for r in startservercheck.log_records(config)] == [None, "start server"]


NOBODY_ASKS = """
import socket, sys
with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
    s.settimeout(60)
    s.connect(sys.argv[1])
    try:  # the server may have answered and closed at accept, before the query came
        s.send(bytes.fromhex(sys.argv[2]))
    except BrokenPipeError:
        pass
    print(s.recv(1024).decode())
"""


def test_only_a_peer_that_could_offer_is_told_the_counts(place, socket_path, running, run_as_nobody):
    """The query is checked at accept() as an offer is: uid 65534, through a socket opened to all,
    hears "not taken" (counted as a stranger's), never the identity or the counts."""
    os.chmod(place, 0o755)
    os.chmod(socket_path, 0o666)
    try:
        done = run_as_nobody(["-c", NOBODY_ASKS, socket_path, (server.QUERY + b"\0").hex()], modules=(),
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        os.chmod(place, 0o700)
    assert (done.returncode, done.stdout) == (0, "p\n"), done.stderr
    assert startservercheck.counted(socket_path, stranger=1)["stranger"] == 1


@pytest.mark.parametrize(
    "answer, read",
    [(b"i0123456789abcdef", {"identity": "0123456789abcdef"}),
     (b"i0123456789abcdef up=7 served=2 late=0 spares=3", {"identity": "0123456789abcdef", "up": 7, "served": 2,
                                                            "late": 0, "spares": 3}),
     (b"p", None), (b"i", None), (b"i0123 served=", None), (b"i0123 served=-1", None),
     (b"i0123 served=\xd9\xa3", None), (b"i0123 served", None), (b"i0123 served=1 served=2", None),
     (b"i0123 identity=5", None), (b"i0123  served=1", None)],
)  # fmt: skip
def test_an_answer_to_query_is_read_strictly(answer, read):
    """The identity alone is a server's from before the counts (one that kept running through an
    upgrade); names a reader does not know are kept (a later server's); anything else that is
    not NAME=N in ASCII digits, once each, is no answer."""
    if read is None:
        with pytest.raises(OSError):
            server.read_answer(answer)
    else:
        assert server.read_answer(answer) == read


def test_a_server_from_before_the_counts_still_tells_its_code(place):
    """Over a socket: a listener that answers the query as a server from before the counts did
    (one that kept running through an upgrade), with its bare identity: ask_status gives that
    identity and no counts."""
    import threading

    path = os.path.join(place, "old.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as old:
        old.bind(path)
        old.listen(1)
        asked = []

        def answer():
            conn, _ = old.accept()
            with conn:
                asked.append(conn.recv(256))
                conn.send(b"i0123456789abcdef")

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        try:
            assert server.ask_status(path) == {"identity": "0123456789abcdef"}
        finally:
            thread.join(60)
            os.unlink(path)
    assert asked == [server.QUERY + b"\0"]


def test_a_server_out_of_descriptors_sets_its_listener_aside_instead_of_spinning(running, socket_path):
    """accept() fails with EMFILE while the listener stays readable: polled again at once, the loop
    would spin, a log line each turn, until a descriptor is freed. It sets the listener aside
    ACCEPT_RETRY_SECONDS instead, at most a line each time; the connections queued meanwhile are
    taken once descriptors are back (here each is closed unoffered: its pre-filter would have gone
    to Python), and the server serves as before."""
    import resource

    # The limit bounds descriptor numbers, and a new one takes the lowest free: none left. What the
    # server holds for a moment (its idle spare's collection of records opens a directory) is not
    # counted: only the descriptors open in every look, so that no slot below the limit is free
    # once a passing one closes (in CI a passing one raised the limit by one, and accept() then
    # succeeded, the offer failing later on the peer's pidfd).
    looks = []
    for _ in range(10):
        looks.append({int(fd) for fd in os.listdir(f"/proc/{running.pid}/fd")})
        time.sleep(0.02)
    held = set.intersection(*looks)
    soft, hard = resource.prlimit(running.pid, resource.RLIMIT_NOFILE)
    clients = []
    try:
        resource.prlimit(running.pid, resource.RLIMIT_NOFILE, (min(set(range(len(held) + 1)) - held), hard))
        started = time.monotonic()
        for _ in range(3):
            client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            clients.append(client)
            client.settimeout(60)  # a hang guard
            client.connect(socket_path)  # queued in the backlog
        time.sleep(1)  # the window in which every accept() fails
        resource.prlimit(running.pid, resource.RLIMIT_NOFILE, (soft, hard))
        elapsed = time.monotonic() - started
        for client in clients:
            while client.recv(16):
                pass
    finally:
        for client in clients:
            client.close()
        resource.prlimit(running.pid, resource.RLIMIT_NOFILE, (soft, hard))
    failed = [line for line in running.log() if line.startswith("oci-gpu-hook start-server: cannot accept")]
    assert failed, f"accept() never ran out of descriptors, so this shows nothing: {running.log()}"
    assert len(failed) <= elapsed / server.ACCEPT_RETRY_SECONDS + 2, f"{len(failed)} lines in {elapsed:.2f} s"
    assert server.ask_status(socket_path)["identity"] == server.code_identity()


NOBODY_OFFERS = """
import array, json, os, select, socket, sys
read, write = os.pipe()
state = os.memfd_create("state")
os.write(state, bytes.fromhex(sys.argv[3]))
os.lseek(state, 0, os.SEEK_SET)
with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
    s.settimeout(60)
    s.connect(sys.argv[1])
    fds = array.array("i", [state, write, write])
    try:  # the server may have answered and closed at accept, before the offer came
        s.sendmsg([bytes.fromhex(sys.argv[2])], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    except BrokenPipeError:
        pass
    reply = s.recv(16)
    while s.recv(16):  # "p" comes at accept; the server drops what came and closes after it
        pass
os.close(write)
# The server's copies go with its end of the connection, at most moments after: a copy kept would
# hold the pipe open for good (5 s: a hang guard).
kept = not select.select([read], [], [], 5)[0] or os.read(read, 1) != b""
print(json.dumps({"reply": reply.decode(), "kept": kept}))
"""


def test_an_offer_from_another_user_is_not_taken(host, place, socket_path, running, run_as_nobody, tmp_path):
    """The socket's mode keeps other users out; with that mode widened, the server still takes
    no offer but root's: uid 65534's well-formed offer is refused, nothing run, nothing kept."""
    config = startservercheck.config(host, tmp_path)
    data = startservercheck.gpu_error_state(tmp_path)
    os.chmod(place, 0o755)
    os.chmod(socket_path, 0o666)
    try:
        done = run_as_nobody(["-c", NOBODY_OFFERS, socket_path, startservercheck.payload("--config", config,
                              "prestart").hex(), data.hex()], modules=(), capture_output=True, timeout=120)  # fmt: skip
    finally:
        os.chmod(place, 0o700)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"reply": "p", "kept": False}
    (why,) = running.refusals()
    assert why.startswith("an offer from uid 65534 (pid ") and why.endswith("): only root's are taken"), why
    assert startservercheck.log_records(config) == []


def test_a_state_that_is_a_pipe_is_read_by_no_worker(host, offering, socket_path, running, tmp_path):
    """A root peer answers "taken" with "go" and a pipe as its state (a pre-filter's is a memfd),
    the state whole in it and its write end kept open. The worker reads none of it (a read there
    could wait for ever, past any kill timer's wait for a file), says its one line on the offer's
    stderr and answers exit 70 (docs/cli.md); no hook ran, the server refused nothing, lost no
    worker to a signal, and it takes the next start as before."""
    config = startservercheck.config(host, tmp_path)
    data = startservercheck.gpu_error_state(tmp_path)
    (state_r, state_w), (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe(), os.pipe()
    try:
        os.write(state_w, data)
        payload = startservercheck.payload("--config", config, "prestart")
        got = startservercheck.offer(socket_path, payload, go=[state_r, out_w, err_w])
        for fd in (out_w, err_w):
            os.close(fd)
        out, err = os.read(out_r, 1 << 16), os.read(err_r, 1 << 16)
        os.set_blocking(state_r, False)
        try:
            left = os.read(state_r, len(data) + 1)
        except BlockingIOError:
            left = b""
    finally:
        for fd in (state_r, state_w, out_r, err_r):
            os.close(fd)
    assert got == server.TAKEN + server.VERDICT + bytes([Exit.INTERNAL])
    assert (out, err) == (b"", f"oci-gpu-hook: {server.STATE_NOT_A_FILE}\n".encode())
    assert left == data, "the worker read the pipe"
    assert startservercheck.log_records(config) == []
    same_as_python(offering, config, data)
    assert running.log()[1:] == []  # no refusal, no worker killed


def test_a_worker_runs_its_start_at_a_runtimes_hooks_priority(host, offering, socket_path, tmp_path):
    """Started as its unit starts it (Nice=), the server and its waiting spare run ahead of other
    work, so that under load "taken" comes within the pre-filter's wait (issue 51); the worker
    that has its start drops back to nice 0, as the runtime's own hook runs."""
    from oci_gpu_hook.toolkit import install

    command = startservercheck.as_its_unit_runs([*COMMAND, "--socket", socket_path])
    assert install.START_NICE < server.WORKER_NICE == 0
    with Server(tmp_path / "server.log", command=command).wait_listening() as running:
        assert os.getpriority(os.PRIO_PROCESS, running.pid) == install.START_NICE
        assert os.getpriority(os.PRIO_PROCESS, startservercheck.spare(running)) == install.START_NICE
        with startservercheck.stalled_start(offering, host, tmp_path, running) as (_, worker, _):
            assert os.getpriority(os.PRIO_PROCESS, worker) == server.WORKER_NICE


# --- listening, stopping ------------------------------------------------------------------------


def test_the_socket_systemd_passes_is_served_and_left_to_systemd(host, place, offering, socket_path, tmp_path):
    """Served there, and not its own: it stays when the server stops (systemd listens on it for
    the next start). The server is given a --socket too: it must not bind it."""
    config = startservercheck.config(host, tmp_path)
    own = os.path.join(place, "own.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(socket_path)
        listener.listen(8)
        identity = identity_of(socket_path)
        with activated(tmp_path / "server.log", listener, "1", "--socket", own).wait_listening() as running:
            assert not os.path.lexists(own)
            same_as_python(offering, config, startservercheck.gpu_error_state(tmp_path))
            assert startservercheck.log_records(config)[-1]["via"] == "start server"
            assert running.stop() == 0
        assert running.log()[-1] == startservercheck.STOPPED
        assert identity_of(socket_path) == identity, "the server removed the socket systemd listens on"
    finally:
        listener.close()
        os.unlink(socket_path)


@pytest.mark.parametrize(
    "kind, count, why",
    [(socket.SOCK_STREAM, "1",
      "systemd passed a socket that is not a Unix SOCK_SEQPACKET socket (ListenSequentialPacket=)"),
     (socket.SOCK_SEQPACKET, "2", "systemd passed 2 sockets; the start server takes one")],
)  # fmt: skip
def test_a_socket_systemd_passes_that_it_cannot_serve_is_refused(place, tmp_path, kind, count, why):
    """One line in its log and exit 1; it does not go on to listen on a socket of its own."""
    own = os.path.join(place, "own.sock")
    with socket.socket(socket.AF_UNIX, kind) as listener:
        listener.bind(os.path.join(place, "passed.sock"))
        listener.listen(8)
        try:
            with activated(tmp_path / "server.log", listener, count, "--socket", own) as refused:
                assert refused.proc.wait(60) == Exit.GENERAL
        finally:
            os.unlink(os.path.join(place, "passed.sock"))
    assert refused.log() == [f"oci-gpu-hook start-server: {why}"]
    assert not os.path.lexists(own)


def test_a_server_not_started_by_systemd_listens_on_its_own_socket(place, tmp_path):
    """LISTEN_PID names another process (the variables were inherited): they are not this
    server's, and it binds its --socket."""
    own = os.path.join(place, "own.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        command = ["sh", "-c", 'export LISTEN_PID=1 LISTEN_FDS=1; exec "$@" 3<&0 </dev/null', "sh", *COMMAND,
                   "--socket", own]  # fmt: skip
        with Server(tmp_path / "server.log", command=command, stdin=listener.fileno()).wait_listening() as running:
            assert stat.S_ISSOCK(os.lstat(own).st_mode)
            assert running.log()[0].startswith(f"{startservercheck.LISTENING}{own} (code ")
    assert not os.path.lexists(own)


@pytest.fixture
def umask_zero():
    """bind's mode may not come from the caller's umask."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_bind_makes_a_socket_only_root_may_use(place, umask_zero):
    path = os.path.join(place, "bound.sock")
    with server.bind(path) as listener:
        try:
            st = os.lstat(path)
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
                client.connect(path)
            assert listener.accept()[0].close() is None
        finally:
            os.unlink(path)


def test_bind_replaces_a_stale_socket_and_refuses_a_live_one(place):
    path = os.path.join(place, "bound.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stale:
        stale.bind(path)  # a server killed with its socket left: nothing listens
    try:
        with server.bind(path) as listener:
            with pytest.raises(server.ServerError, match="another start server listens there"):
                server.bind(path)
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
                client.connect(path)  # the live one is untouched
            listener.accept()[0].close()
    finally:
        os.unlink(path)


@pytest.mark.parametrize("change", ["group-writable", "world-writable", "not-roots", "a-file-there", "a-link"])
def test_bind_refuses_a_place_others_control(place, change):
    """The pre-filter trusts what answers at the path: a directory another user may write (or
    owns), or a path that is not a socket, is refused, and nothing there is changed."""
    directory = os.path.join(place, change)
    os.mkdir(directory, 0o700)
    path = os.path.join(directory, "start.sock")
    if change == "group-writable":
        os.chmod(directory, 0o770)
    elif change == "world-writable":
        os.chmod(directory, 0o1777)
    elif change == "not-roots":
        os.chown(directory, 65534, 65534)
    elif change == "a-file-there":
        with open(path, "w") as f:
            f.write("kept\n")
    else:
        os.symlink(os.path.join(place, "elsewhere.sock"), path)
    before = hookcheck.tree(directory, contents=True, times=True)
    with pytest.raises(server.ServerError):
        server.bind(path)
    assert hookcheck.tree(directory, contents=True, times=True) == before


@pytest.mark.parametrize("mode", [None, 0o640], ids=["as-bound", "chmod-0640"])
def test_sigterm_stops_it_and_removes_its_own_socket(socket_path, running, mode):
    """Its own socket, even with another mode given it meanwhile (an administrator's chmod)."""
    if mode is not None:
        os.chmod(socket_path, mode)
    assert running.stop() == 0
    assert running.log()[-1] == startservercheck.STOPPED
    assert not os.path.lexists(socket_path)


def test_a_socket_that_is_no_longer_its_own_is_left(socket_path, running):
    """Another server's socket bound where its own was: stopping removes only its own."""
    os.unlink(socket_path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as other:
        other.bind(socket_path)
        try:
            identity = identity_of(socket_path)
            assert running.stop() == 0
            assert identity_of(socket_path) == identity
        finally:
            os.unlink(socket_path)


class NvmlHeld:
    """The simulated NVML's control file (SIM_ROOT/nvml-control, which it reads at its calls) made
    a FIFO no one writes: a start that asks NVML (its inventory cache stale) waits in that read,
    before its plan, as on a driver slow to answer, until release(). The host's own file is put
    back then, or at the end."""

    def __init__(self, host):
        self.path = os.path.join(host["root"], control.FILE)
        self.saved = self.path + ".held-by-test" if os.path.lexists(self.path) else None
        self.writer, self.held = None, False

    def __enter__(self) -> NvmlHeld:
        if self.saved:
            os.rename(self.path, self.saved)
        os.mkfifo(self.path, 0o600)
        self.held = True
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def reader(self, offered: subprocess.Popen) -> int:
        """The pid of the process that opened the FIFO to read (the worker's NVML), once one has:
        it then waits in its read. offered: the start's pre-filter, which must still wait."""
        deadline = time.monotonic() + 60  # a hang guard
        while self.writer is None:
            try:  # a writer's open that does not wait succeeds once a reader waits in its own
                self.writer = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
                assert offered.poll() is None, offered.communicate()
                assert time.monotonic() < deadline, "no start asked NVML"
                time.sleep(0.01)
        while True:
            for pid in {digits.decimal(entry) for entry in os.listdir("/proc")} - {None, os.getpid()}:
                try:
                    if self.path in [os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")]:
                        return pid
                except OSError:
                    continue  # gone meanwhile
            assert time.monotonic() < deadline, "the FIFO's reader is nowhere"
            time.sleep(0.01)

    def release(self) -> None:
        """The host's file back where NVML reads it next, then the end of the FIFO for its reader."""
        if self.held:
            self.held = False
            if self.saved:
                os.rename(self.saved, self.path)  # in the FIFO's place
            else:
                os.unlink(self.path)
        if self.writer is not None:
            os.close(self.writer)
            self.writer = None


@pytest.mark.parametrize("outcome", ["applied", "rolled-back"])
def test_a_worker_in_flight_finishes_its_start_after_sigterm(live_container, offering, socket_path, tmp_path,
                                                             outcome):  # fmt: skip
    """A GPU start whose worker waits on NVML (its inventory cache stale) when the server gets
    SIGTERM: the server stops and removes its socket at once, with nothing of the container done
    yet; the worker then plans and carries out the start: the container gets its GPU, or, with
    operation 3 failing (OCI_GPU_HOOK_FAULT_AT in the server's environment, which its workers
    have), every change is rolled back. Either way the pre-filter gets the worker's verdict and
    line, and the log record is the served start's."""
    container = live_container(GPU_ENV)
    state, _, _, cgroup, host = container
    config = startservercheck.config(host, tmp_path, f"inventory_cache: {tmp_path}/cache/inventory.json\n"
                                                     "deadline_seconds: 60\n")  # fmt: skip
    env = {**startservercheck.ENV, **({FAULT_ENV: "3"} if outcome == "rolled-back" else {})}
    before, untouched = hookcheck.observe(container), mounts_in(container)
    (tmp_path / "state").write_text(state)
    with Server(tmp_path / "server.log", socket_path, env=env).wait_listening() as running, NvmlHeld(host) as nvml:
        with open(tmp_path / "state", "rb") as stdin:
            offered = subprocess.Popen([offering, "--config", config, "prestart"], stdin=stdin, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, env=startservercheck.ENV)  # fmt: skip
        try:
            worker = startservercheck.parent(nvml.reader(offered))
            assert startservercheck.parent(worker) == running.pid, "not a worker of the server asks NVML"
            assert mounts_in(container) == untouched, "the start was under way before SIGTERM"
            assert running.stop() == 0
            assert not os.path.lexists(socket_path)
            assert offered.poll() is None
            nvml.release()
            out, err = offered.communicate(timeout=120)
        finally:
            if offered.poll() is None:
                offered.kill()
                offered.communicate()
    after = hookcheck.observe(container)
    (record,) = startservercheck.log_records(config)
    assert record["via"] == "start server", record
    if outcome == "applied":
        assert (offered.returncode, err, out) == (0, b"", b""), err
        assert record["message"] == "GPU devices configured", record
        assert any(m[0] == "/dev/nvidia0" for m in mounts_in(container)), mounts_in(container)
        assert after.rules != before.rules and hookcheck.device_rules(cgroup) == after.rules
    else:
        assert offered.returncode == Exit.APPLY, err
        assert "operation 3 (" in hookcheck.one_clear_line(err) and "injected fault" in record["message"], err
        hookcheck.assert_rolled_back(before, after)


# --- the code it serves, systemd's watchdog -----------------------------------------------------


def test_a_server_stops_serving_once_its_code_changes(place, tmp_path):
    """A server of a copy of the package: a bytecode cache written beside the sources is no change
    (it still answers), a source changed in place is (an upgrade by pip or a copy): it says so,
    stops and removes its socket, so that no start runs a mix of the old modules it preloaded and
    new ones a worker would import. Its identity is the copy's, the same as this checkout's."""
    copy = tmp_path / "installed"
    shutil.copytree(os.path.join(launcher.package_parent(), "oci_gpu_hook"), copy / "oci_gpu_hook",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    own = os.path.join(place, "copy.sock")
    command = [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(copy)!r}); "
               "from oci_gpu_hook.hook import main; sys.exit(main())",
               prefilter_rule.START_SERVER, "--socket", own]  # fmt: skip
    with Server(tmp_path / "server.log", command=command).wait_listening() as running:
        serving = server.ask_status(own)["identity"]
        assert serving == server.code_identity(str(copy / "oci_gpu_hook")) == server.code_identity()
        cache = copy / "oci_gpu_hook" / "start" / "__pycache__"
        cache.mkdir(exist_ok=True)
        (cache / "report.cpython-3.pyc").write_bytes(b"not code")
        assert server.ask_status(own)["identity"] == server.code_identity()
        with open(copy / "oci_gpu_hook" / "start" / "report.py", "a") as f:
            f.write("# an upgrade\n")
        assert running.proc.wait(60) == 0
    assert running.log()[-2:] == [
        "oci-gpu-hook start-server: the installed code changed since this server started; stopping (the next start "
        "starts a new one)",
        startservercheck.STOPPED,
    ]
    assert not os.path.lexists(own)


@pytest.mark.parametrize("usec, period", [("200000", 0.1), ("\u00b9", None), ("\u0663", None), ("\uff12", None),
                                          ("0", None), ("-5", None)])  # fmt: skip
def test_the_watchdog_period_is_read_in_ascii_digits(monkeypatch, usec, period):
    """WATCHDOG_USEC that is not ASCII digits sets no watchdog: '¹' made int() raise as the
    server started, and '٣' was read as a period of 3 microseconds."""
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", usec)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert server._Watchdog().period == period


def test_systemds_watchdog_is_told_from_the_loop(socket_path, tmp_path):
    """WatchdogSec= in the unit: systemd passes NOTIFY_SOCKET and WATCHDOG_USEC, and the server
    says WATCHDOG=1 at half the period from its loop, so that one that stops looping is killed
    (and a new one started for the next offer). While it is stopped (SIGSTOP) it says nothing."""
    notify = os.path.join(os.path.dirname(socket_path), "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(notify)
        systemd.settimeout(60)  # a hang guard
        try:
            env = {**startservercheck.ENV, "NOTIFY_SOCKET": notify, "WATCHDOG_USEC": "200000"}
            with Server(tmp_path / "server.log", socket_path, env=env).wait_listening() as running:
                told = [systemd.recv(64) for _ in range(3)]
                os.kill(running.pid, signal.SIGSTOP)
                try:
                    while True:  # what it said before it stopped
                        systemd.settimeout(0.5)
                        try:
                            systemd.recv(64)
                        except socket.timeout:
                            break
                    systemd.settimeout(1.0)  # five of its periods
                    with pytest.raises(socket.timeout):
                        systemd.recv(64)
                finally:
                    os.kill(running.pid, signal.SIGCONT)
                systemd.settimeout(60)
                assert systemd.recv(64) == b"WATCHDOG=1"  # told again once it loops again
        finally:
            os.unlink(notify)
    assert told == [b"WATCHDOG=1"] * 3
