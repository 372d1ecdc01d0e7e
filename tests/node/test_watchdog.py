"""The GPU memory watchdog against real runc containers on a simulated host: three containers
share GPU 0 with limits, a fourth shares it with none, and a host process uses it too. Only the
container over its limit loses its GPU processes; warn and dry-run kill nothing; a record whose
pid was reused gets no process killed; a bad limit stops the start with nothing left behind."""

import json
import os
import subprocess
import time

import hookcheck
import pytest

from oci_gpu_hook.node import watchdog as watchdog_module
from oci_gpu_hook.start import container_record, pids
from oci_gpu_hook.start.memory_limit import ENV
from oci_gpu_hook.toolkit import containers
from oci_gpu_hook.toolkit.simulate import control

pytestmark = [pytest.mark.host(gpus=2, mig=[], needs=("runc", "busybox", "pynvml")),
              pytest.mark.usefixtures("fresh_nvml_values")]  # fmt: skip

GIB, MIB = 1 << 30, 1 << 20


@pytest.fixture
def shared_gpu(host, tmp_path):
    """Four running containers on GPU 0 (limits 1 GiB, 2 GiB, 25%, none) and a host process;
    yields {name: init pid} with "host" for the host process."""
    names = []
    running = {}
    host_process = subprocess.Popen(["sleep", "600"])
    try:
        for name, limit in (("small", "1GiB"), ("over", "2GiB"), ("share", "25%"), ("free", None)):
            env = {"NVIDIA_VISIBLE_DEVICES": "0", **({ENV: limit} if limit else {})}
            container_id = f"ocigpu-wd-{os.getpid()}-{name}"
            bundle = containers.make_bundle(str(tmp_path / name), args=["busybox", "sleep", "600"], env=env,
                                            config_file=f"{host['root']}/config.yaml")  # fmt: skip
            names.append(container_id)
            running[name] = hookcheck.runc_detached(bundle, container_id)
        running["host"] = host_process.pid
        yield running
    finally:
        for container_id in names:
            hookcheck.runc_delete(container_id)
        host_process.kill()
        host_process.wait()


def use(host, running, over_by=1, fail=None):
    """Each process's GPU 0 memory: `over` uses 2 GiB + over_by MiB against its 2 GiB limit; the
    rest stay under theirs, or have none (the free container and the host use far more). fail:
    an nvmlReturn_t every NVML call answers with instead."""
    gpu0 = host["gpus"][0]["uuid"]
    sizes = {"small": 512 * MIB, "over": 2 * GIB + over_by * MIB, "share": 9 * GIB, "free": 30 * GIB,
             "host": 35 * GIB}  # fmt: skip
    control.write(host["root"], processes=[(gpu0, running[name], size) for name, size in sizes.items()], fail=fail)


def watchdog(host, *args, timeout=60):
    return subprocess.run([*containers.hook_command(f"{host['root']}/config.yaml"), "watchdog", *args],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def alive(pid) -> bool:
    return pids.start_ticks(pid) is not None  # a zombie is not alive


def wait_until(condition, what: str, timeout: float = 60) -> None:
    """Wait for condition() to hold; a generous timeout, so that only its never coming fails."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.02)


def test_limits_are_recorded_per_device(host, shared_gpu):
    records = {r["pid"]: r for r in container_record.read_all(f"{host['root']}/containers").values() if r}
    gpu0 = host["gpus"][0]
    memory = gpu0["model"]["memory_total"]
    assert records[shared_gpu["small"]]["gpu_memory_limit"] == {gpu0["uuid"]: GIB}
    assert records[shared_gpu["share"]]["gpu_memory_limit"] == {gpu0["uuid"]: memory // 4}
    assert records[shared_gpu["free"]]["gpu_memory_limit"] is None


def test_one_scan_kills_exactly_the_container_over_its_limit(host, shared_gpu):
    use(host, shared_gpu)
    done = watchdog(host, "--once")
    assert done.returncode == 0, done.stderr
    (entry,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert (entry["action"], entry["pids"], entry["used_bytes"], entry["limit_bytes"]) == (
        "kill",
        [shared_gpu["over"]],
        2 * GIB + MIB,
        2 * GIB,
    )
    assert entry["device"] == host["gpus"][0]["uuid"]
    deadline = time.monotonic() + 10
    while alive(shared_gpu["over"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(shared_gpu["over"])
    assert all(alive(shared_gpu[name]) for name in ("small", "share", "free", "host"))


def test_the_daemon_scans_again_and_kills_once_the_use_goes_over(host, shared_gpu, tmp_path):
    """The daemon keeps scanning: a use at the limit is left alone, and the same container going
    over later is killed by a later scan, once. A failing NVML makes its scans visible (one line
    when NVML fails, one when it answers again), so each step below waits for a scan that saw it.
    How soon the kill comes is the bench's to measure, not a test's to assert."""
    log_path = tmp_path / "watchdog.log"

    def lines():
        return log_path.read_text().splitlines()

    use(host, shared_gpu, over_by=0, fail=999)  # NVML_ERROR_UNKNOWN until the daemon has scanned once
    with open(log_path, "w+") as log:
        daemon = subprocess.Popen([*containers.hook_command(f"{host['root']}/config.yaml"), "watchdog", "--interval",
                                   "0.5"], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            wait_until(lambda: any("no action until NVML answers" in line for line in lines()), "a failed scan")
            use(host, shared_gpu, over_by=0)  # at the limit, not over it: nothing happens
            wait_until(lambda: any("NVML answers again" in line for line in lines()), "a scan at the limit")
            assert alive(shared_gpu["over"])
            use(host, shared_gpu, over_by=1)
            wait_until(lambda: not alive(shared_gpu["over"]), "the kill of the container over its limit")
            assert all(alive(shared_gpu[name]) for name in ("small", "share", "free", "host"))
            # What the exporter serves while the daemon runs (written just after the kill), and no
            # more once it stops.
            wait_until(lambda: watchdog_module.read_counters(f"{host['root']}/containers") == {"kill": 1},
                       "the kill counted")  # fmt: skip
        finally:
            daemon.terminate()
            daemon.wait()
    text = lines()
    kills = [(i, json.loads(line)) for i, line in enumerate(text) if line.startswith("{")]
    # One kill, on a sample over the limit (not the one at it), after the scan that saw the limit.
    assert [(k["action"], k["pids"], k["used_bytes"]) for _, k in kills] == [("kill", [shared_gpu["over"]],
                                                                              2 * GIB + MIB)]  # fmt: skip
    again = next(i for i, line in enumerate(text) if "NVML answers again" in line)
    assert kills[0][0] > again, text
    assert watchdog_module.read_counters(f"{host['root']}/containers") == {}


@pytest.mark.parametrize("args, action", [(["--policy", "warn"], "warn"), (["--dry-run"], "would-kill")])
def test_warn_and_dry_run_kill_nothing(host, shared_gpu, args, action):
    use(host, shared_gpu)
    done = watchdog(host, "--once", *args)
    assert done.returncode == 0, done.stderr
    (entry,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert entry["action"] == action and entry["container_id"].endswith("-over")
    time.sleep(0.2)
    assert all(alive(pid) for pid in shared_gpu.values())


def test_a_reused_pid_is_not_killed(host, shared_gpu):
    """The record of `over` is made to name another start time (its pid reused): the process on
    that pid is not the recorded container, so nothing is attributed, and nothing killed."""
    directory = f"{host['root']}/containers"
    (name,) = [n for n, r in container_record.read_all(directory).items() if r and r["pid"] == shared_gpu["over"]]
    record = json.load(open(os.path.join(directory, name)))
    record["pid_start"] -= 1
    container_record.write(directory, record)
    use(host, shared_gpu)
    done = watchdog(host, "--once")
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr
    assert all(alive(pid) for pid in shared_gpu.values())


def test_failing_nvml_kills_nothing_and_keeps_running(host, shared_gpu):
    use(host, shared_gpu)
    text = open(os.path.join(host["root"], control.FILE)).read()
    with open(os.path.join(host["root"], control.FILE), "w") as f:
        f.write("fail 999\n" + text)
    done = watchdog(host, "--once")
    assert done.returncode == 0 and done.stdout == ""
    assert "no action until NVML answers" in done.stderr and "Traceback" not in done.stderr
    assert all(alive(pid) for pid in shared_gpu.values())


@pytest.mark.parametrize(
    "limit, words",
    [("lots", "not a GPU memory limit"), ("0MiB", "above zero"), ("-1GiB", "above zero"),
     ("100GiB", "is larger than")],
)  # fmt: skip
def test_a_bad_limit_stops_the_start_and_leaves_nothing(host, tmp_path, limit, words):
    container_id = f"ocigpu-wd-{os.getpid()}-bad"
    bundle = containers.make_bundle(str(tmp_path / "bad"), args=["true"],
                                    env={"NVIDIA_VISIBLE_DEVICES": "0", ENV: limit},
                                    config_file=f"{host['root']}/config.yaml")  # fmt: skip
    rootfs_before = hookcheck.tree(os.path.join(bundle, "rootfs"))
    done = containers.runc_run(bundle, container_id)
    assert done.returncode != 0
    (line,) = [line for line in done.stderr.splitlines() if "oci-gpu-hook:" in line]
    assert words in line and (ENV in line or words == "is larger than"), line
    assert "Traceback" not in done.stderr
    assert not os.path.exists(f"/sys/fs/cgroup/devices/{container_id}")
    listed = subprocess.run(["runc", "list", "-q"], capture_output=True, text=True).stdout.split()
    assert container_id not in listed
    assert hookcheck.tree(os.path.join(bundle, "rootfs")) == rootfs_before


def test_a_container_cannot_escape_its_limit_through_its_annotations(host, tmp_path):
    """A 70 KB pod name used to make the container's record larger than the readers take, so the
    watchdog never saw its limit; a lone surrogate could not be printed. Both are bounded when the
    record is written: the container over its limit is killed, and its names are in the log."""
    annotations = {"io.kubernetes.cri.sandbox-name": "p" * 70_000, "io.kubernetes.cri.sandbox-namespace": "ns\ud800",
                   "io.kubernetes.cri.container-name": "cuda"}  # fmt: skip
    container_id = f"ocigpu-wd-{os.getpid()}-annotated"
    bundle = containers.make_bundle(str(tmp_path / "annotated"), args=["busybox", "sleep", "600"],
                                    env={"NVIDIA_VISIBLE_DEVICES": "0", ENV: "1GiB"}, annotations=annotations,
                                    config_file=f"{host['root']}/config.yaml")  # fmt: skip
    try:
        pid = hookcheck.runc_detached(bundle, container_id)
        control.write(host["root"], processes=[(host["gpus"][0]["uuid"], pid, GIB + MIB)])
        done = watchdog(host, "--once")
        assert done.returncode == 0, done.stderr
        (entry,) = [json.loads(line) for line in done.stdout.splitlines()]
        assert (entry["action"], entry["pids"], entry["limit_bytes"]) == ("kill", [pid], GIB)
        assert entry["pod"] == "p" * container_record.MAX_KUBERNETES_NAME and entry["namespace"] == "ns\\ud800"
        wait_until(lambda: not alive(pid), "the container over its limit is gone")
    finally:
        hookcheck.runc_delete(container_id)


def test_records_in_a_directory_others_can_change_are_not_acted_on(host, shared_gpu):
    """A record forged by whoever can write the directory could name another container's cgroup:
    nothing is read from it, one line says why, and nothing is killed."""
    directory = f"{host['root']}/containers"
    use(host, shared_gpu)
    os.chmod(directory, 0o733)
    try:
        done = watchdog(host, "--once")
    finally:
        os.chmod(directory, 0o700)
    assert done.returncode == 0 and done.stdout == ""
    assert f"{directory}: the container records directory is not root's alone" in done.stderr
    assert all(alive(pid) for pid in shared_gpu.values())
    assert [json.loads(line)["action"] for line in watchdog(host, "--once").stdout.splitlines()] == ["kill"]


def test_the_daemon_beats_after_every_scan(host, tmp_path):
    """--heartbeat FILE: the DaemonSet's liveness probe reads FILE's age, since a scan stuck in
    NVML leaves the process running and the kubelet seeing nothing wrong. FILE is touched after
    every scan; one that cannot be written is said once, and the daemon goes on scanning."""
    beats = tmp_path / "heartbeats"
    heartbeat = beats / "watchdog"
    log_path = tmp_path / "watchdog.log"
    with open(log_path, "w+") as log:
        daemon = subprocess.Popen([*containers.hook_command(f"{host['root']}/config.yaml"), "watchdog", "--interval",
                                   "0.2", "--heartbeat", str(heartbeat)], stdout=log,
                                  stderr=subprocess.STDOUT)  # fmt: skip
        try:
            said = "cannot write the heartbeat"
            wait_until(lambda: said in log_path.read_text(), "the unwritable heartbeat said")
            time.sleep(1)  # a few more scans, each failing to beat
            beats.mkdir()
            wait_until(heartbeat.exists, "the first beat once it can be written")
            first = heartbeat.stat().st_mtime_ns
            wait_until(lambda: heartbeat.stat().st_mtime_ns != first, "a later scan's beat")
            assert daemon.poll() is None
        finally:
            daemon.terminate()
            daemon.wait()
    lines = [line for line in log_path.read_text().splitlines() if said in line]
    assert lines == [f"oci-gpu-hook watchdog: {said} {heartbeat}: No such file or directory"]
