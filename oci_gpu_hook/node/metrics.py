"""What the exporter serves, as Prometheus text (exposition format 0.0.4). Pure: samples,
holders and counters in, text out.

The device metrics keep the names and labels of NVIDIA's DCGM exporter so that existing
dashboards work unchanged: DCGM_FI_DEV_* with gpu, UUID, device, modelName and Hostname, plus
GPU_I_ID and GPU_I_PROFILE on a MIG device's series (whose UUID, as in DCGM's, is its GPU's), and
container, pod and namespace while a container holds the device. Our own metrics are
oci_gpu_hook_*. The text is written here rather than through prometheus_client: its counters
would be renamed with a _total suffix that DCGM's energy counter does not have.
"""

from __future__ import annotations

from oci_gpu_hook.errors import printable

# sample field (nvml_reader.FIELDS) -> (DCGM name, type, help)
DEVICE_METRICS = {
    "util_gpu": ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    "util_memory": ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    "fb_used": ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    "fb_free": ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    "temperature": ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    "power": ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    "sm_clock": ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    "mem_clock": ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    "energy": ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter",
               "Total energy consumption since the driver was loaded (in mJ)."),
}  # fmt: skip
DURATION_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


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


def device_labels(device, hostname: str) -> dict:
    labels = {"gpu": str(device.gpu_index), "UUID": device.gpu_uuid, "device": f"nvidia{device.minor}",
              "modelName": device.model, "Hostname": hostname}  # fmt: skip
    if device.gi is not None:
        labels["GPU_I_PROFILE"] = device.profile or ""
        labels["GPU_I_ID"] = str(device.gi)
    return labels


def container_labels(record: dict) -> dict:
    """container, pod and namespace: Kubernetes' names when the runtime passed them; a container
    outside Kubernetes is named by its id."""
    names = record.get("kubernetes") or {}
    labels = {"container": names.get("container") or record["id"]}
    for key in ("pod", "namespace"):
        if names.get(key):
            labels[key] = names[key]
    return labels


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
        for reason, n in sorted(self.failures.items()):
            failures.add({"reason": reason}, n)
        duration = Family("oci_gpu_hook_start_duration_seconds", "histogram",
                          "How long the hook took for a GPU container, from its process's start.")  # fmt: skip
        for bound, n in zip(DURATION_BUCKETS, self.buckets):
            duration.add({"le": repr(bound)}, n, "_bucket")
        duration.add({"le": "+Inf"}, self.count, "_bucket")
        duration.add({}, self.count, "_count")
        duration.add({}, round(self.total, 6), "_sum")
        return [starts, served, failures, duration]


def render(samples, held: dict, memory: list, counters: StartCounters, stale: bool, live_count: int,
           hostname: str, extra=()) -> str:  # fmt: skip
    """The whole /metrics page. held: holders(); memory: memory_by_container()."""
    families = {field: Family(name, kind, help_text) for field, (name, kind, help_text) in DEVICE_METRICS.items()}
    for sample in samples:
        base = device_labels(sample.device, hostname)
        holders = held.get(sample.device.uuid) or [None]
        for record in holders:  # one series per container holding the device (time-slicing)
            labels = dict(base, **container_labels(record)) if record else base
            for field, value in sample.values.items():
                if field in families:
                    families[field].add(labels, value)
    per_container = Family(
        "oci_gpu_hook_container_gpu_memory_used_bytes", "gauge",
        "GPU memory used by a container's processes on a device, from NVML's process lists.",
    )  # fmt: skip
    for record, device, used in memory:
        labels = dict(device_labels(device, hostname), container_id=record["id"], **container_labels(record))
        per_container.add(labels, used)
    stale_family = Family(
        "oci_gpu_hook_gpu_facts_stale", "gauge",
        "1 when NVML failed at the last scrape: the device metrics are the last ones read.",
    )  # fmt: skip
    stale_family.add({}, 1 if stale else 0)
    live = Family("oci_gpu_hook_gpu_containers", "gauge", "Running containers the hook gave GPUs to.")
    live.add({}, live_count)
    out = [f for f in families.values() if f.samples]
    out += [per_container, stale_family, live, *counters.families(), *extra]
    return "".join(f.text() for f in out)
