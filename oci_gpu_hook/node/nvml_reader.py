"""The node services' one NVML reader: what each GPU and MIG device reports now (utilization,
memory, temperatures, power, clocks, energy, PCIe and NVLink counters, row remapping, and the
GPU Performance Monitoring ratios where the GPU has GPM) and which processes use it, through
NVIDIA's official bindings, bound to the driver library the inventory found.

A read either returns a sample of every device or raises NvmlError; the caller decides what a
failure means (the exporter: stale facts; the watchdog: no action). After a failure the next
read starts NVML afresh, so a driver that comes back is picked up without a restart. A value the
device does not give (NVML answers "not supported", or the driver predates the call) is left out
of the sample: the exporter then writes no series for it, never a made-up zero.
"""

from __future__ import annotations

from oci_gpu_hook.errors import Exit, NvmlError
from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.start.nvml import text

MIB = 1 << 20


class Device(Frozen):
    """A GPU, or a MIG device of one, as the metrics name it."""

    __slots__ = ("uuid", "gpu_index", "gpu_uuid", "minor", "model", "gi", "ci", "profile", "pci_bus_id")
    _defaults = {"gi": None, "ci": None, "profile": None, "pci_bus_id": ""}
    uuid: str  # the device's own: GPU-... or MIG-...
    gpu_index: int  # NVML index of the GPU (of the parent, for a MIG device)
    gpu_uuid: str
    minor: int  # /dev/nvidia<minor> of the GPU
    model: str
    gi: int | None  # MIG: GPU instance id
    ci: int | None
    profile: str | None  # MIG: 1g.5gb
    pci_bus_id: str  # the GPU's, as NVML writes it: 00000000:07:00.0


class Sample(Frozen):
    __slots__ = ("device", "values", "processes", "utilization")
    _defaults = {"utilization": None}
    device: Device
    values: dict  # name -> number, for what the device supports (nvml_reader.FIELDS)
    processes: tuple  # (pid, used bytes) of the processes using it
    # (pid, sm %, memory %, encoder %, decoder %): each process's newest utilization sample since
    # the last read; None where NVML keeps none (a MIG device, an older GPU, or not read)
    utilization: tuple | None


# What a sample may carry, and its unit.
FIELDS = {
    "util_gpu": "%",
    "util_memory": "%",
    "util_encoder": "%",
    "util_decoder": "%",
    "fb_used": "MiB",
    "fb_free": "MiB",
    "fb_reserved": "MiB",
    "temperature": "C",
    "memory_temperature": "C",
    "power": "W",
    "sm_clock": "MHz",
    "mem_clock": "MHz",
    "energy": "mJ",
    "pcie_replays": "retries",
    "nvlink_traffic": "KiB",
    "rows_remapped_correctable": "rows",
    "rows_remapped_uncorrectable": "rows",
    "row_remap_failure": "0 or 1",
    "vgpu_license": "0 or 1",
    "gr_engine_active": "ratio",
    "tensor_active": "ratio",
    "dram_active": "ratio",
    "pcie_tx": "B/s",
    "pcie_rx": "B/s",
}
# GPM metric id -> (sample field, factor): NVML gives percentages and MiB/s; DCGM's profiling
# fields are ratios and bytes per second.
GPM_METRICS = {
    1: ("gr_engine_active", 0.01),  # NVML_GPM_METRIC_GRAPHICS_UTIL
    5: ("tensor_active", 0.01),  # NVML_GPM_METRIC_ANY_TENSOR_UTIL: every tensor pipe, as DCGM's field
    10: ("dram_active", 0.01),  # NVML_GPM_METRIC_DRAM_BW_UTIL
    20: ("pcie_tx", MIB),  # NVML_GPM_METRIC_PCIE_TX_PER_SEC
    21: ("pcie_rx", MIB),  # NVML_GPM_METRIC_PCIE_RX_PER_SEC
}
# NVML field ids read in one nvmlDeviceGetFieldValues call per GPU -> sample field
FIELD_IDS = {
    82: "memory_temperature",  # NVML_FI_DEV_MEMORY_TEMP
    94: "pcie_replays",  # NVML_FI_DEV_PCIE_REPLAY_COUNTER
    140: "nvlink_raw_tx",  # NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX, KiB: data and protocol
    141: "nvlink_raw_rx",  # NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX
}
# The NVLink fields name a link in scopeId; UINT_MAX asks for all links summed (nvml.h).
ALL_LINKS = 0xFFFFFFFF
FIELD_REQUEST = [(field, ALL_LINKS) if name.startswith("nvlink") else field for field, name in FIELD_IDS.items()]
# A process utilization sample stamped later than this after now is the driver's garbage: taken as
# the newest seen, it would hide every real sample after it.
FUTURE_SAMPLE_US = 60_000_000


class NvmlReader:
    """detail: also what only the exporter shows (encoder and decoder, memory temperature, PCIe
    and NVLink counters, row remapping, GPM, per-process utilization), which the watchdog and the
    device plugin have no use for. tell(line): where the reader says, once per device, that a
    GPU has no GPM (the profiling series are then absent, and the log says why)."""

    def __init__(self, inventory, detail: bool = False, tell=None):
        self.inventory = inventory
        from oci_gpu_hook.start.nvml import library

        self.path = library(inventory.files, inventory.driver_root)
        self.detail, self.tell = detail, tell
        self._nvml = None
        self._started = False
        self.identity = None  # library_identity() of what this process loaded, once it has
        self._gpm_samples = {}  # device uuid -> the GPM sample of the last read: the next read's start
        self._without_gpm = set()  # GPU uuids said to have no GPM
        self._utilization_seen = {}  # GPU uuid -> NVML's timestamp of the newest process sample read
        self._failing = set()  # (device uuid, what) of the detail calls NVML fails (said once)

    def changed_library(self, other: NvmlReader) -> bool:
        """Whether other's NVML library is not the one this reader loaded into the process (which
        cannot load another: the process must start again)."""
        return self.identity is not None and library_identity(other.path) != self.identity

    def _start(self):
        if self.path is None:
            raise NvmlError("the inventory lists no libnvidia-ml.so.1: is the driver installed?")
        if self._nvml is None:
            try:
                from oci_gpu_hook.start.nvml import bind

                self._nvml = bind(self.path)
                self.identity = library_identity(self.path)
            except (OSError, ImportError) as e:
                raise NvmlError(f"NVML ({self.path}) cannot be loaded: {e}") from None
        if not self._started:
            self._call(self._nvml.nvmlInit)
            self._started = True
        return self._nvml

    def _call(self, fn, *args):
        """fn's answer; None where the device does not support it (or the driver's NVML predates
        the call); NvmlError for a failure."""
        nvml = self._nvml
        try:
            return fn(*args)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound):
            return None
        except nvml.NVMLError as e:
            raise NvmlError(f"NVML: {fn.__name__}: {e}") from None

    def module(self):
        """The bindings, bound and started (NvmlError if they cannot be): for the device plugin's
        topology reads, which ask what read() does not."""
        return self._start()

    def close(self) -> None:
        if self._started:
            for sample in self._gpm_samples.values():
                try:
                    self._nvml.nvmlGpmSampleFree(sample)
                except self._nvml.NVMLError:
                    pass
            self._gpm_samples.clear()
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._started = False

    def read(self) -> tuple[Sample, ...]:
        try:
            nvml = self._start()
            samples = tuple(self._read_all(nvml))
            self._forget_gone({sample.device.uuid for sample in samples})
            return samples
        except NvmlError:
            self.close()  # the next read starts NVML again
            raise

    def _read_all(self, nvml):
        by_uuid = {g.uuid: g for g in self.inventory.gpus}
        call = self._call
        for index in range(call(nvml.nvmlDeviceGetCount)):
            handle = call(nvml.nvmlDeviceGetHandleByIndex, index)
            uuid = text(call(nvml.nvmlDeviceGetUUID, handle))
            known = by_uuid.get(uuid)
            pci = call(nvml.nvmlDeviceGetPciInfo, handle) if self.detail else None
            gpu = Device(uuid, index, uuid, known.minor if known else index, text(call(nvml.nvmlDeviceGetName, handle)),
                         pci_bus_id=text(pci.busId) if pci is not None else "")  # fmt: skip
            values = self._values(nvml, handle, uuid, board=True)
            gpm = self.detail and self._has_gpm(nvml, handle, gpu)
            if gpm:
                values.update(self._gpm(nvml, uuid, nvml.nvmlGpmSampleGet, handle))
            utilization = self._utilization(nvml, handle, uuid) if self.detail else None
            yield Sample(gpu, values, self._processes(nvml, handle), utilization)
            mode = call(nvml.nvmlDeviceGetMigMode, handle)
            if not mode or not mode[0]:
                continue
            for mig_index in range(call(nvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0):
                try:
                    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
                except nvml.NVMLError_NotFound:
                    continue
                except nvml.NVMLError as e:
                    raise NvmlError(f"NVML: MIG device {index}:{mig_index}: {e}") from None
                name = text(call(nvml.nvmlDeviceGetName, mig))
                device = gpu.replace(
                    uuid=text(call(nvml.nvmlDeviceGetUUID, mig)),
                    gi=call(nvml.nvmlDeviceGetGpuInstanceId, mig),
                    ci=call(nvml.nvmlDeviceGetComputeInstanceId, mig),
                    profile=name.rsplit(" MIG ", 1)[1] if " MIG " in name else None,
                )
                values = self._values(nvml, mig, device.uuid, board=False)
                if gpm and device.gi is not None:
                    values.update(self._gpm(nvml, device.uuid, nvml.nvmlGpmMigSampleGet, handle, device.gi))
                yield Sample(device, values, self._processes(nvml, mig))

    def _optional(self, uuid: str, what: str, fn, *args):
        """fn's answer, for what the exporter shows beyond the node's basic facts: None where the
        device does not support it, and None too where NVML fails this one call (said once per
        device and call while it fails): one detail failing leaves that detail out of the page,
        and never makes every fact stale (a driver that fails this call on every read would)."""
        nvml = self._nvml
        try:
            answer = fn(*args)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound):
            return None
        except nvml.NVMLError as e:
            if (uuid, what) not in self._failing and self.tell:
                self.tell(f"{uuid}: NVML fails {what} ({e}): left out of the page while it does")
            self._failing.add((uuid, what))
            return None
        if (uuid, what) in self._failing:
            self._failing.discard((uuid, what))
            if self.tell:
                self.tell(f"{uuid}: NVML answers {what} again")
        return answer

    def _values(self, nvml, handle, uuid: str, board: bool) -> dict:
        call, values = self._call, {}
        memory = None
        if self.detail:
            memory = self._optional(uuid, "its memory (v2)", nvml.nvmlDeviceGetMemoryInfo, handle, nvml.nvmlMemory_v2)
        if memory is None:  # the first version has no reserved memory (and counts it as used)
            memory = call(nvml.nvmlDeviceGetMemoryInfo, handle)
        else:
            values["fb_reserved"] = memory.reserved // MIB
        if memory is not None:
            values["fb_used"] = memory.used // MIB
            values["fb_free"] = memory.free // MIB
        utilization = call(nvml.nvmlDeviceGetUtilizationRates, handle)
        if utilization is not None:
            values["util_gpu"], values["util_memory"] = utilization.gpu, utilization.memory
        if board:  # a MIG device has no sensors of its own
            for name, fn, args in (
                ("temperature", nvml.nvmlDeviceGetTemperature, (nvml.NVML_TEMPERATURE_GPU,)),
                ("power", nvml.nvmlDeviceGetPowerUsage, ()),
                ("sm_clock", nvml.nvmlDeviceGetClockInfo, (nvml.NVML_CLOCK_SM,)),
                ("mem_clock", nvml.nvmlDeviceGetClockInfo, (nvml.NVML_CLOCK_MEM,)),
                ("energy", nvml.nvmlDeviceGetTotalEnergyConsumption, ()),
            ):
                value = call(fn, handle, *args)
                if value is not None:
                    values[name] = value
            if "power" in values:
                values["power"] /= 1000  # NVML says milliwatts; DCGM, watts
            if self.detail:
                values.update(self._board_detail(nvml, handle, uuid))
        return values

    def _board_detail(self, nvml, handle, uuid: str) -> dict:
        """What only the exporter shows of a GPU's board: encoder and decoder use, NVML's field
        values (memory temperature, PCIe replays, NVLink traffic), a vGPU guest's licence, row
        remapping."""
        optional, values = self._optional, {}
        for name, what, fn in (("util_encoder", "encoder use", nvml.nvmlDeviceGetEncoderUtilization),
                               ("util_decoder", "decoder use", nvml.nvmlDeviceGetDecoderUtilization)):  # fmt: skip
            answer = optional(uuid, what, fn, handle)
            if answer is not None:
                values[name] = answer[0]  # (percent, sampling period in microseconds)
        fields = optional(uuid, "field values", nvml.nvmlDeviceGetFieldValues, handle, FIELD_REQUEST) or ()
        read = {FIELD_IDS[f.fieldId]: field_value(nvml, f) for f in fields
                if f.nvmlReturn == nvml.NVML_SUCCESS and f.fieldId in FIELD_IDS}  # fmt: skip
        for name in ("memory_temperature", "pcie_replays"):
            if read.get(name) is not None:
                values[name] = read[name]
        if read.get("nvlink_raw_tx") is not None and read.get("nvlink_raw_rx") is not None:
            values["nvlink_traffic"] = read["nvlink_raw_tx"] + read["nvlink_raw_rx"]
        mode = optional(uuid, "its virtualization mode", nvml.nvmlDeviceGetVirtualizationMode, handle)
        if mode == nvml.NVML_GPU_VIRTUALIZATION_MODE_VGPU:
            # a vGPU guest: licensed while its vGPU feature is (bare metal has no licence to report)
            features = optional(uuid, "its vGPU licence", nvml.nvmlDeviceGetGridLicensableFeatures, handle)
            if features is not None:
                found = features.gridLicensableFeatures[: min(features.licensableFeaturesCount,
                                                              len(features.gridLicensableFeatures))]  # fmt: skip
                values["vgpu_license"] = int(any(f.featureCode == nvml.NVML_GRID_LICENSE_FEATURE_CODE_VGPU
                                                 and f.featureState for f in found))  # fmt: skip
        rows = optional(uuid, "row remapping", nvml.nvmlDeviceGetRemappedRows, handle)
        if rows is not None:
            correctable, uncorrectable, _pending, failure = rows
            values["rows_remapped_correctable"] = correctable
            values["rows_remapped_uncorrectable"] = uncorrectable
            values["row_remap_failure"] = 1 if failure else 0
        return values

    def _has_gpm(self, nvml, handle, gpu: Device) -> bool:
        support = self._optional(gpu.uuid, "GPM support", nvml.nvmlGpmQueryDeviceSupport, handle)
        if support is not None and support.isSupportedDevice:
            self._without_gpm.discard(gpu.uuid)
            return True
        if support is not None and gpu.uuid not in self._without_gpm and self.tell:
            self.tell(f"GPU {gpu.gpu_index} ({gpu.uuid}, {gpu.model}) has no GPM (GPU Performance Monitoring, "
                      "Hopper and later): no DCGM_FI_PROF_* series for it")  # fmt: skip
        if support is not None:
            self._without_gpm.add(gpu.uuid)
        return False

    def _gpm(self, nvml, uuid: str, take, *device) -> dict:
        """The GPM ratios over the time since the last read's sample of this device (none on the
        first read: a rate needs two samples). take(*device, sample) fills a sample of it."""
        optional = self._optional
        sample = optional(uuid, "a GPM sample", nvml.nvmlGpmSampleAlloc)
        if sample is None:
            return {}
        if optional(uuid, "a GPM sample", take, *device, sample) is None:
            self._free_gpm(sample)
            return {}
        previous, self._gpm_samples[uuid] = self._gpm_samples.get(uuid), sample
        if previous is None:
            return {}
        try:
            request = nvml.c_nvmlGpmMetricsGet_t()
            request.version = nvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(GPM_METRICS)
            request.sample1, request.sample2 = previous, sample
            for i, metric in enumerate(GPM_METRICS):
                request.metrics[i].metricId = metric
            if optional(uuid, "GPM metrics", nvml.nvmlGpmMetricsGet, request) is None:
                return {}
        finally:
            self._free_gpm(previous)
        values = {}
        for i in range(len(GPM_METRICS)):
            metric = request.metrics[i]
            if metric.nvmlReturn == nvml.NVML_SUCCESS and metric.metricId in GPM_METRICS:
                name, factor = GPM_METRICS[metric.metricId]
                values[name] = round(metric.value * factor, 6)
        return values

    def _free_gpm(self, sample) -> None:
        try:
            self._nvml.nvmlGpmSampleFree(sample)
        except self._nvml.NVMLError:
            pass

    def _forget_gone(self, seen: set) -> None:
        """The GPM samples and utilization marks of devices this read did not find (a MIG device
        destroyed, a GPU gone): freed and forgotten, so that nothing grows with the devices a
        node has had."""
        for uuid in [u for u in self._gpm_samples if u not in seen]:
            self._free_gpm(self._gpm_samples.pop(uuid))
        for uuid in [u for u in self._utilization_seen if u not in seen]:
            del self._utilization_seen[uuid]

    def _utilization(self, nvml, handle, uuid: str) -> tuple | None:
        """Each process's newest utilization sample since the last read: () when there is none
        (no process has run on it since), None where NVML keeps none for this GPU (or fails)."""
        import time

        def samples():
            try:
                return nvml.nvmlDeviceGetProcessUtilization(handle, self._utilization_seen.get(uuid, 0))
            except nvml.NVMLError_NotFound:
                return ()  # no sample since the last read: nothing ran

        # None: not supported, older than the call, or failing (a driver whose size query and
        # answer disagree): no per-process figures for this GPU this time
        found = self._optional(uuid, "per-process utilization", samples)
        if found is None:
            return None
        latest = time.time_ns() // 1000 + FUTURE_SAMPLE_US
        newest = {}
        for s in found:
            if s.timeStamp <= latest and (s.pid not in newest or s.timeStamp >= newest[s.pid].timeStamp):
                newest[s.pid] = s
        if newest:
            self._utilization_seen[uuid] = max(s.timeStamp for s in newest.values())
        return tuple((s.pid, s.smUtil, s.memUtil, s.encUtil, s.decUtil) for s in newest.values())

    def _processes(self, nvml, handle) -> tuple:
        found = self._call(nvml.nvmlDeviceGetComputeRunningProcesses, handle) or ()
        graphics = self._call(nvml.nvmlDeviceGetGraphicsRunningProcesses, handle) or ()
        # A process in both lists (compute and graphics) is one process: counted once, at its most.
        used = {}
        for p in (*found, *graphics):
            used[p.pid] = max(used.get(p.pid, 0), p.usedGpuMemory or 0)
        return tuple(used.items())


def field_value(nvml, field):
    """The number in an nvmlFieldValue_t, by its type; None for a type not known."""
    member = {nvml.NVML_VALUE_TYPE_DOUBLE: "dVal", nvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
              nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal", nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
              nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal", nvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
              getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_SHORT", 6): "usVal"}.get(field.valueType)  # fmt: skip
    return getattr(field.value, member) if member else None


# The exit status of a node service that stops because the driver changed: not 0, so that systemd
# (Restart=on-failure) and Kubernetes start it again, with the new driver's NVML.
RESTART = Exit.RESTART


class DriverChanged(Exception):
    """The driver's NVML library changed under a running service: the library this process loaded
    cannot be unloaded, so the service must start again (systemd and the DaemonSet restart it)."""


class HostReader:
    """An NvmlReader for the configured host, made on the first read that finds an inventory: a
    node service started before the driver (or with a broken one) keeps running and reads NVML
    once the driver is there. Each read checks the host's fingerprint (the inventory cache's): when
    the GPUs or device nodes changed, the inventory is read again and NVML started afresh; when
    the NVML library itself changed (another driver, or the same one reinstalled), DriverChanged."""

    def __init__(self, settings, detail: bool = False, tell=None):
        self.settings, self.detail, self.tell = settings, detail, tell
        # Called before NVML is started afresh for a changed host: whoever else holds NVML open in
        # this process (the exporter's XID thread) lets go first, as NVML lists the GPUs again
        # only when no one holds it.
        self.before_restart = None
        self.reader = None
        self.fingerprint = None

    @property
    def inventory(self):
        """The inventory of the last read (None before one found it)."""
        return self.reader.inventory if self.reader is not None else None

    @property
    def path(self):
        """The NVML library that inventory names."""
        return self.reader.path if self.reader is not None else None

    def read(self) -> tuple[Sample, ...]:
        from oci_gpu_hook.errors import InventoryError
        from oci_gpu_hook.start import inventory_cache

        current = inventory_cache.fingerprint(self.settings)
        if self.reader is None or current != self.fingerprint:
            try:
                inventory = inventory_cache.load(self.settings)
            except InventoryError as e:
                raise NvmlError(f"no GPU inventory: {e.message}") from None
            reader = NvmlReader(inventory, self.detail, self.tell)
            if self.reader is not None:
                check_library(self.reader, reader)
                if self.before_restart is not None:
                    self.before_restart()
                self.reader.close()
            self.reader, self.fingerprint = reader, current
        return self.reader.read()


def check_library(loaded: NvmlReader, new: NvmlReader) -> None:
    """DriverChanged when new's NVML library is not the one loaded: for every node service."""
    if loaded.changed_library(new):
        change = library_change(loaded.inventory.driver_version, loaded.identity, new.inventory.driver_version,
                                library_identity(new.path))  # fmt: skip
        raise DriverChanged(f"{change}: starting again to load its NVML")


def library_change(old_version, old, new_version, new) -> str:
    """What changed, in words, between the NVML library a process loaded and the host's now, told
    by what changed_library compares (the library's path and the file there: library_identity)
    and by the driver's version: the same version at the same path is a reinstall, which says so
    rather than '550.54.15 -> 550.54.15'."""
    old_path, new_path = old[0], new[0]
    if new_path is None:
        return f"the NVIDIA driver's NVML library is gone ({old_version}, {old_path} is no longer in the inventory)"
    if new[1] is None:
        return f"the NVIDIA driver's NVML library is gone ({old_version}, {new_path} cannot be read)"
    if old_version != new_version:
        return f"the NVIDIA driver changed ({old_version} -> {new_version}, {new_path})"
    if old_path != new_path:
        return f"the NVIDIA driver's NVML library moved ({old_version}, {old_path} -> {new_path})"
    return f"the NVIDIA driver was reinstalled ({old_version} again, {new_path} is another file)"


def library_identity(path):
    """(path, device, inode) of an NVML library file: a reinstall at the same path is another."""
    import os

    try:
        st = os.stat(path)
    except (OSError, TypeError):
        return (path, None, None)
    return (path, st.st_dev, st.st_ino)
