"""What the exporter serves, as Prometheus text (exposition format 0.0.4). Pure: samples,
records and counts in, text out.

The device metrics keep the names, types and labels of NVIDIA's DCGM exporter so that existing
dashboards and rules work unchanged: DCGM_FI_DEV_* and DCGM_FI_PROF_* with gpu, UUID, pci_bus_id,
device, modelName, Hostname and DCGM_FI_DRIVER_VERSION, plus GPU_I_ID and GPU_I_PROFILE on a MIG
device's series (whose UUID, as in DCGM's, is its GPU's), and container, pod and namespace. Each
device's series appear once, whoever holds it; per-container use is in our own families
(oci_gpu_hook_container_*), so that a sum over a dashboard's series is the node's true total. The
text is written here rather than through prometheus_client: its counters would be renamed with a
_total suffix that DCGM's counters do not have.
"""

from __future__ import annotations

from oci_gpu_hook.errors import Exit, exit_reason, printable
from oci_gpu_hook.frozen import Frozen

# sample field (nvml_reader.FIELDS) -> (DCGM name, type, help): every metric field of DCGM
# exporter's default list (its default-counters.csv), with its type and help text. NVML gives
# each where the device has it: DCGM_FI_DEV_VGPU_LICENSE_STATUS only in a vGPU guest, the PROF
# fields only with GPM. DCGM_FI_DEV_XID_ERRORS is rendered apart (XidCounts), from NVML's events.
DEVICE_METRICS = {
    "sm_clock": ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    "mem_clock": ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    "memory_temperature": ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    "temperature": ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    "power": ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    "energy": ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter",
               "Total energy consumption since the driver was loaded (in mJ)."),
    "pcie_replays": ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
    "util_gpu": ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    "util_memory": ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    "util_encoder": ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %)."),
    "util_decoder": ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %)."),
    "fb_free": ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    "fb_used": ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    "fb_reserved": ("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB)."),
    "nvlink_traffic": ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter",
                       "Total NVLink traffic of all links, both directions, data and protocol (in KiB)."),
    "rows_remapped_uncorrectable": ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
                                    "Number of remapped rows for uncorrectable errors."),
    "rows_remapped_correctable": ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter",
                                  "Number of remapped rows for correctable errors."),
    "vgpu_license": ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge", "vGPU License status"),
    "row_remap_failure": ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed."),
    "gr_engine_active": ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active."),
    "tensor_active": ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor pipes are active."),
    "dram_active": ("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
                    "Ratio of cycles the device memory interface is active sending or receiving data."),
    "pcie_tx": ("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge",
                "The rate of data transmitted over the PCIe bus, protocol headers included (in bytes per second)."),
    "pcie_rx": ("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge",
                "The rate of data received over the PCIe bus, protocol headers included (in bytes per second)."),
}  # fmt: skip
DURATION_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# XIDs whose counter exists from the start on every GPU (so that increase() sees the first one,
# and an alert on it can fire), with what each means, in short, for DCGM_FI_DEV_XID_ERRORS's
# err_msg. Others are counted, and named "XID <n>", once seen.
XID_MEANINGS = {
    13: "Graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "Preemptive cleanup, due to previous errors",
    48: "Double-bit ECC error",
    61: "Internal micro-controller breakpoint or warning",
    62: "Internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapping recording failure",
    68: "Video decoder exception",
    69: "Graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate",
    94: "Contained ECC error",
    95: "Uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
WATCHDOG_ACTIONS = ("kill", "warn", "would-kill")
# Why a start can fail (the exit statuses the hook's start path raises, errors.exit_reason): each
# counted from 0, so that the first failure is an increase an alert sees.
FAILURE_REASONS = tuple(exit_reason(code) for code in (
    Exit.GENERAL, Exit.CONFIG, Exit.INVENTORY, Exit.REQUEST, Exit.PREREQUISITE, Exit.STATE, Exit.CGROUP,
    Exit.LDCONFIG, Exit.APPLY, Exit.LABEL, Exit.INTERNAL))  # fmt: skip
HOLDER_LABELS = ("container", "pod", "namespace")


def escape(value) -> str:
    """A label value: printable first (a container's annotation may hold controls or a lone
    surrogate, which cannot be encoded and would take the page down), then the format's escapes."""
    return printable(str(value)).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value) -> str:
    if isinstance(value, float):
        return repr(value) if value == value and value not in (float("inf"), float("-inf")) else "NaN"
    return str(value)


class Family:
    def __init__(self, name: str, kind: str, help_text: str):
        self.name, self.kind, self.help = name, kind, help_text
        self.samples = []

    def add(self, labels: dict, value, suffix: str = "") -> None:
        self.samples.append((self.name + suffix, labels, value))

    def text(self) -> str:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for name, labels, value in self.samples:
            inner = ",".join(f'{k}="{escape(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{inner}}} {_number(value)}" if inner else f"{name} {_number(value)}")
        return "\n".join(lines) + "\n"


def device_labels(device, hostname: str, driver_version: str = "") -> dict:
    """DCGM exporter's labels of a device's series, in its order. device is nvidia<GPU index>, as
    DCGM names it (not the device node's minor, which may differ)."""
    labels = {"gpu": str(device.gpu_index), "UUID": device.gpu_uuid, "pci_bus_id": device.pci_bus_id,
              "device": f"nvidia{device.gpu_index}", "modelName": device.model, "Hostname": hostname,
              "DCGM_FI_DRIVER_VERSION": driver_version}  # fmt: skip
    if device.gi is not None:
        labels["GPU_I_PROFILE"] = device.profile or ""
        labels["GPU_I_ID"] = str(device.gi)
    return labels


def container_labels(record: dict | None) -> dict:
    """container, pod and namespace, always all three: Kubernetes' names when the runtime passed
    them (a container outside Kubernetes is named by its id), empty for no container. Always
    present because a Prometheus that honours the page's labels (the ServiceMonitor's honorLabels)
    then keeps an empty one rather than putting the exporter pod's own names on the series."""
    if record is None:
        return dict.fromkeys(HOLDER_LABELS, "")
    names = record.get("kubernetes") or {}
    return {"container": names.get("container") or record["id"], "pod": names.get("pod") or "",
            "namespace": names.get("namespace") or ""}  # fmt: skip


class XidCounts:
    """The XIDs NVML's events reported per GPU since this process started: the last one (DCGM's
    DCGM_FI_DEV_XID_ERRORS) and a count of each. Written by the event thread, read by a render."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()
        self.last = {}  # GPU uuid -> xid
        self.counts = {}  # (GPU uuid, xid) -> n

    def record(self, gpu_uuid: str, xid: int) -> None:
        with self.lock:
            self.last[gpu_uuid] = xid
            self.counts[(gpu_uuid, xid)] = self.counts.get((gpu_uuid, xid), 0) + 1

    def families(self, gpus: list) -> list:
        """gpus: [(uuid, labels, board labels)] of the GPUs on the page (whole GPUs: XIDs are the
        board's). DCGM's gauge carries its holder, as DCGM's series do; the counters carry none
        (empty holder labels), so that a count is one series whoever holds the GPU, and an XID
        that comes as its pod goes is still an increase of that one series."""
        last = Family("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.")
        total = Family("oci_gpu_hook_gpu_xid_errors_total", "counter",
                       "XID errors NVML reported for the GPU since the exporter started, by XID.")  # fmt: skip
        with self.lock:
            last_seen, counts = dict(self.last), dict(self.counts)
        for uuid, labels, board in gpus:
            xid = last_seen.get(uuid, 0)
            last.add(dict(labels, err_code=str(xid), err_msg=xid_meaning(xid) if xid else "No error"), xid)
            seen = {x for u, x in counts if u == uuid}
            for x in sorted(set(XID_MEANINGS) | seen):
                total.add(dict(board, xid=str(x)), counts.get((uuid, x), 0))
        return [last, total]


def xid_meaning(xid: int) -> str:
    return XID_MEANINGS.get(xid, f"XID {xid}")


class StartCounters:
    """The hook's starts, failures by reason and start durations, counted from the container
    records as they appear (each record once: by its file name and time). Counted since this
    process started, as Prometheus counters are."""

    def __init__(self):
        self.seen = set()
        self.starts = 0
        self.served = 0
        self.failures = {}
        self.buckets = [0] * len(DURATION_BUCKETS)
        self.count = 0
        self.total = 0.0

    def observe(self, records: dict) -> None:
        current = set()
        for name, record in records.items():
            if record is None:
                continue
            key = (name, record["time"])
            current.add(key)
            if key in self.seen:
                continue
            self.starts += 1
            if record.get("via") == "start server":
                self.served += 1
            if record["outcome"] != "started":
                reason = record.get("reason") or "unknown"
                self.failures[reason] = self.failures.get(reason, 0) + 1
            duration = float(record["duration_seconds"])
            self.count += 1
            self.total += duration
            for i, bound in enumerate(DURATION_BUCKETS):
                if duration <= bound:
                    self.buckets[i] += 1
        # Records never come back once collected; what is not there now need not be remembered.
        self.seen = current

    def families(self) -> list:
        starts = Family("oci_gpu_hook_gpu_container_starts_total", "counter",
                        "GPU container starts the hook handled (failed ones included).")  # fmt: skip
        starts.add({}, self.starts)
        served = Family("oci_gpu_hook_gpu_container_served_starts_total", "counter",
                        "GPU container starts a start server's worker ran (the others ran in the hook's own "
                        "process).")  # fmt: skip
        served.add({}, self.served)
        failures = Family("oci_gpu_hook_gpu_container_failures_total", "counter",
                          "GPU container starts the hook failed, by reason (its exit status's name).")  # fmt: skip
        for reason in sorted(set(FAILURE_REASONS) | set(self.failures)):
            failures.add({"reason": reason}, self.failures.get(reason, 0))
        duration = Family("oci_gpu_hook_start_duration_seconds", "histogram",
                          "How long the hook took for a GPU container, from its process's start.")  # fmt: skip
        for bound, n in zip(DURATION_BUCKETS, self.buckets):
            duration.add({"le": repr(bound)}, n, "_bucket")
        duration.add({"le": "+Inf"}, self.count, "_bucket")
        duration.add({}, self.count, "_count")
        duration.add({}, round(self.total, 6), "_sum")
        return [starts, served, failures, duration]


class Page(Frozen):
    """What one render shows besides the samples: the node's facts and counts at that moment."""

    __slots__ = ("hostname", "driver_version", "live", "memory", "utilization", "stale", "age", "counters",
                 "xids", "watchdog", "sharing", "health", "extra")  # fmt: skip
    _defaults = {"driver_version": "", "memory": (), "utilization": (), "stale": False, "age": None,
                 "xids": None, "watchdog": None, "sharing": None, "health": None, "extra": ()}  # fmt: skip
    hostname: str
    driver_version: str
    live: list  # records of the running containers the hook configured (attribution.started)
    memory: list  # attribution.memory_by_container()
    utilization: list  # attribution.utilization_by_container()
    stale: bool  # NVML failed at this render: the samples are the last ones read
    age: float | None  # seconds since the samples were read; None: never
    counters: StartCounters
    xids: XidCounts | None  # None: no XID events are watched
    watchdog: dict | None  # {action: count} of the running watchdog (watchdog.read_counters)
    sharing: dict | None  # {device uuid: (mechanism, replicas, resource)}: exporter.sharing()
    health: dict | None  # {device uuid: None or why not healthy} of the running device plugin
    extra: tuple  # more families, rendered last


def render(samples, page: Page) -> str:
    """The whole /metrics page. A device's own series appear once, however many containers hold
    it; who holds it, and what each holder uses, are the oci_gpu_hook_container_* families."""
    from oci_gpu_hook.node.attribution import holders

    held = holders(page.live)
    families = {field: Family(name, kind, help_text) for field, (name, kind, help_text) in DEVICE_METRICS.items()}
    labels_of, gpus = {}, []
    for sample in samples:
        device = sample.device
        base = labels_of[device] = device_labels(device, page.hostname, page.driver_version)
        holding = held.get(device.uuid) or ()
        # One holder is named on the device's series; several (time-slicing, MPS) are each named in
        # the per-container families, and the device's series carry empty names.
        labels = dict(base, **container_labels(holding[0] if len(holding) == 1 else None))
        if device.gi is None:
            gpus.append((device.uuid, labels, dict(base, **container_labels(None))))
        for field, value in sample.values.items():
            if field in families:
                families[field].add(labels, value)
    out = [f for f in families.values() if f.samples]

    def board_of(device) -> dict:
        """The device labels of our per-device families: the holder labels empty (never the
        exporter pod's, under honoured labels), so that each stays one series whoever holds it."""
        return dict(labels_of[device], **container_labels(None))

    if page.sharing:
        shared = Family("oci_gpu_hook_gpu_sharing", "gauge",
                        "1 for each device the device plugin offers, with how: mechanism (whole, time-sliced, mps, "
                        "mig), replicas and the Kubernetes resource.")  # fmt: skip
        for sample in samples:
            if sample.device.uuid in page.sharing:
                mechanism, replicas, resource = page.sharing[sample.device.uuid]
                shared.add(dict(board_of(sample.device), mechanism=mechanism, replicas=str(replicas),
                                resource=resource), 1)  # fmt: skip
        out.append(shared)
    if page.health:
        healthy = Family("oci_gpu_hook_gpu_health", "gauge",
                         "1 while the device plugin reports the device Healthy to the kubelet, 0 while Unhealthy "
                         "(reason: why).")  # fmt: skip
        for sample in samples:
            if sample.device.uuid in page.health:
                why = page.health[sample.device.uuid]
                healthy.add(dict(board_of(sample.device), reason=why or ""), 0 if why else 1)
        out.append(healthy)
    if page.xids is not None:
        out += page.xids.families(gpus)
    out += _container_families(samples, held, labels_of, page)
    stale_family = Family(
        "oci_gpu_hook_gpu_facts_stale", "gauge",
        "1 when NVML failed at the last scrape: the device metrics are the last ones read.",
    )  # fmt: skip
    stale_family.add({}, 1 if page.stale else 0)
    out.append(stale_family)
    if page.age is not None:
        age = Family("oci_gpu_hook_gpu_facts_age_seconds", "gauge",
                     "Seconds since the device metrics were read from NVML.")  # fmt: skip
        age.add({}, round(page.age, 3))
        out.append(age)
    live = Family("oci_gpu_hook_gpu_containers", "gauge", "Running containers the hook gave GPUs to.")
    live.add({}, len(page.live))
    out += [live, *page.counters.families()]
    if page.watchdog is not None:
        actions = Family(
            "oci_gpu_hook_watchdog_actions_total", "counter",
            "What the GPU memory watchdog did (kill, warn, would-kill), since it started.",
        )  # fmt: skip
        for action in sorted(set(WATCHDOG_ACTIONS) | set(page.watchdog)):
            actions.add({"action": action}, page.watchdog.get(action, 0))
        out.append(actions)
    out += page.extra
    return "".join(f.text() for f in out)


def _container_families(samples, held: dict, labels_of: dict, page: Page) -> list:
    """Who holds each device (allocated), its memory limit there, and what its processes use."""

    def labels(record, device) -> dict:
        return dict(labels_of[device], container_id=record["id"], **container_labels(record))

    allocated = Family("oci_gpu_hook_container_gpu_allocated", "gauge",
                       "1 for each device the hook gave a running container.")  # fmt: skip
    limit = Family("oci_gpu_hook_container_gpu_memory_limit_bytes", "gauge",
                   "A container's GPU memory limit on a device, as the hook resolved it at its start.")  # fmt: skip
    for sample in samples:
        device = sample.device
        for record in held.get(device.uuid, ()):
            allocated.add(labels(record, device), 1)
            limits = record.get("gpu_memory_limit") or {}
            if limits.get(device.uuid) is not None:
                limit.add(labels(record, device), limits[device.uuid])
    used = Family(
        "oci_gpu_hook_container_gpu_memory_used_bytes", "gauge",
        "GPU memory used by a container's processes on a device, from NVML's process lists.",
    )  # fmt: skip
    for record, device, size in page.memory:
        if device in labels_of:
            used.add(labels(record, device), size)
    utilization = Family(
        "oci_gpu_hook_container_gpu_utilization_percent", "gauge",
        "A container's processes' share of a GPU's engines (sm, memory, encoder, decoder), from NVML's "
        "per-process utilization (whole GPUs only).",
    )  # fmt: skip
    for record, device, percent in page.utilization:
        if device in labels_of:
            for engine, value in zip(("sm", "memory", "encoder", "decoder"), percent):
                utilization.add(dict(labels(record, device), engine=engine), value)
    return [allocated, used, limit, utilization]
