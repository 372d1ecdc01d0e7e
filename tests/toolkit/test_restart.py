"""toolkit/restart.py: which runtimes a change asks to restart, who serves a socket, and a restart
by signal against a real supervised server (systemd's call: tests/start/linux/test_systemd.py;
a real runtime restarted: tests/e2e/test_toolkit_host.py)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from oci_gpu_hook.toolkit import install, restart

# A runtime under a supervisor: a server on argv[1] (its own pid answered through SO_PEERCRED),
# started again each time it exits, each start's pid logged to argv[2].
SUPERVISED = textwrap.dedent(
    """
    import os, socket, subprocess, sys
    server = "import os, signal, socket, sys\\n" \\
             "s = socket.socket(socket.AF_UNIX)\\n" \\
             "s.bind(sys.argv[1]); s.listen(8)\\n" \\
             "signal.signal(signal.SIGTERM, lambda *a: (os.unlink(sys.argv[1]), os._exit(0)))\\n" \\
             "while True: s.accept()[0].close()\\n"
    while True:
        child = subprocess.Popen([sys.executable, "-c", server, sys.argv[1]])
        with open(sys.argv[2], "a") as f:
            f.write(f"{child.pid}\\n")
        child.wait()
    """
)


def test_a_change_to_a_file_a_runtime_reads_at_start_asks_for_its_restart():
    files = install.RUNTIME_FILES
    spec, dropin = install.containerd.BASE_SPEC, install.CRIO_DROPIN
    empty = {"files": {}}
    assert restart.changed(empty, empty, files) == []
    assert restart.changed(empty, {"files": {dropin: "sha256:1"}}, files) == ["crio"]  # written
    assert restart.changed({"files": {spec: "sha256:1"}}, {"files": {spec: "sha256:2"}}, files) == ["containerd"]
    assert restart.changed({"files": {spec: "sha256:1", dropin: "x"}}, {}, files) == ["crio", "containerd"]  # removed
    edited = {"edited": {install.containerd.CONFIG: install.containerd.IMPORT_LINE}}
    assert restart.changed(empty, edited, files) == ["containerd"]
    # What no runtime reads at start: the hooks.d file (CRI-O watches it), the launcher's link.
    others = {"files": {install.HOOKS_D_FILE: "sha256:1", install.launcher.LAUNCHER: "link:bundles/a/oci-gpu-hook"}}
    assert restart.changed(empty, others, files) == []


def test_the_service_is_read_from_the_systemd_hierarchy():
    assert restart.unit_in("0::/system.slice/containerd.service\n") == "containerd.service"
    hybrid = "12:pids:/system.slice/crio.service\n1:name=systemd:/system.slice/crio.service\n0::/\n"
    assert restart.unit_in(hybrid) == "crio.service"
    assert restart.unit_in("0::/user.slice/user-0.slice/session-3.scope\n") is None
    assert restart.unit_in("0::/\n") is None and restart.unit_in("0::/.service\n") is None


@pytest.fixture
def supervised(tmp_path):
    path, log = str(tmp_path / "runtime.sock"), tmp_path / "starts"
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISED, path, str(log)])
    try:
        deadline = time.monotonic() + 30
        while restart.serving(path) is None:
            assert time.monotonic() < deadline and supervisor.poll() is None, "the server did not start"
            time.sleep(0.05)
        yield path, log
    finally:
        supervisor.kill()
        supervisor.wait()
        for pid in map(int, log.read_text().split()):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def test_signal_restarts_the_process_that_serves_the_socket_and_waits_for_the_next(supervised):
    path, log = supervised
    (first,) = map(int, log.read_text().split())
    assert restart.serving(path) == first
    lines = restart.restart("containerd", "signal", path)
    starts = list(map(int, log.read_text().split()))
    assert starts[0] == first and len(starts) == 2
    assert lines == [f"restarted containerd: pid {first}, then pid {starts[1]} (SIGTERM)"]
    assert restart.serving(path) == starts[1]


def test_auto_without_systemd_says_to_restart_it_yourself(supervised):
    """This host runs no systemd (checked): auto cannot restart, says so in one line, and leaves
    the runtime running."""
    if os.path.isdir("/run/systemd/system"):
        pytest.skip("this host runs systemd: auto would ask it (the node VM's scenario)")
    path, log = supervised
    with pytest.raises(restart.RestartError, match=r"^crio \(pid \d+\) is not a systemd service: restart it yourself"):
        restart.restart("crio", "auto", path)
    assert len(log.read_text().split()) == 1


def test_a_runtime_not_running_has_nothing_to_restart(tmp_path):
    path = str(tmp_path / "none.sock")
    assert restart.restart("crio", "signal", path) == [
        f"crio is not running (nothing serves {path}): it reads the change when it starts"
    ]


def test_a_socket_served_by_another_user_is_never_signalled(require):
    """Whoever listens at the configured path but is not root (a socket in a directory others can
    write, on an administrator's odd configuration) is not the runtime: refused in one line, and
    that process is neither signalled nor restarted. (Debian's python3 runs as nobody: the
    checkout's may be closed to other users.)"""
    require("root", "/usr/bin/python3")
    import shutil
    import tempfile

    top = tempfile.mkdtemp(prefix="oci-gpu-hook-restart-", dir="/tmp")  # reachable by nobody
    os.chmod(top, 0o777)
    path = os.path.join(top, "other.sock")
    code = "import socket, sys, time\ns = socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\ns.listen(1)\n"
    code += "time.sleep(60)\n"
    server = subprocess.Popen(["/usr/bin/python3", "-I", "-c", code, path], user=65534, group=65534, extra_groups=[])
    try:
        deadline = time.monotonic() + 30
        while restart.serving(path) is None:
            assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
            time.sleep(0.05)
        with pytest.raises(restart.RestartError, match=rf"^crio: {path} is served by pid {server.pid} of uid 65534, "):
            restart.restart("crio", "signal", path)
        assert server.poll() is None
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(top)


def test_a_runtime_this_pid_namespace_cannot_see_is_never_signalled(supervised, require):
    """Asked from a PID namespace of its own (a toolkit pod without hostPID), the server's pid is
    0 to SO_PEERCRED, and kill(0) would signal the caller's own process group: refused in one
    line, the server left running."""
    require("root", "unshare")
    path, log = supervised
    probe = ("import sys\nfrom oci_gpu_hook.toolkit import restart\n"
             "try:\n    restart.restart('crio', 'signal', sys.argv[1])\nexcept restart.RestartError as e:\n"
             "    print(e)\n")  # fmt: skip
    out = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", probe, path], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"crio: {path} is served by a process outside this PID namespace"), out.stdout
    assert len(log.read_text().split()) == 1 and restart.serving(path) is not None
