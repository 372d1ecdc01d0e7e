"""The hook's record of each GPU container start: which container, which devices it got, its init
process and cgroup, its Kubernetes names, how long the hook took, and, for a start that failed,
why. The node services read these (the exporter: which container holds a device, and the hook's
counters; the watchdog: whose GPU process it is) instead of asking the kubelet or the runtime.

One small JSON file per container, in records_directory (root's alone), put in place by one
atomic rename: the only write this adds to a GPU container's start. The file is the hook's own
uid's (settings.CACHE_UID, made by settings.write_trusted), and the readers take no other: a uid 0
without capabilities (a container's root given the host's /run) owns root's directory and may
make files of root's in it, but none of that uid's, so it cannot forge a record that aims the
watchdog at a process or puts a pod's name on a GPU. A record names a live container only while
its init process has the recorded start time (pids are reused); the readers collect the rest
(collect()). The hook collects too, but only when the directory has grown past COLLECT_ABOVE
files (looked at by one start in CHECK_ONE_IN), so a host with no node service running stays
bounded at little cost; and a start server's spare worker collects whenever it has waited idle
(start/server.py, Spare), the records written over KEEP_FOR_READERS_SECONDS ago, so that with the
server no record outlives its container for long, and the exporter still counts every start.
Standard library only: this is on the start path.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from oci_gpu_hook.errors import HookError, exit_reason, printable
from oci_gpu_hook.start import jsonio, pids, report, settings
from oci_gpu_hook.start.linux import cgroups

FORMAT = 1
SUFFIX = ".json"
MAX_RECORD_BYTES = 64 << 10
COLLECT_ABOVE = 512
CHECK_ONE_IN = 16
# The exporter counts each start (and each failed one) from its record, at its scrape: a start
# server's idle spare leaves a gone container's record this long after it was written, so that a
# scrape (every 15 to 60 s) sees it first. The hook's own collection and the readers' need none.
KEEP_FOR_READERS_SECONDS = 120
# Pod, namespace and container names as the runtimes pass them into config.json: containerd's
# CRI plugin first, then CRI-O's.
KUBERNETES_ANNOTATIONS = {
    "pod": ("io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"),
    "namespace": ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.pod.namespace"),
    "container": ("io.kubernetes.cri.container-name", "io.kubernetes.container.name"),
}
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_+-.")
_MAX_NAME = 240
# Kubernetes' longest object name (a DNS subdomain); pod, namespace and container names are
# shorter. Longer annotation values are cut: they cannot be real names.
MAX_KUBERNETES_NAME = 253
# A longer container id is recorded as its SHA-256 ("sha256:<hex>"), like its file name.
MAX_ID = 1024


def file_name(container_id: str) -> str:
    """The record's file name: the id itself when it is made of the characters runc allows in ids
    (podman's and CRI-O's 64 hex digits are), else '%' and the id's bytes in hex; an id too long
    for that is named '#' and its SHA-256, so that every container has its record."""
    if container_id and set(container_id) <= _SAFE and not container_id.startswith("."):
        name = container_id
    else:
        name = "%" + container_id.encode("utf-8", "surrogatepass").hex()
    if len(name) > _MAX_NAME:
        name = "#" + _digest(container_id)
    return name + SUFFIX


def _digest(container_id: str) -> str:
    """The SHA-256 of an id too long to keep as it is (for its file name, and in the record)."""
    import hashlib  # rare: not worth its import on every start

    return hashlib.sha256(container_id.encode("utf-8", "surrogatepass")).hexdigest()


def kubernetes_names(annotations: dict) -> dict | None:
    """The pod's, namespace's and container's names, each cut to MAX_KUBERNETES_NAME characters
    and made printable: they come from annotations, which whoever creates the container writes,
    and a record must stay small and readable whatever they hold (its limit lives in it)."""
    names = {}
    for field, keys in KUBERNETES_ANNOTATIONS.items():
        for key in keys:
            value = annotations.get(key)
            if value and isinstance(value, str):
                names[field] = printable(value[:MAX_KUBERNETES_NAME])[:MAX_KUBERNETES_NAME]
                break
    return names or None


def recorded_id(container_id: str) -> str:
    return container_id if len(container_id) <= MAX_ID else "sha256:" + _digest(container_id)


def describe_devices(devices) -> list:
    """The selected devices (plan.SelectedDevice) as the records keep them."""
    return [d.summary() for d in devices]


def build(container, annotations: dict, devices, duration: float, failure_code: int | None = None,
          gpu_memory_limit=None, applied_by: str = "hook") -> dict:  # fmt: skip
    """The record of one start (pure, but for reading the init process's start time and cgroup).
    applied_by: who gave the container its devices: the hook, or the runtime (CDI; the hook only
    recorded the container)."""
    cgroup = None
    if container.pid:
        try:
            cgroup = cgroups.identity(cgroups.read_cgroup_file(container.pid))
        except cgroups.CgroupError:
            pass
    return {
        "format": FORMAT,
        "id": recorded_id(container.id),
        "outcome": "failed" if failure_code is not None else "started",
        "reason": exit_reason(failure_code) if failure_code is not None else None,
        "devices": describe_devices(devices),
        "pid": container.pid,
        "pid_start": pids.start_ticks(container.pid) if container.pid else None,
        "cgroup": cgroup,
        "kubernetes": kubernetes_names(annotations),
        "gpu_memory_limit": gpu_memory_limit,
        "applied_by": applied_by,
        "via": report.VIA,  # None: the hook's own process; "start server": a server's worker
        "time": round(time.time(), 3),
        "duration_seconds": round(duration, 6),
    }


def _owned_alone(st) -> bool:
    """The rule for the records directory, for the writer and the readers alike: a directory of
    this user's (root's) that no one else can enter, read or change. It keeps other users out; it
    does not make a record trusted (a uid 0 without capabilities is its owner too, and may remove
    records, or add files of root's, which read_all refuses)."""
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _directory(path: str) -> bool:
    """Make records_directory (0700) if missing; False when it is not root's alone (or not a
    directory): no record is written there then, for anyone could forge or read them."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    return _owned_alone(os.lstat(path))


class UntrustedRecords(HookError):
    """The records directory is not root's alone: what is in it may be forged (a record naming
    another container's cgroup could aim the watchdog at it), so none of it is read."""

    def __init__(self, directory: str):
        super().__init__(f"{directory}: the container records directory is not root's alone (it must be a "
                         "directory of root's, mode 0700, not a symlink); no record in it is trusted")  # fmt: skip


def encode(record: dict) -> bytes:
    """The record's bytes, never over MAX_RECORD_BYTES: a record the readers refused would leave its
    container without its GPU memory limit. What the container's creator chooses (names, id) is
    bounded when the record is built, so this only guards: should a record still not fit, its
    Kubernetes names go, and failing that it is not written (OSError, a warning in the log)."""
    data = jsonio.dumps(record).encode()
    if len(data) > MAX_RECORD_BYTES and record.get("kubernetes"):
        data = jsonio.dumps({**record, "kubernetes": None}).encode()
    if len(data) > MAX_RECORD_BYTES:
        raise OSError(errno.EFBIG, f"the record would be {len(data)} bytes (at most {MAX_RECORD_BYTES})")
    return data


def write(directory: str, record: dict) -> bool:
    """Put the record in place, as a file the readers trust (settings.write_trusted); False
    (nothing written) when the directory cannot be trusted. OSError from the write itself goes to
    the caller (a root without CAP_CHOWN writes none: no reader would take it)."""
    if not _directory(directory):
        return False
    data = encode(record)
    # Not durable: /run does not outlive a reboot, nor do the containers.
    settings.write_trusted(os.path.join(directory, file_name(record["id"])), data)
    # Listing a directory of hundreds of records costs more than writing one: one start in
    # CHECK_ONE_IN looks (at random, so no pattern of starts can dodge it).
    if os.urandom(1)[0] < 256 // CHECK_ONE_IN and len(os.listdir(directory)) > COLLECT_ABOVE:
        collect(directory)
    return True


# --- the readers' side --------------------------------------------------------------------------


def parse(data: bytes) -> dict | None:
    """A record from a file's bytes; None for anything that is not one of ours (garbage, another
    format, a wrong type in a field the readers rely on)."""
    try:
        record = jsonio.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return None
    checks = {"id": str, "outcome": str, "devices": list, "time": (int, float), "duration_seconds": (int, float)}
    if not all(isinstance(record.get(k), t) and not isinstance(record.get(k), bool) for k, t in checks.items()):
        return None
    for key in ("pid", "pid_start"):
        if record.get(key) is not None and (not isinstance(record[key], int) or isinstance(record[key], bool)):
            return None
    for field in ("cgroup", "reason"):
        if record.get(field) is not None and not isinstance(record[field], str):
            return None
    if record.get("kubernetes") is not None and not (
        isinstance(record["kubernetes"], dict) and all(isinstance(v, str) for v in record["kubernetes"].values())
    ):
        return None
    for device in record["devices"]:
        if not isinstance(device, dict) or not isinstance(device.get("gpu_uuid"), str):
            return None
    limits = record.get("gpu_memory_limit")
    if limits is not None and not (
        isinstance(limits, dict)
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in limits.values())
    ):
        return None
    return record


def is_live(record: dict, proc: str = "/proc") -> bool:
    """The record's container is still running: its init pid has the recorded start time."""
    return record.get("pid") is not None and pids.is_same_process(record["pid"], record.get("pid_start"), proc)


def read_all(directory: str, refused: dict | None = None, stop=None) -> dict:
    """{file name: record or None (garbage)} for every record file; {} when there is no directory;
    UntrustedRecords when it is not root's alone. A file the hook did not write (not a regular
    file of settings.CACHE_UID's that no one else may write: settings.read_trusted, checked on the
    descriptor read), a symlink, or one too large is garbage, and refused gets {name: why}.
    stop: asked before each file; once it says True, those read so far."""
    records = {}
    try:
        if not _owned_alone(os.lstat(directory)):
            raise UntrustedRecords(directory)
        names = os.listdir(directory)
    except OSError:
        return records
    for name in names:
        if not name.endswith(SUFFIX) or name.startswith("."):
            continue
        if stop is not None and stop():
            break
        try:
            data = settings.read_trusted(os.path.join(directory, name), MAX_RECORD_BYTES)
        except (OSError, ValueError) as e:
            if isinstance(e, OSError) and e.errno != errno.ELOOP:
                continue  # gone meanwhile
            records[name] = None
            if refused is not None:
                refused[name] = f"not a record the hook wrote: {'a symlink' if isinstance(e, OSError) else e}"
            continue
        records[name] = parse(data)
    return records


def live(records: dict, proc: str = "/proc") -> dict:
    """{file name: record} of the records (read_all) whose container is still running."""
    return {name: r for name, r in records.items() if r is not None and is_live(r, proc)}


def remove(directory: str, names) -> list:
    """Unlink the named record files; returns the names removed."""
    removed = []
    for name in names:
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def collect(directory: str, records: dict | None = None, proc: str = "/proc", stop=None,
            written_before: float | None = None) -> list:  # fmt: skip
    """Remove the records of containers that are gone, and garbage; returns the names removed.
    stop: as read_all's (a start server's idle spare stops when an offer comes); written_before:
    only files last written before this time (time.time()) go."""
    records = read_all(directory, stop=stop) if records is None else records
    running = live(records, proc)
    gone = [name for name in records if name not in running]
    if written_before is not None:
        gone = [name for name in gone if _written_before(os.path.join(directory, name), written_before)]
    return remove(directory, gone)


def _written_before(path: str, when: float) -> bool:
    try:
        return os.lstat(path).st_mtime < when
    except OSError:
        return False  # gone meanwhile
