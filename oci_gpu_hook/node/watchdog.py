"""`oci-gpu-hook watchdog`: GPU memory limits on shared GPUs, enforced.

Every interval it reads which processes use each GPU and MIG device and how much memory (NVML,
through the one reader), finds each process's container (its cgroup against the records), sums
the use per container and device, and compares it with the limit the hook recorded
(memory_limit.py). Over the limit, by policy: `kill` sends SIGKILL to that container's processes
on that device, once the use has stayed over for the grace period; `warn` only reports. Every
action is a JSON log line and a count the exporter serves; --dry-run says what it would do.

Safety first: a process is only ever killed when it is attributed to a running container that
has a limit on that device. Host processes, containers without a record or a limit, and pids
that were reused are left alone: just before the kill the process is opened as a pidfd, and its
start time and cgroup are checked again through /proc while that pidfd pins it, so the signal
reaches the process that was measured or nobody.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from oci_gpu_hook.errors import NvmlError
from oci_gpu_hook.node import attribution, beat
from oci_gpu_hook.node import say as node_say
from oci_gpu_hook.start import container_record, pids
from oci_gpu_hook.start.linux import cgroups

# Beside the records directory; the exporter serves it. Like the records, a file of
# settings.CACHE_UID's (settings.write_trusted): a uid 0 without capabilities, who may write
# root's files there, must not put counts of its own on the exporter's page.
COUNTERS_FILE = "watchdog.json"


def counters_path(records_directory: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(records_directory)), COUNTERS_FILE)


def log(entry: dict) -> None:
    """One action as a JSON line on stdout; lost, as say()'s lines are, where no one reads it."""
    try:
        sys.stdout.write(json.dumps(entry, sort_keys=True) + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        pass


def say(message: str) -> None:
    node_say("watchdog", message)


class Over:
    """A container's use of one device over its limit, as one scan saw it."""

    def __init__(self, record: dict, device, used: int, limit: int, processes: list):
        self.record, self.device, self.used, self.limit = record, device, used, limit
        self.processes = processes  # [(pid, start ticks)] of the container's processes there

    @property
    def key(self) -> tuple:
        return (self.record["id"], self.record.get("pid_start"), self.device.uuid)


def find_over(samples, live: list, proc: str = "/proc") -> list:
    """Pure but for /proc reads: every (container, device) whose use is over its limit."""
    use = {}
    for sample in attribution.leaf_samples(samples):
        for pid, size in sample.processes:
            record = attribution.container_of(pid, live, proc)
            limits = (record or {}).get("gpu_memory_limit") or {}
            if sample.device.uuid not in limits:
                continue  # a host process, or a container without a limit here: never touched
            ticks = pids.start_ticks(pid, proc)
            if ticks is None:
                continue  # gone meanwhile
            key = (record["id"], sample.device.uuid)
            entry = use.setdefault(key, [record, sample.device, 0, []])
            entry[2] += size
            entry[3].append((pid, ticks))
    return [
        Over(record, device, used, record["gpu_memory_limit"][device.uuid], processes)
        for record, device, used, processes in use.values()
        if used > record["gpu_memory_limit"][device.uuid]
    ]


def kill_verified(pid: int, ticks: int, container_cgroup: str, proc: str = "/proc") -> bool:
    """SIGKILL pid only if, pinned by a pidfd, it is still the process that started at ticks and
    lies in the container's cgroup; True when the signal was sent."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False  # gone
    try:
        if pids.start_ticks(pid, proc) != ticks:
            return False  # the pid names another process now
        cgroup = attribution.process_cgroup(pid, proc)
        if cgroup is None or not cgroups.is_within(cgroup, container_cgroup):
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)


class Watchdog:
    def __init__(self, reader, records_directory: str, policy: str = "kill", grace: float = 0.0, dry_run: bool = False,
                 proc: str = "/proc", clock=time.monotonic, keep_counters: bool = True):  # fmt: skip
        self.reader, self.records_directory = reader, records_directory
        self.keep_counters = keep_counters  # the service's: a one-off run must not replace its counts
        self.policy, self.grace, self.dry_run = policy, grace, dry_run
        self.proc, self.clock = proc, clock
        self.first_over = {}  # Over.key -> when the use was first seen over the limit
        self.reported = set()  # Over.key already warned about (one line per episode)
        self.counters = {}
        self.nvml_failing = False
        self.records = attribution.Records(records_directory, say)

    def scan(self) -> list:
        """One pass; returns the log entries of what it did."""
        records = self.records.read()
        if records is None:
            return []
        live = attribution.started(container_record.live(records, self.proc))
        try:
            samples = self.reader.read()
            if self.nvml_failing:
                say("NVML answers again")
            self.nvml_failing = False
        except NvmlError as e:
            if not self.nvml_failing:
                say(f"{e.message}; no action until NVML answers")
            self.nvml_failing = True
            return []
        now = self.clock()
        entries = []
        over_now = set()
        for over in find_over(samples, live, self.proc):
            over_now.add(over.key)
            since = self.first_over.setdefault(over.key, now)
            if self.policy == "warn" or now - since < self.grace:
                if over.key not in self.reported and self.policy == "warn":
                    entries.append(self._act("warn", over, []))
                    self.reported.add(over.key)
                continue
            if self.dry_run:
                if over.key not in self.reported:
                    entries.append(self._act("would-kill", over, [pid for pid, _ in over.processes]))
                    self.reported.add(over.key)
                continue
            killed = [pid for pid, ticks in over.processes
                      if kill_verified(pid, ticks, over.record["cgroup"], self.proc)]  # fmt: skip
            if killed:  # a line and a count for each kill, none for a scan that found them gone
                entries.append(self._act("kill", over, killed))
        for key in set(self.first_over) - over_now:  # back under the limit, or gone
            del self.first_over[key]
            self.reported.discard(key)
        return entries

    def _act(self, action: str, over: Over, pids_: list) -> dict:
        names = over.record.get("kubernetes") or {}
        entry = {"time": round(time.time(), 3), "action": action, "container_id": over.record["id"],
                 "pod": names.get("pod"), "namespace": names.get("namespace"), "container": names.get("container"),
                 "device": over.device.uuid, "gpu": over.device.gpu_index, "used_bytes": over.used,
                 "limit_bytes": over.limit, "pids": pids_}  # fmt: skip
        log(entry)
        self.counters[action] = self.counters.get(action, 0) + 1
        if self.keep_counters:
            self._write_counters()
        return entry

    def _write_counters(self) -> None:
        from oci_gpu_hook.start.settings import write_trusted

        try:
            doc = {"format": 1, "pid": os.getpid(), "actions": self.counters}
            write_trusted(counters_path(self.records_directory), json.dumps(doc).encode())
        except OSError as e:
            say(f"cannot write its counters: {e}")


def read_counters(records_directory: str) -> dict:
    """{action: count} of the running watchdog, for the exporter; {} when there is none, or when
    the file is not one the watchdog wrote (settings.read_trusted: anyone else's counts)."""
    from oci_gpu_hook.start.settings import read_trusted

    try:
        doc = json.loads(read_trusted(counters_path(records_directory), 1 << 16))
        actions = doc["actions"]
        if pids.start_ticks(doc["pid"]) is None:
            return {}  # that watchdog has stopped: its counts ended with it
        if isinstance(actions, dict) and all(isinstance(v, int) for v in actions.values()):
            return {str(k): v for k, v in actions.items()}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return {}


def run(settings, interval: float, policy: str, grace: float, dry_run: bool, once: bool = False,
        heartbeat: str | None = None) -> int:  # fmt: skip
    from oci_gpu_hook.errors import PrerequisiteError
    from oci_gpu_hook.node.nvml_reader import RESTART, DriverChanged, HostReader

    if os.geteuid() != 0:
        raise PrerequisiteError("the watchdog needs root: it reads every process's cgroup and kills")
    if not attribution.sees_host_processes():
        say("not in the host's PID namespace: no container can be seen, so nothing will be enforced "
            "(run it on the host, or with hostPID)")  # fmt: skip
    watchdog = Watchdog(HostReader(settings), settings.records_path, policy, grace, dry_run,
                        keep_counters=not once)  # fmt: skip
    say(f"watching {settings.records_path} every {interval:g} s: policy {policy}"
        + (f", grace {grace:g} s" if grace else "") + (", dry run" if dry_run else ""))  # fmt: skip
    while True:
        started = time.monotonic()
        try:
            watchdog.scan()
        except DriverChanged as e:  # a new driver's NVML needs a new process
            say(str(e))
            return RESTART
        if once:
            return 0
        beat("watchdog", heartbeat)
        time.sleep(max(0.0, interval - (time.monotonic() - started)))
