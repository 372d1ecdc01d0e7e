"""XID health for the device plugin: a thread waits on NVML events, as NVIDIA's plugin does, and
reports each XID the configuration counts as critical against the GPU, or the MIG device, it
names; the supervisor then marks that device Unhealthy (health.py's XidMarks).

Which XIDs count: `health.criticalXids` (default: all) less `health.ignoredXids` (default:
NVIDIA's application XIDs, config.APPLICATION_XIDS). NVIDIA's environment variables are
honoured on top, so a DaemonSet written for NVIDIA's plugin means the same here:
DP_DISABLE_HEALTHCHECKS=all (or xids) turns XID health off, a list of XIDs ignores those too;
DP_ENABLE_HEALTHCHECKS lists XIDs to count even so (all: every XID, application ones included).

How an XID-unhealthy device recovers is health.py's (XidMarks.apply): when its GPU goes and comes
back (a reset, a driver reload), which NVIDIA's plugin never notices.
"""

from __future__ import annotations

import threading

from oci_gpu_hook.errors import NvmlError
from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.node.nvml_reader import DriverChanged
from oci_gpu_hook.node.plugin.config import ALL_XIDS
from oci_gpu_hook.start.digits import decimal

NO_INSTANCE = 0xFFFFFFFF  # an event's instance ids when it is about the whole GPU
WAIT_MS = 500  # one wait: how soon a stop is noticed
RETRY_SECONDS = 5.0  # after NVML failed, before events are waited on again
DISABLE_ENV, ENABLE_ENV = "DP_DISABLE_HEALTHCHECKS", "DP_ENABLE_HEALTHCHECKS"


class XidPolicy(Frozen):
    __slots__ = ("critical", "ignored", "enabled")
    critical: object  # ALL_XIDS or a frozenset
    ignored: frozenset
    enabled: frozenset  # counted whatever else says (DP_ENABLE_HEALTHCHECKS)

    def is_critical(self, xid: int) -> bool:
        if xid in self.enabled or ALL_XIDS in self.enabled:
            return True
        if xid in self.ignored:
            return False
        return self.critical == ALL_XIDS or xid in self.critical

    def describe(self) -> str:
        """What counts, in words, for the plugin's log."""
        if ALL_XIDS in self.enabled:
            return "every XID is critical"
        critical = "every XID" if self.critical == ALL_XIDS else "XIDs " + _listed(self.critical)
        ignored = self.ignored - self.enabled
        text = f"critical: {critical}" + (f" but {_listed(ignored)}" if ignored else "")
        return text + (f", and {_listed(self.enabled)}" if self.enabled else "")

    @property
    def off(self) -> bool:
        return self.critical != ALL_XIDS and not self.critical and not self.enabled


def _listed(xids) -> str:
    return ", ".join(str(x) for x in sorted(xids)) or "none"


def _xids(text: str) -> set:
    """DP_*_HEALTHCHECKS's value: XIDs, or ALL_XIDS for all/xids; malformed entries (anything but
    ASCII digits: 13¹, -1, 0x4f) are skipped, as NVIDIA's plugin skips them."""
    out: set = set()
    for part in text.lower().split(","):
        part = part.strip()
        if part in ("all", "xids"):
            return {ALL_XIDS}
        xid = decimal(part)
        if xid is not None:
            out.add(xid)
    return out


def policy(config, environ) -> XidPolicy:
    """The XIDs that make a device Unhealthy, from the configuration and NVIDIA's variables."""
    critical = config.critical_xids if config.critical_xids == ALL_XIDS else frozenset(config.critical_xids)
    ignored = set(config.ignored_xids)
    disabled = _xids(environ.get(DISABLE_ENV, ""))
    if ALL_XIDS in disabled:
        critical = frozenset()
    ignored |= disabled
    return XidPolicy(critical, frozenset(ignored), frozenset(_xids(environ.get(ENABLE_ENV, ""))))


class XidEvent(Frozen):
    __slots__ = ("gpu_uuid", "gi", "ci", "xid")
    gpu_uuid: str
    gi: int | None  # the MIG device's GPU instance, None for the whole GPU
    ci: int | None
    xid: int


class XidWatch:
    """The thread: registers the GPUs for XID events and waits, reporting the critical ones
    (report(XidEvent)) and saying the others. NVML failing is said once, then tried again."""

    # How the thread names its work in what it says; the exporter's watch counts XIDs instead.
    name = "XID health"
    unwatched = "its device nodes and NVML still count"

    def __init__(self, library_path: str, gpu_uuids, xids: XidPolicy, report, say):
        self.path, self.uuids, self.xids, self.report, self.say = library_path, tuple(gpu_uuids), xids, report, say
        self.stopping = threading.Event()
        self.ready = threading.Event()  # set once the GPUs are registered (tests, and a first message)
        self.thread = threading.Thread(target=self._run, name=self.name.lower().replace(" ", "-"), daemon=True)
        self._last_problem = None

    def start(self) -> XidWatch:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(WAIT_MS / 1000 * 4 + 5)

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                self._session()
            except NvmlError as e:
                self._trouble(e.message)
            except Exception as e:  # a defect: one line, and again; a dead thread would end XID health
                self._trouble(_why(e))

    def _trouble(self, problem: str) -> None:
        """Say it (once while it stays the same) and try again after a while."""
        if problem != self._last_problem:
            self.say(f"{self.name}: {problem}; trying again every {RETRY_SECONDS:g}s")
        self._last_problem = problem
        self.stopping.wait(RETRY_SECONDS)

    def _session(self) -> None:
        from oci_gpu_hook.start.nvml import bind

        try:
            nvml = bind(self.path)
        except (OSError, ImportError) as e:
            raise NvmlError(f"NVML ({self.path}) cannot be loaded: {e}") from None
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise NvmlError(f"NVML: {e}") from None
        try:
            events = self._registered(nvml)
            try:
                self._wait(nvml, events)
            finally:
                try:
                    nvml.nvmlEventSetFree(events)
                except nvml.NVMLError:
                    pass
        finally:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError:
                pass

    def _registered(self, nvml):
        xid = nvml.nvmlEventTypeXidCriticalError
        try:
            events = nvml.nvmlEventSetCreate()
            for uuid in self.uuids:
                try:
                    handle = nvml.nvmlDeviceGetHandleByUUID(uuid.encode())
                except nvml.NVMLError_NotFound:
                    continue  # gone (its health says so); the others are still watched
                try:
                    supported = nvml.nvmlDeviceGetSupportedEventTypes(handle)
                    nvml.nvmlDeviceRegisterEvents(handle, xid & supported, events)
                except nvml.NVMLError_NotSupported:
                    self.say(f"{self.name}: {uuid} reports no events (too old a GPU); "
                             f"{self.unwatched}")  # fmt: skip
        except nvml.NVMLError as e:
            raise NvmlError(f"NVML: registering for XID events: {e}") from None
        if not self.ready.is_set() or self._last_problem is not None:
            self.say(f"{self.name}: waiting on NVML events of {len(self.uuids)} GPU(s); {self.xids.describe()}")
        self._last_problem = None
        self.ready.set()
        return events

    def _wait(self, nvml, events) -> None:
        while not self.stopping.is_set():
            try:
                event = nvml.nvmlEventSetWait_v2(events, WAIT_MS)
            except nvml.NVMLError_Timeout:
                continue
            except nvml.NVMLError as e:
                raise NvmlError(f"NVML: waiting for events: {e}") from None
            if event.eventType != nvml.nvmlEventTypeXidCriticalError:
                continue
            try:
                uuid = nvml.nvmlDeviceGetUUID(event.device)
            except nvml.NVMLError as e:
                raise NvmlError(f"NVML: the GPU of XID {event.eventData}: {e}") from None
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            whole = event.gpuInstanceId == NO_INSTANCE or event.computeInstanceId == NO_INSTANCE
            found = XidEvent(uuid, None if whole else event.gpuInstanceId, None if whole else event.computeInstanceId,
                             int(event.eventData))  # fmt: skip
            if self.xids.is_critical(found.xid):
                try:
                    self.report(found)
                except Exception as e:
                    # What marking it raised (DriverChanged, from the health check it runs, which
                    # the plugin's own loop meets too and restarts on): said, and the next XID is
                    # still waited for. The mark itself is kept before the check (health.py).
                    self.say(f"XID {found.xid} on {describe(found)}: marking it Unhealthy: {_why(e)}")
            else:
                self.say(f"XID {found.xid} on {describe(found)}: not critical here (health.ignoredXids or "
                         f"{DISABLE_ENV}); its health is unchanged")  # fmt: skip


def _why(e: Exception) -> str:
    """An exception in one line: its own words, or its kind where it has none."""
    text = " ".join(str(e).split())
    return text if isinstance(e, (NvmlError, DriverChanged)) and text else f"{type(e).__name__}: {text}"


def describe(event: XidEvent) -> str:
    if event.gi is None:
        return event.gpu_uuid
    return f"{event.gpu_uuid} (GPU instance {event.gi}, compute instance {event.ci})"
