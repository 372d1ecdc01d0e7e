"""The node services' one NVML reader: what each GPU and MIG device reports now (utilization,
memory, temperature, power, clocks, energy) and which processes use it, through NVIDIA's
official bindings, bound to the driver library the inventory found.

A read either returns a sample of every device or raises NvmlError; the caller decides what a
failure means (the exporter: stale facts; the watchdog: no action). After a failure the next
read starts NVML afresh, so a driver that comes back is picked up without a restart.
"""

from __future__ import annotations

from oci_gpu_hook.errors import Exit, NvmlError
from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.start.nvml import text

MIB = 1 << 20


class Device(Frozen):
    """A GPU, or a MIG device of one, as the metrics name it."""

    __slots__ = ("uuid", "gpu_index", "gpu_uuid", "minor", "model", "gi", "ci", "profile")
    _defaults = {"gi": None, "ci": None, "profile": None}
    uuid: str  # the device's own: GPU-... or MIG-...
    gpu_index: int  # NVML index of the GPU (of the parent, for a MIG device)
    gpu_uuid: str
    minor: int  # /dev/nvidia<minor> of the GPU
    model: str
    gi: int | None  # MIG: GPU instance id
    ci: int | None
    profile: str | None  # MIG: 1g.5gb


class Sample(Frozen):
    __slots__ = ("device", "values", "processes")
    device: Device
    values: dict  # name -> number, for what the device supports (nvml_reader.FIELDS)
    processes: tuple  # (pid, used bytes) of the processes using it


# What a sample may carry, and its unit.
FIELDS = {
    "util_gpu": "%",
    "util_memory": "%",
    "fb_used": "MiB",
    "fb_free": "MiB",
    "temperature": "C",
    "power": "W",
    "sm_clock": "MHz",
    "mem_clock": "MHz",
    "energy": "mJ",
}


class NvmlReader:
    def __init__(self, inventory):
        self.inventory = inventory
        from oci_gpu_hook.start.nvml import library

        self.path = library(inventory.files, inventory.driver_root)
        self._nvml = None
        self._started = False
        self.identity = None  # library_identity() of what this process loaded, once it has

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
        """fn's answer; None where the device does not support it; NvmlError for a failure."""
        nvml = self._nvml
        try:
            return fn(*args)
        except nvml.NVMLError_NotSupported:
            return None
        except nvml.NVMLError as e:
            raise NvmlError(f"NVML: {fn.__name__}: {e}") from None

    def module(self):
        """The bindings, bound and started (NvmlError if they cannot be): for the device plugin's
        topology reads, which ask what read() does not."""
        return self._start()

    def close(self) -> None:
        if self._started:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._started = False

    def read(self) -> tuple[Sample, ...]:
        try:
            nvml = self._start()
            return tuple(self._read_all(nvml))
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
            gpu = Device(uuid, index, uuid, known.minor if known else index, text(call(nvml.nvmlDeviceGetName, handle)))
            yield Sample(gpu, self._values(nvml, handle, board=True), self._processes(nvml, handle))
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
                yield Sample(device, self._values(nvml, mig, board=False), self._processes(nvml, mig))

    def _values(self, nvml, handle, board: bool) -> dict:
        call, values = self._call, {}
        memory = call(nvml.nvmlDeviceGetMemoryInfo, handle)
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
        return values

    def _processes(self, nvml, handle) -> tuple:
        found = self._call(nvml.nvmlDeviceGetComputeRunningProcesses, handle) or ()
        graphics = self._call(nvml.nvmlDeviceGetGraphicsRunningProcesses, handle) or ()
        # A process in both lists (compute and graphics) is one process: counted once, at its most.
        used = {}
        for p in (*found, *graphics):
            used[p.pid] = max(used.get(p.pid, 0), p.usedGpuMemory or 0)
        return tuple(used.items())


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

    def __init__(self, settings):
        self.settings = settings
        self.reader = None
        self.fingerprint = None

    def read(self) -> tuple[Sample, ...]:
        from oci_gpu_hook.errors import InventoryError
        from oci_gpu_hook.start import inventory_cache

        current = inventory_cache.fingerprint(self.settings)
        if self.reader is None or current != self.fingerprint:
            try:
                inventory = inventory_cache.load(self.settings)
            except InventoryError as e:
                raise NvmlError(f"no GPU inventory: {e.message}") from None
            reader = NvmlReader(inventory)
            if self.reader is not None:
                check_library(self.reader, reader)
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
