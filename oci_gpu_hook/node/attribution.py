"""Who holds what: the live container records against the devices and GPU processes NVML
reports. A device is held by the containers whose record names it; a GPU process belongs to the
container whose cgroup holds the process (cgroups.identity of /proc/<pid>/cgroup, the same
reading the hook recorded for the container's init process). Nothing is attributed by the root
cgroup, nor to a record without a cgroup: a host process is nobody's container.
"""

from __future__ import annotations

import os

from oci_gpu_hook.start import container_record
from oci_gpu_hook.start.linux import cgroups

# The initial PID namespace's inode number is fixed by the kernel (PROC_PID_INIT_INO).
_INIT_PID_NAMESPACE = 0xEFFFFFFC


def sees_host_processes(proc: str = "/proc") -> bool:
    """This process is in the host's PID namespace, where the records' pids mean what they say."""
    try:
        return os.stat(f"{proc}/self/ns/pid").st_ino == _INIT_PID_NAMESPACE
    except OSError:
        return False


class Records:
    """The container records as a node service reads them on each pass. While their directory is
    not root's alone, none are read (forged ones could aim the watchdog at any container, or
    put any names on the exporter's page): the service says so once, and once when it ends. A
    file in it the hook did not write (container_record.read_all's refused) is garbage, said once
    while it is there, with refusal: what the service does with it (the exporter removes it)."""

    def __init__(self, directory: str, tell, refusal: str = "not acted on"):
        self.directory, self.tell, self.refusal = directory, tell, refusal
        self.untrusted = False
        self.refused = {}  # {file name: why}, of the last read

    def read(self) -> dict | None:
        """container_record.read_all's answer, or None while the directory is untrusted."""
        refused = {}
        try:
            records = container_record.read_all(self.directory, refused)
        except container_record.UntrustedRecords as e:
            if not self.untrusted:
                self.tell(f"{e.message}; nothing is attributed or enforced until that is mended")
            self.untrusted = True
            return None
        if self.untrusted:
            self.tell(f"{self.directory}: the container records directory is root's alone again")
        self.untrusted = False
        for name in sorted(set(refused) - set(self.refused)):
            self.tell(f"{self.directory}/{name}: {refused[name]}; {self.refusal}")
        self.refused = refused
        return records


def started(running: dict) -> list:
    """Of the records of running containers (container_record.live), those the hook configured
    (not failed starts)."""
    return [r for r in running.values() if r["outcome"] == "started"]


def device_uuids(record: dict) -> set:
    """The devices a container holds: a MIG device by its own UUID, a whole GPU by the GPU's."""
    return {d.get("mig_uuid") or d["gpu_uuid"] for d in record["devices"]}


def holders(live: list) -> dict:
    """{device uuid: [records of the containers holding it]}."""
    held = {}
    for record in live:
        for uuid in device_uuids(record):
            held.setdefault(uuid, []).append(record)
    return held


def process_cgroup(pid: int, proc: str = "/proc") -> str | None:
    try:
        return cgroups.identity(cgroups.read_cgroup_file(pid, proc))
    except cgroups.CgroupError:
        return None


def container_of(pid: int, live: list, proc: str = "/proc") -> dict | None:
    """The record of the container whose cgroup holds pid (the innermost, should two nest)."""
    cgroup = process_cgroup(pid, proc)
    if cgroup is None:
        return None
    matches = [r for r in live if r.get("cgroup") and cgroups.is_within(cgroup, r["cgroup"])]
    return max(matches, key=lambda r: len(r["cgroup"]), default=None)


def leaf_samples(samples) -> list:
    """The samples whose processes are each counted once: MIG devices, and GPUs without MIG (a
    MIG GPU's own list repeats its MIG devices' processes)."""
    with_mig = {s.device.gpu_uuid for s in samples if s.device.gi is not None}
    return [s for s in samples if s.device.gi is not None or s.device.uuid not in with_mig]


class Owners:
    """pid -> the record of the container whose cgroup holds it (container_of), each pid's cgroup
    read once per pass however many devices and lists name it."""

    def __init__(self, live: list, proc: str = "/proc"):
        self.live, self.proc, self.known = live, proc, {}

    def __call__(self, pid: int) -> dict | None:
        if pid not in self.known:
            self.known[pid] = container_of(pid, self.live, self.proc)
        return self.known[pid]


def memory_by_container(samples, live: list, proc: str = "/proc", owner=None) -> list:
    """[(record, device, bytes)]: GPU memory each container's processes use on each device."""
    owner = owner or Owners(live, proc)
    used = {}
    for sample in leaf_samples(samples):
        for pid, size in sample.processes:
            record = owner(pid)
            if record is not None:
                key = (record["id"], sample.device)
                used[key] = (record, sample.device, used.get(key, (None, None, 0))[2] + size)
    return list(used.values())


def utilization_by_container(samples, live: list, proc: str = "/proc", owner=None) -> list:
    """[(record, device, (sm, memory, encoder, decoder) %)]: each holder of a device whose NVML
    keeps per-process utilization, summed over its processes' newest samples; a holder none of
    whose processes has a sample since the last read used it 0%."""
    owner = owner or Owners(live, proc)
    held = holders(live)
    found = []
    for sample in leaf_samples(samples):
        if sample.utilization is None:
            continue
        use = {record["id"]: [0, 0, 0, 0] for record in held.get(sample.device.uuid, ())}
        for pid, *percent in sample.utilization:
            record = owner(pid)
            if record is not None and record["id"] in use:
                use[record["id"]] = [a + b for a, b in zip(use[record["id"]], percent)]
        for record in held.get(sample.device.uuid, ()):
            found.append((record, sample.device, tuple(min(100, p) for p in use[record["id"]])))
    return found
