"""The plan: exactly what a container gets, as an ordered list of operations.

Pure: from (request, inventory, rootfs layout) to operations that apply.py carries out and that
`oci-gpu-hook plan` prints (the dry run). It decides what a container gets; request.py decides
what the container asked for and may ask for. Some decisions stay with apply.py because only the
live container can answer them: an optional source that is absent or not root's on the host
(skipped), a /proc/driver/nvidia that the container's procfs does not show (nothing to mask),
a device node the runtime already made with the planned numbers (kept), rules a cgroup already
grants (not written). Sources are host paths (under the configured roots); targets are paths
inside the container.
"""

from __future__ import annotations

import os

from oci_gpu_hook.errors import InventoryError, RequestError, RequirementError
from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.start import driver
from oci_gpu_hook.start.inventory import (
    DeviceNode,
    DriverFile,
    GpuInfo,
    Inventory,
    MigDevice,
    host_path,
    normalize_bus_id,
)
from oci_gpu_hook.start.linux import arch
from oci_gpu_hook.start.request import GpuRequest, device_index
from oci_gpu_hook.start.requirements import GpuFacts

# Mount flags per kind of source (NVIDIA's choices, which images expect).
FILE_FLAGS = ("ro", "nosuid", "nodev")
DEVICE_FLAGS = ("ro", "nosuid", "noexec")
IPC_FLAGS = ("nosuid", "nodev", "noexec")  # the MPS pipe directory: clients create their pipes there
SOCKET_FLAGS = ("ro", "nosuid", "nodev", "noexec")  # connect() needs no write access to the mount
PROC_FLAGS = ("ro", "nosuid", "nodev", "noexec")
TMPFS_FLAGS = ("nosuid", "nodev", "noexec")
PROC_NVIDIA = "/proc/driver/nvidia"
# graphics: NVIDIA's driver reads application profiles here; the hook's one limits EGL (and so
# Vulkan) to the container's GPUs, as libnvidia-container's does.
APP_PROFILE_DIR = "/etc/nvidia/nvidia-application-profiles-rc.d"
APP_PROFILE = f"{APP_PROFILE_DIR}/10-container.conf"


class LibraryLayout(Frozen):
    """Where the container's loader looks for libraries (decided from the rootfs by the caller)."""

    __slots__ = ("lib64", "lib32")
    lib64: str
    lib32: str | None  # None: no 32-bit libraries are placed (aarch64)

    # Where 32-bit libraries go in an image without multiarch directories: the rule is
    # libnvidia-container's, as distributions disagree.
    LIB32 = "/usr/lib32"
    LIB32_ALT = "/usr/lib"

    @classmethod
    def probe_paths(cls, machine: str | None = None) -> tuple[str, ...]:
        """The image directories for_image needs to know about."""
        entry = arch.current(machine)
        return (entry.multiarch, entry.lib64, cls.LIB32, cls.LIB32_ALT)

    @classmethod
    def for_image(cls, dirs: dict, machine: str | None = None) -> LibraryLayout:
        """From the image's directories (rootfs.directories of probe_paths): its multiarch
        directories when it has the 64-bit one; else /usr/lib64, with 32-bit libraries in
        /usr/lib32 when the image has it, in /usr/lib when that is a directory of its own (not
        /usr/lib64 under another name), else in /usr/lib32."""
        entry = arch.current(machine)
        if dirs.get(entry.multiarch):
            return cls(entry.multiarch, entry.multiarch32)
        if entry.lib32 is None:
            return cls(entry.lib64, None)
        lib32 = cls.LIB32
        usr_lib = dirs.get(cls.LIB32_ALT)
        if not dirs.get(cls.LIB32) and usr_lib and usr_lib != dirs.get(entry.lib64):
            lib32 = cls.LIB32_ALT
        return cls(entry.lib64, lib32)

    @classmethod
    def for_rootfs(cls, debian: bool, machine: str | None = None) -> LibraryLayout:
        """The multiarch directories of a Debian-like image, else /usr/lib64 (and /usr/lib), for
        machine (os.uname().machine's name; default: this machine's). Any machine arch.py does
        not know raises arch.UnsupportedArchitecture: every GPU start asks before changing anything."""
        entry = arch.current(machine)
        if debian:
            return cls(entry.multiarch, entry.multiarch32)
        return cls(entry.lib64, entry.lib32)


# --- operations ---------------------------------------------------------------------------------


class Operation(Frozen):
    """Base of every planned step: printable, serialisable, frozen."""

    __slots__ = ()

    def describe(self) -> str:
        raise NotImplementedError

    def to_json(self) -> dict:
        return dict(op=type(self).__name__, **Frozen.to_json(self))


class MountDevice(Operation):
    """Bind-mount a device node after checking it is char major:minor."""

    __slots__ = ("source", "target", "major", "minor", "flags")
    _defaults = {"flags": DEVICE_FLAGS}
    source: str
    target: str
    major: int
    minor: int
    flags: tuple[str, ...]

    def describe(self) -> str:
        return f"device  {self.target} (char {self.major}:{self.minor}) from {self.source} [{','.join(self.flags)}]"


class BindMount(Operation):
    """Bind-mount a host file or directory, then remount with flags."""

    __slots__ = ("source", "target", "kind", "flags", "optional")
    _defaults = {"optional": False}
    source: str
    target: str
    kind: str  # file, dir or socket
    flags: tuple[str, ...]
    optional: bool  # skipped when the source is absent (IPC endpoints)

    def describe(self) -> str:
        note = " (if present)" if self.optional else ""
        return f"bind    {self.target} from {self.source} [{','.join(self.flags)}]{note}"


class Symlink(Operation):
    __slots__ = ("target", "value")
    target: str  # the link's path in the container
    value: str  # what it points to

    def describe(self) -> str:
        return f"symlink {self.target} -> {self.value}"


class MountTmpfs(Operation):
    """optional: only over a target that exists; where it does not, the tmpfs and every later
    operation inside it are skipped (the container's /proc shows the driver's files only where a
    driver is loaded, so the mask over them has nothing to hide elsewhere)."""

    __slots__ = ("target", "mode", "flags", "optional")
    _defaults = {"flags": TMPFS_FLAGS, "optional": False}
    target: str
    mode: int
    flags: tuple[str, ...]
    optional: bool

    def describe(self) -> str:
        note = " if present" if self.optional else ""
        return f"tmpfs   {self.target} (mode {self.mode:04o}) [{','.join(self.flags)}]{note}"


class CopyFile(Operation):
    """Write a sanitised copy of a host file (into a tmpfs the hook mounted)."""

    __slots__ = ("source", "target", "rewrite")
    _defaults = {"rewrite": ()}
    source: str
    target: str
    rewrite: tuple[tuple[str, str], ...]  # (line prefix, replacement line)

    def describe(self) -> str:
        note = "".join(f"; {old!r} -> {new!r}" for old, new in self.rewrite)
        return f"copy    {self.target} from {self.source}{note}"


class WriteFile(Operation):
    """Write a file whose content the plan decided (into a tmpfs the hook mounted)."""

    __slots__ = ("target", "content", "mode")
    target: str
    content: str
    mode: int

    def describe(self) -> str:
        return f"write   {self.target} (mode {self.mode:04o}): {self.content.strip()}"


class Remount(Operation):
    __slots__ = ("target", "flags")
    target: str
    flags: tuple[str, ...]

    def describe(self) -> str:
        return f"remount {self.target} [{','.join(self.flags)}]"


class DeviceRule(Operation):
    """Allow a char device in the container's device cgroup."""

    __slots__ = ("major", "minor", "access")
    _defaults = {"access": "rw"}
    major: int
    minor: int
    access: str

    def describe(self) -> str:
        return f"cgroup  allow c {self.major}:{self.minor} {self.access}"


class RefreshLdcache(Operation):
    """Rebuild the container's /etc/ld.so.cache with the host's ldconfig, confined to the rootfs."""

    __slots__ = ("directories",)
    directories: tuple[str, ...]

    def describe(self) -> str:
        return f"ldcache refresh /etc/ld.so.cache for {', '.join(self.directories)}"


class SelectedDevice(Frozen):
    """A GPU or MIG device the container gets, as users name them."""

    __slots__ = ("gpu", "mig")
    _defaults = {"mig": None}
    gpu: GpuInfo
    mig: MigDevice | None

    @property
    def name(self) -> str:
        if self.mig is None:
            return f"GPU {self.gpu.index} ({self.gpu.uuid}, {self.gpu.bus_id}, /dev/nvidia{self.gpu.minor})"
        return f"MIG {self.gpu.index}:{self.mig.index} ({self.mig.uuid or f'gi{self.mig.gi}/ci{self.mig.ci}'})"

    def summary(self) -> dict:
        """The device as the plan's JSON and the container records keep it."""
        mig = self.mig
        return {"gpu_index": self.gpu.index, "gpu_uuid": self.gpu.uuid,
                "mig_index": mig.index if mig else None, "mig_uuid": mig.uuid if mig else None}  # fmt: skip


class Plan(Frozen):
    __slots__ = ("request", "devices", "operations", "memory_limits", "applied_by_runtime", "mounted_by_runtime")
    _defaults = {"memory_limits": None, "applied_by_runtime": False, "mounted_by_runtime": ()}
    request: GpuRequest
    devices: tuple[SelectedDevice, ...]
    operations: tuple[Operation, ...]
    memory_limits: dict | None  # {device key: bytes} the watchdog enforces (memory_limit.py), or None
    # The runtime applied the devices (CDI): the hook carries out none of the operations and
    # only writes the container's record, with its limits (decide).
    applied_by_runtime: bool
    # Binds the runtime made already, the same host file at the same target (left_to_the_runtime):
    # not among the operations, the runtime's mounts stay as they are.
    mounted_by_runtime: tuple[BindMount, ...]

    def describe(self) -> str:
        lines = [f"request: {self.request.describe()}"]
        lines += [f"note: {note}" for note in self.request.notes]
        lines.append("devices: " + ("; ".join(d.name for d in self.devices) or "none"))
        if self.applied_by_runtime:
            lines.append("applied by the runtime (CDI): the hook only records the container")
            return "\n".join(lines)
        lines += [f"{i:3d}. {op.describe()}" for i, op in enumerate(self.operations, 1)]
        lines += [f"  -   {op.describe()}: mounted by the runtime already" for op in self.mounted_by_runtime]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "gpu_container": True,
            "devices": [d.summary() for d in self.devices],
            "capabilities": sorted(self.request.capabilities),
            "device_source": self.request.source,
            "notes": list(self.request.notes),
            "gpu_memory_limit": self.memory_limits,
            "applied_by_runtime": self.applied_by_runtime,
            "operations": [] if self.applied_by_runtime else [op.to_json() for op in self.operations],
            "mounted_by_runtime": [op.to_json() for op in self.mounted_by_runtime],
        }


# --- device selection ---------------------------------------------------------------------------


def resolve_device(device_id: str, inventory: Inventory) -> SelectedDevice | None:
    """One id of NVIDIA_VISIBLE_DEVICES -> the device, or None where this host has none."""
    gpus = inventory.gpus
    lowered = device_id.lower()
    index = device_index(device_id)
    gpu_part, colon, mig_part = device_id.partition(":")
    gpu_index, mig_index = (device_index(gpu_part), device_index(mig_part)) if colon else (None, None)
    if index is not None:
        if index < len(gpus):
            return SelectedDevice(gpus[index])
    elif gpu_index is not None and mig_index is not None:
        if gpu_index < len(gpus) and mig_index < len(gpus[gpu_index].mig):
            return SelectedDevice(gpus[gpu_index], gpus[gpu_index].mig[mig_index])
    elif lowered.startswith("gpu-"):
        for gpu in gpus:
            if gpu.uuid.lower() == lowered:
                return SelectedDevice(gpu)
    elif lowered.startswith("mig-gpu-"):  # MIG-GPU-<uuid>/<gi>/<ci>, before R470
        uuid, _, rest = device_id[4:].partition("/")
        gi, _, ci = rest.partition("/")
        for gpu in gpus:
            for mig in gpu.mig:
                if gpu.uuid.lower() == uuid.lower() and (str(mig.gi), str(mig.ci)) == (gi, ci):
                    return SelectedDevice(gpu, mig)
    elif lowered.startswith("mig-"):
        for gpu in gpus:
            for mig in gpu.mig:
                if mig.uuid and mig.uuid.lower() == lowered:
                    return SelectedDevice(gpu, mig)
        if inventory.nvml_error and any(mig.uuid is None for gpu in gpus for mig in gpu.mig):
            # Only NVML knows MIG UUIDs: say why they are unknown, and the way that works now.
            from oci_gpu_hook.start.nvml import advice

            raise RequestError(f"{device_id}: MIG devices are known by UUID only through NVML, which failed "
                               f"({inventory.nvml_error}); {advice(inventory.nvml_error)}, then run "
                               "`oci-gpu-hook inventory refresh`; meanwhile name the MIG device by index "
                               "(GPU:MIG, e.g. 0:1)")  # fmt: skip
    else:
        bus_id = normalize_bus_id(device_id)
        for gpu in gpus:
            if gpu.bus_id == bus_id:
                return SelectedDevice(gpu)
    return None


def _missing(device_id: str) -> str:
    """What an id that valid_device_id passed asks for, in words: GPU 7, MIG device 1:2, ..."""
    index = device_index(device_id)
    if index is not None:
        return f"GPU {index}"
    gpu, colon, mig = device_id.partition(":")
    if colon and device_index(gpu) is not None and device_index(mig) is not None:
        return f"MIG device {device_index(gpu)}:{device_index(mig)}"
    if device_id[:4].lower() == "mig-":
        return f"MIG device {device_id}"
    if device_id[:4].lower() == "gpu-":
        return f"GPU {device_id}"
    return f"GPU at PCI {device_id}"


def _ranges(numbers, prefix: str = "") -> list[str]:
    """0, 1, 2, 3, 5 -> ['0-3', '5']; prefix goes before each end ('1:' for GPU 1's MIG devices:
    '1:0-1:2')."""
    spans = []
    for n in sorted(numbers):
        if spans and spans[-1][1] == n - 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return [f"{prefix}{a}" if a == b else f"{prefix}{a}-{prefix}{b}" for a, b in spans]


def host_devices(inventory: Inventory) -> str:
    """What this host has, compactly: 'this host has GPUs 0-3 and MIG devices 1:0-1:2, 3:0-3:1'."""
    gpus = _ranges(gpu.index for gpu in inventory.gpus)
    if not gpus:
        return "this host has no GPUs"
    migs = [r for gpu in inventory.gpus for r in _ranges((mig.index for mig in gpu.mig), f"{gpu.index}:")]
    text = f"this host has GPU{'s' if len(inventory.gpus) > 1 else ''} {', '.join(gpus)}"
    if migs:
        several = sum(len(gpu.mig) for gpu in inventory.gpus) > 1
        text += f" and MIG device{'s' if several else ''} {', '.join(migs)}"
    return text


def select_devices(request: GpuRequest, inventory: Inventory) -> tuple[SelectedDevice, ...]:
    """The devices in the order asked. "all" (last, see read_device_list) adds every GPU and every
    MIG device, as libnvidia-container does: an `all` container can use the MIG instances too.
    An id the host lacks fails the start with what named it and what the host has."""
    selected: dict[tuple[int, int | None], SelectedDevice] = {}
    ids = request.devices[:-1] if request.all_devices else request.devices
    for device_id in ids:
        try:
            device = resolve_device(device_id, inventory)
        except RequestError as e:  # NVML's failure: said with what asked
            raise RequestError(f"{request.asked_by(device_id)}: {e.message}") from None
        if device is None:
            raise RequestError(f"{request.asked_by(device_id)}: no {_missing(device_id)} ({host_devices(inventory)})")
        selected.setdefault((device.gpu.index, device.mig.index if device.mig else None), device)
    if request.all_devices:
        for gpu in inventory.gpus:
            selected.setdefault((gpu.index, None), SelectedDevice(gpu))
        for gpu in inventory.gpus:
            for mig in gpu.mig:
                selected.setdefault((gpu.index, mig.index), SelectedDevice(gpu, mig))
    return tuple(selected.values())


def check_requirements(request: GpuRequest, inventory: Inventory, devices: tuple[SelectedDevice, ...]) -> None:
    if request.disable_require:
        return
    if not devices:
        request.requirements.check(GpuFacts(cuda=inventory.cuda_version, driver=inventory.driver_version))
        return
    for device in devices:
        gpu = device.gpu  # a MIG device is judged by its parent GPU
        facts = GpuFacts(
            cuda=inventory.cuda_version, driver=inventory.driver_version, arch=gpu.compute_capability, brand=gpu.brand
        )
        try:
            request.requirements.check(facts)
        except RequirementError as e:
            raise RequirementError(f"{e.message} (GPU {gpu.index})" if len(devices) > 1 else e.message) from None


# --- building the plan --------------------------------------------------------------------------


class _Builder:
    def __init__(self, inventory: Inventory):
        self.inventory = inventory
        self.operations: list[Operation] = []
        self.targets = set()

    def add(self, op: Operation) -> None:
        target = getattr(op, "target", None)
        if target is not None and not isinstance(op, Remount):  # a remount changes what is there
            if target in self.targets:
                return  # the same file asked for twice (e.g. a node shared by two MIG devices)
            self.targets.add(target)
        self.operations.append(op)

    def device(self, node: DeviceNode, what: str) -> None:
        if node.problem:
            raise InventoryError(f"{what} ({node.path}): device node {node.problem}")
        if node.path in self.targets:
            return
        source = host_path(self.inventory.dev_root, node.path)
        self.add(MountDevice(source, node.path, node.major, node.minor))
        self.operations.append(DeviceRule(node.major, node.minor))

    def file(self, f: DriverFile, target: str, flags=FILE_FLAGS) -> None:
        self.add(BindMount(host_path(self.inventory.driver_root, f.path), target, "file", flags))


def _dri(builder: _Builder, gpu) -> None:
    """graphics/display: the GPU's DRM card and render nodes (EGL, Vulkan and GBM open them), and
    the /dev/dri/by-path links that name them by PCI address, as NVIDIA's runtime adds them."""
    for node in gpu.dri:
        builder.device(node, f"GPU {gpu.index} DRM node")
        kind = "render" if os.path.basename(node.path).startswith("renderD") else "card"
        builder.add(Symlink(f"/dev/dri/by-path/pci-{gpu.bus_id}-{kind}", f"../{os.path.basename(node.path)}"))


def with_dependencies(inventory: Inventory, selected) -> tuple:
    """selected (driver libraries) and every driver library they NEED, transitively, of the same
    word size, whatever capability lists it: a library mounted without what it needs cannot load
    (libnvidia-glcore, a graphics library, NEEDs libnvidia-gpucomp, which compute lists)."""
    by_name = {}
    for f in inventory.files:
        if f.kind in ("library", "library32"):
            for name in (f.soname, os.path.basename(f.path)):
                by_name.setdefault((f.kind, name), f)
    chosen = list(selected)
    seen = {f.path for f in chosen}
    for f in chosen:  # grows while it is walked
        for name in f.needs:
            dependency = by_name.get((f.kind, name))
            if dependency is not None and dependency.path not in seen:
                seen.add(dependency.path)
                chosen.append(dependency)
    return tuple(chosen)


def _libraries(builder: _Builder, request: GpuRequest, layout: LibraryLayout, for_cdi: bool) -> tuple[str, ...]:
    inventory, caps = builder.inventory, request.capabilities
    kinds = ("library", "library32") if "compat32" in caps and layout.lib32 else ("library",)
    dirs = []
    for f in with_dependencies(inventory, inventory.files_for(caps, kinds)):
        directory = layout.lib64 if f.kind == "library" else layout.lib32
        name = os.path.basename(f.path)
        if name.startswith(driver.VDPAU_PREFIX + "."):
            # VDPAU's loader looks only in <libdir>/vdpau/ (not in the ld cache): mounted there,
            # with its SONAME link, and that directory left out of the ld cache as on the host.
            builder.file(f, f"{directory}/{driver.VDPAU_DIR}/{name}")
            builder.add(Symlink(f"{directory}/{driver.VDPAU_DIR}/{f.soname}", name))
            continue
        builder.file(f, f"{directory}/{name}")
        if f.soname and f.soname != name:
            builder.add(Symlink(f"{directory}/{f.soname}", name))
        if name.startswith("libcuda.so."):
            builder.add(Symlink(f"{directory}/libcuda.so", "libcuda.so.1"))
        if name.startswith("libGLX_nvidia.so."):
            builder.add(Symlink(f"{directory}/libGLX_indirect.so.0", name))
        # The development link NVIDIA's hook adds (the Optical Flow SDK dlopens the bare name).
        if name.startswith("libnvidia-opticalflow.so."):
            builder.add(Symlink(f"{directory}/libnvidia-opticalflow.so", "libnvidia-opticalflow.so.1"))
        if for_cdi and name.startswith("libnvidia-ml.so."):  # NVIDIA's CDI specs carry it (its hook does not)
            builder.add(Symlink(f"{directory}/libnvidia-ml.so", "libnvidia-ml.so.1"))
        if name.startswith("libnvidia-allocator.so.") and "graphics" in caps and f.kind == "library":
            # Mesa's GBM loads <libdir>/gbm/<name>_gbm.so; NVIDIA's backend is the allocator.
            builder.add(Symlink(f"{directory}/gbm/nvidia-drm_gbm.so", "../libnvidia-allocator.so.1"))
        if directory not in dirs:
            dirs.append(directory)
    return tuple(dirs)


def app_profile_text(devices: tuple[SelectedDevice, ...]) -> str:
    """libnvidia-container's profile, byte for byte: EGLVisibleDGPUDevices is a mask of device
    minors (the driver documents 32 bits; minors past 63 cannot be named)."""
    mask = 0
    for device in devices:
        if device.gpu.minor < 64:
            mask |= 1 << device.gpu.minor
    return ('{"profiles": [{"name": "_container_", "settings": ["EGLVisibleDGPUDevices", '
            f'0x{mask:x}]}}], "rules": [{{"pattern": [], "profile": "_container_"}}]}}\n')  # fmt: skip


def _app_profile(builder: _Builder, devices: tuple[SelectedDevice, ...]) -> None:
    builder.add(MountTmpfs(APP_PROFILE_DIR, 0o555))
    if devices:
        builder.add(WriteFile(APP_PROFILE, app_profile_text(devices), 0o444))
    builder.add(Remount(APP_PROFILE_DIR, ("ro",) + TMPFS_FLAGS))


def _proc_driver(builder: _Builder, devices: tuple[SelectedDevice, ...], request: GpuRequest) -> None:
    """Mask /proc/driver/nvidia: only sanitised driver files and the selected GPUs show."""
    inventory = builder.inventory
    proc = inventory.proc_root
    builder.add(MountTmpfs(PROC_NVIDIA, 0o555, optional=True))
    for name in ("params", "version", "registry"):
        # ModifyDeviceFiles: 0 stops a driver inside from creating device nodes of its own.
        rewrite = (("ModifyDeviceFiles:", "ModifyDeviceFiles: 0"),) if name == "params" else ()
        builder.add(CopyFile(host_path(proc, f"{PROC_NVIDIA}/{name}"), f"{PROC_NVIDIA}/{name}", rewrite))
    for device in devices:
        gpu_dir = f"{PROC_NVIDIA}/gpus/{device.gpu.bus_id}"
        builder.add(BindMount(host_path(proc, gpu_dir), gpu_dir, "dir", PROC_FLAGS))
        if device.mig:
            for access in (device.mig.gi_access, device.mig.ci_access):
                builder.add(BindMount(host_path(proc, access), access, "file", PROC_FLAGS))
    for name, wanted in (("config", request.mig_config), ("monitor", request.mig_monitor)):
        if wanted:
            path = f"{PROC_NVIDIA}/capabilities/mig/{name}"
            builder.add(BindMount(host_path(proc, path), path, "file", PROC_FLAGS))
    builder.add(Remount(PROC_NVIDIA, ("ro",) + TMPFS_FLAGS))


def _imex(builder: _Builder, request: GpuRequest) -> None:
    """The IMEX channels asked for: each a device node (and its device rule), its major from
    /proc/devices (nvidia-caps-imex-channels), its minor the channel number."""
    if not request.imex_channels:
        return
    inventory = builder.inventory
    channels = inventory.imex_channels
    if request.imex_channels == ("all",):
        numbers = sorted(int(n) for n, node in channels.items() if node.problem is None)
    else:
        numbers = list(request.imex_channels)
    if numbers and driver.IMEX_MAJOR_NAME not in inventory.majors:
        raise InventoryError(f"IMEX channels: /proc/devices lists no {driver.IMEX_MAJOR_NAME} driver")
    for number in numbers:
        node = channels.get(str(number))
        if node is None:
            raise InventoryError(f"IMEX channel {number} ({driver.IMEX_CHANNELS_DIR}/channel{number}): no such "
                                 f"channel on this host; create it with nvidia-modprobe -i {number}")  # fmt: skip
        builder.device(node, f"IMEX channel {number}")


def build_plan(request: GpuRequest, inventory: Inventory, layout: LibraryLayout, for_cdi: bool = False) -> Plan:
    """for_cdi: the plan a CDI spec is translated from (toolkit/cdi.py): NVIDIA's CDI specs carry
    two development links its hook does not add, and so do ours."""
    devices = select_devices(request, inventory)
    check_requirements(request, inventory, devices)
    caps = request.capabilities
    builder = _Builder(inventory)
    control = inventory.control_devices

    # The libraries first, and the ld cache refresh right after them: ldconfig reads nothing the
    # later operations make, so apply.py mounts those while it works.
    library_dirs = _libraries(builder, request, layout, for_cdi)
    if library_dirs:
        builder.add(RefreshLdcache(library_dirs))
    builder.device(control["nvidiactl"], "nvidiactl")
    if "compute" in caps:
        for name in ("nvidia-uvm", "nvidia-uvm-tools"):
            if name not in control:
                raise InventoryError(
                    f"{name}: /proc/devices lists no nvidia-uvm driver; load it (nvidia-modprobe -u -c=0)"
                )
            builder.device(control[name], name)
    if "display" in caps:
        builder.device(control["nvidia-modeset"], "nvidia-modeset")
    for device in devices:
        builder.device(device.gpu.node, f"GPU {device.gpu.index}")
        if caps & {"graphics", "display"}:
            _dri(builder, device.gpu)
        if device.mig:
            builder.device(device.mig.gi_cap, f"MIG {device.gpu.index}:{device.mig.index} GPU instance")
            builder.device(device.mig.ci_cap, f"MIG {device.gpu.index}:{device.mig.index} compute instance")
    for name, wanted in (("config", request.mig_config), ("monitor", request.mig_monitor)):
        if wanted:
            if name not in inventory.mig_caps:
                raise InventoryError(f"MIG {name}: /proc/devices lists no nvidia-caps driver")
            builder.device(inventory.mig_caps[name], f"MIG {name} capability")
    _imex(builder, request)

    for f in inventory.files_for(caps, ("binary",)):
        builder.file(f, f"/usr/bin/{os.path.basename(f.path)}")
    for f in inventory.files:
        if f.kind == "firmware":
            builder.file(f, f.path)
    for f in inventory.files_for(caps, ("ipc",)):
        builder.add(BindMount(host_path(inventory.driver_root, f.path), f.path, "socket", SOCKET_FLAGS, optional=True))
    if "compute" in caps and request.mps_pipe_directory:
        source = host_path(inventory.driver_root, request.mps_pipe_directory)
        builder.add(BindMount(source, request.mps_pipe_directory, "dir", IPC_FLAGS, optional=True))
    for f in inventory.files_for(caps, ("config",)):
        builder.file(f, f.target or f.path)
    if "graphics" in caps:
        _app_profile(builder, devices)
    _proc_driver(builder, devices, request)
    return Plan(request=request, devices=devices, operations=tuple(builder.operations))


# --- the decision -------------------------------------------------------------------------------


def decide(spec, settings, inventory_for) -> Plan | None:
    """What a container gets: its request, the plan on the host's inventory and its GPU memory
    limits, decided here once for the hook (which carries it out) and for `plan` (which prints
    it), so that the dry run says what the hook would do, refusals included. None when the
    container asks for no GPU. A plan applied_by_runtime where the runtime applied the devices
    (CDI): the hook then only records the container, so that the node services see it (its
    limits enforced, its pod named). inventory_for() is called only for a GPU container: the
    hook's cache under its budget, or discovery."""
    from oci_gpu_hook.start import request as request_module

    gpu_request = request_module.parse_request(spec, settings)
    if gpu_request is None:
        return None
    plan = decide_for(gpu_request, inventory_for(), layout_of(spec.rootfs), settings, spec)
    if gpu_request.source == request_module.RUNTIME_CDI:
        # Never configured by the hook: recorded where the runtime made the devices' nodes.
        return plan.replace(applied_by_runtime=True) if devices_applied(plan, spec) else None
    if gpu_request.source == "cdi-annotation" and applied_by_the_runtime(plan, spec):
        return plan.replace(applied_by_runtime=True)
    return left_to_the_runtime(plan, spec)


def in_proc_driver(target: str) -> bool:
    """Whether a target lies in the /proc/driver/nvidia mask, which has no CDI form."""
    return target == PROC_NVIDIA or target.startswith(PROC_NVIDIA + "/")


def _runtime_nodes(devices) -> set:
    """config.json's linux.devices as (path, type, major, minor), 'u' read as 'c' (unbuffered is
    a character device); malformed entries left out, so they never count as applied. Parsed here,
    not in spec.parse: only a container the hook may stand down for needs them."""

    def number(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    return {
        (os.path.normpath(d["path"]), "c" if d["type"] == "u" else d["type"], d["major"], d["minor"])
        for d in devices
        if isinstance(d, dict)
        and isinstance(d.get("path"), str)
        and d["path"]
        and isinstance(d.get("type"), str)
        and number(d.get("major"))
        and number(d.get("minor"))
    }


def devices_applied(plan: Plan, spec) -> bool:
    """Whether config.json's linux.devices holds each selected device's own nodes (a GPU's
    /dev/nvidiaN, a MIG device's GPU and compute instance nodes), with their numbers: the runtime
    gave the container these devices. A pod cannot add nodes to linux.devices; a privileged one
    has every node, and every device, already."""
    nodes = _runtime_nodes(spec.devices)
    wanted = [d.gpu.node for d in plan.devices]
    wanted += [n for d in plan.devices if d.mig for n in (d.mig.gi_cap, d.mig.ci_cap)]
    return bool(wanted) and all((n.path, "c", n.major, n.minor) in nodes for n in wanted)


def applied_by_the_runtime(plan: Plan, spec) -> bool:
    """Whether the runtime has already put this plan's devices and driver files into the
    container: a runtime that applies CDI (CRI-O; containerd 1.7+) resolves the same cdi.k8s.io
    annotations the hook reads with accept_cdi_annotations, against the spec `cdi generate` wrote
    from the same plan, and the hook would then find the runtime's mounts where its own go.

    All of it, never one path: every device node the plan makes is in linux.devices with its
    path and numbers, and every driver file it binds is a mount source (told by the sources: the
    targets may differ, as the spec's library layout is not the image's). A pod adds mounts of
    its own (hostPath: the MPS pipe directory, a driver file, all of them), and a runtime without
    CDI passes them on; linux.devices comes from the runtime alone. Where the runtime applied
    only part, the hook does its job, so that the container gets what it asked for, with its
    rules and its record, or fails with one line; standing down would leave it with whatever
    part it has and no record. Left out, as CDI specs leave them out: the optional IPC endpoints (in a spec only
    where they existed when it was written) and the /proc/driver/nvidia mask."""
    nodes = _runtime_nodes(spec.devices)
    mounted = {m.source for m in spec.mounts}
    wanted = 0
    for op in plan.operations:
        if isinstance(op, MountDevice):
            present = (op.target, "c", op.major, op.minor) in nodes
        elif isinstance(op, BindMount) and not op.optional and not in_proc_driver(op.target):
            present = op.source in mounted
        else:
            continue
        if not present:
            return False
        wanted += 1
    return wanted > 0


def left_to_the_runtime(plan: Plan, spec) -> Plan:
    """The plan less the binds the runtime has made already: a mount in config.json of the same
    host file (source) at the same target, as a runtime that applied a CDI device's mounts but
    not its nodes leaves them (or a pod's own mount of that file, which the runtime makes alike).
    The hook gives what is missing (the nodes, their rules, the record) and leaves those mounts as
    they are: binding the file again over them gains nothing, and over the runtime's mount of a
    socket (the persistenced socket) the hook's target check refuses, since a mount target must
    be a regular file. Decided here, from config.json alone, for the hook and for `plan` alike.
    A mount of another source at one of the plan's targets is not the plan's file: the hook binds
    its own over it, as before."""
    made = {(os.path.normpath(m.source), os.path.normpath(m.destination)) for m in spec.mounts
            if m.source.startswith("/") and m.destination.startswith("/")}  # fmt: skip
    if not made:
        return plan
    kept, left = [], []
    for op in plan.operations:
        mounted = isinstance(op, BindMount) and (os.path.normpath(op.source), os.path.normpath(op.target)) in made
        (left if mounted else kept).append(op)
    return plan.replace(operations=tuple(kept), mounted_by_runtime=tuple(left)) if left else plan


def decide_for(gpu_request: GpuRequest, inventory: Inventory, layout: LibraryLayout, settings, spec=None,
               for_cdi: bool = False) -> Plan:  # fmt: skip
    """decide() for a request already parsed; `cdi generate` calls it with requests of its own and
    no container (spec None: no container's limits to resolve)."""
    plan = build_plan(gpu_request, inventory, layout, for_cdi)
    if spec is None:
        return plan
    from oci_gpu_hook.start import memory_limit

    # Checked before anything changes: a bad limit fails the start with nothing to undo.
    limits = memory_limit.resolve(spec.env, spec.annotations, settings.shared_gpu_memory_limit,
                                  settings.node.replicas, plan.devices, spec.mounts)  # fmt: skip
    return plan.replace(memory_limits=limits)


def layout_of(rootfs: str) -> LibraryLayout:
    """Where the image's loader looks for libraries, from the directories it has."""
    from oci_gpu_hook.start.linux.rootfs import directories

    return LibraryLayout.for_image(directories(rootfs, LibraryLayout.probe_paths()))
