"""Files under /run/oci-gpu-hook that others act on, planted by a uid 0 without capabilities
(issue 46): the container records (the watchdog kills the processes of a record's cgroup over
its GPU memory limit; the exporter puts a record's pod on the GPUs it names), the watchdog's
counts (the exporter serves them) and the start journal (the next start of a rootfs removes
what its journals name there).

Such a process (a container's root with its capabilities dropped, given a hostPath of the
host's /run) owns every file and directory of root's: it may make files of root's in root's
0700 directories. It may not make a file of another uid. The hook writes these files as
settings.CACHE_UID's (settings.write_trusted, new_trusted) and every reader takes no other.

Each case runs twice: the file written as the hook writes it (the control: what the test
plants is acted on), and the same file planted by the stranger (nothing is done, one line says
why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import hookcheck
import pytest
from servicecheck import Exporter
from test_untrusted_cache import AS_A_STRANGER

from oci_gpu_hook.node import watchdog
from oci_gpu_hook.start import container_record, pids, settings
from oci_gpu_hook.start.state import ContainerState
from oci_gpu_hook.toolkit import containers
from oci_gpu_hook.toolkit.simulate import control

pytestmark = pytest.mark.host(gpus=2, mig=[1], needs=("pynvml", "prometheus_client"))

BY = ["the hook", "a stranger"]
MIB = 1 << 20
ANNOTATIONS = {"io.kubernetes.pod.name": "forged-pod", "io.kubernetes.pod.namespace": "forged",
               "io.kubernetes.container.name": "forged"}  # fmt: skip

# argv: path, text, ...: each file made beside as root's own 0644 file, then renamed to path.
PLANT = r"""
import os, sys
with open("/proc/self/status") as f:
    assert os.geteuid() == 0 and "CapEff:\t0000000000000000" in f.read(), "not a uid 0 without capabilities"
for path, text in zip(sys.argv[1::2], sys.argv[2::2]):
    with open(path + ".planted", "w") as f:
        f.write(text)
    os.chmod(path + ".planted", 0o644)
    os.rename(path + ".planted", path)
"""


def plant(by: str, made: dict) -> None:
    """Put each file (path: text) in place, as the hook writes its own or as the stranger can."""
    if by == "the hook":
        for path, text in made.items():
            settings.write_trusted(path, text.encode())
        return
    argv = [*AS_A_STRANGER, sys.executable, "-I", "-c", PLANT]
    for path, text in made.items():
        argv += [path, text]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for path in made:
        st = os.lstat(path)
        assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o644)  # root's own, as an owner check sees it


def remove(*paths: str) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


@pytest.fixture
def victim(host, live_container, require):
    """A running 'container' no start gave a GPU (its init pid), which the simulated NVML says
    uses 1 GiB of GPU 0; the NVML values cleared afterwards."""
    require("root", "setpriv")
    _, _, pid, _, _ = live_container({"NVIDIA_VISIBLE_DEVICES": "void"})
    control.write(host["root"], processes=[(host["gpus"][0]["uuid"], pid, 1024 * MIB)])
    yield pid
    control.clear(host["root"])


def forged_record(host, pid: int) -> dict:
    """A record as the hook would write one for the victim, had it started it: everything in it
    readable by anyone (its pid, start time and cgroup), a GPU memory limit of one byte on GPU 0,
    and a pod of the forger's naming."""
    gpu = host["gpus"][0]
    state = ContainerState("1.0.2", f"forged-{pid}", "creating", pid, "/nowhere", {})
    record = container_record.build(state, ANNOTATIONS, (), 0.0, gpu_memory_limit={gpu["uuid"]: 1})
    record["devices"] = [{"gpu_index": 0, "gpu_uuid": gpu["uuid"], "mig_index": None, "mig_uuid": None}]
    assert record["cgroup"] and container_record.is_live(record)
    return record


def records_directory(host) -> str:
    directory = f"{host['root']}/containers"
    os.makedirs(directory, mode=0o700, exist_ok=True)  # as the hook makes it
    return directory


@pytest.mark.parametrize("by", BY)
def test_a_planted_record_makes_the_watchdog_kill_nothing(by, host, victim):
    record = forged_record(host, victim)
    path = os.path.join(records_directory(host), container_record.file_name(record["id"]))
    try:
        plant(by, {path: json.dumps(record)})
        done = subprocess.run([*containers.hook_command(f"{host['root']}/config.yaml"), "watchdog", "--once"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        remove(path)
    assert done.returncode == 0, done.stderr
    actions = [json.loads(line)["action"] for line in done.stdout.splitlines()]
    if by == "the hook":
        assert actions == ["kill"]
        return
    assert actions == [] and pids.start_ticks(victim) is not None  # not killed, not even a zombie
    assert (
        f"oci-gpu-hook watchdog: {path}: not a record the hook wrote: owned by uid 0 with mode 0644: only a "
        f"file of uid {settings.CACHE_UID} that no one else may write is used; not acted on\n"
    ) in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("by", BY)
def test_a_planted_record_and_counts_are_not_on_the_exporters_page(by, host, victim, tmp_path):
    """The record would put the forger's pod on GPU 0 and the victim's memory; the counts (of a
    live pid: 1's) would show kills that never were."""
    record = forged_record(host, victim)
    directory = records_directory(host)
    path = os.path.join(directory, container_record.file_name(record["id"]))
    counts = watchdog.counters_path(directory)
    exporter = None
    try:
        plant(by, {path: json.dumps(record), counts: json.dumps({"format": 1, "pid": 1, "actions": {"kill": 999}})})
        exporter = Exporter(f"{host['root']}/config.yaml", tmp_path)
        samples = exporter.scrape()
        output = exporter.output()
        left = os.path.exists(path)
    finally:
        if exporter is not None:
            exporter.stop()
        remove(path, counts)
    pods = [(n, ls) for n, ls, v in samples if ls.get("pod") == "forged-pod"]
    kills = [v for n, ls, v in samples if n == "oci_gpu_hook_watchdog_actions_total" and ls.get("action") == "kill"]
    if by == "the hook":
        assert pods and kills == [999]
        return
    assert pods == [] and kills == [0]  # the kill counter is on the page from the start, at 0: not the 999 planted
    assert (
        f"oci-gpu-hook exporter: {path}: not a record the hook wrote: owned by uid 0 with mode 0644: only a "
        f"file of uid {settings.CACHE_UID} that no one else may write is used; removed\n"
    ) in output
    assert "Traceback" not in output and not left


@pytest.mark.parametrize("by", BY)
def test_a_planted_journal_makes_the_next_start_remove_nothing(by, live_container, require):
    """A journal for the container's rootfs (its name: the rootfs's device and inode, which
    anyone may stat) saying that a killed apply made the image's own file: a start of that rootfs
    must not remove it."""
    require("root", "setpriv")
    state, bundle, pid, cgroup, host = live_container({"NVIDIA_VISIBLE_DEVICES": "0"})
    rootfs = os.path.join(bundle, "rootfs")
    victim = os.path.join(rootfs, "etc", "the-images-own")
    os.makedirs(os.path.dirname(victim), exist_ok=True)
    with open(victim, "w") as f:
        f.write("kept\n")
    st = os.stat(rootfs)
    rootfs_id = f"{st.st_dev:x}-{st.st_ino:x}"
    pending = f"{host['root']}/pending"
    os.makedirs(pending, mode=0o700, exist_ok=True)  # as the hook makes it
    path = f"{pending}/{rootfs_id}.{time.monotonic_ns()}"
    # As the hook writes one (linux/journal.py): the rootfs first, then what apply was about to make.
    text = json.dumps(["rootfs", rootfs_id]) + "\n" + json.dumps(["temp", "/etc/the-images-own", ""]) + "\n"
    try:
        plant(by, {path: text})
        done = hookcheck.run_hook(f"{host['root']}/config.yaml", state)
        assert done.returncode == 0, done.stderr
        if by == "the hook":
            assert not os.path.exists(victim) and not os.path.exists(path)  # recovered, as a killed start's
            return
        assert open(victim).read() == "kept\n" and os.path.exists(path)
    finally:  # the simulated host is shared: no journal may outlive the test
        remove(path)
    # Said with the start's notes (its log line "GPU devices configured").
    said = f"{path}: not a journal the hook wrote (owned by uid 0 with mode 0644); not acted on"
    (line,) = [line for line in open(f"{host['root']}/hook.log") if said in line]
    assert json.loads(line)["message"] == "GPU devices configured"
