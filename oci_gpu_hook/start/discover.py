"""Discovery: fill the inventory model (inventory.py) from the host.

Reads procfs, device nodes and the driver root's ld.so.cache (cheap, always there on a loaded
driver; the parsers load only when discovering, not on the hook's cache hit) and asks NVML
(nvml.py, a child process) only for what procfs lacks: CUDA version, brand, compute capability,
memory and MIG UUIDs.
"""

from __future__ import annotations

import os
import stat

from oci_gpu_hook.errors import InventoryError, NvmlError
from oci_gpu_hook.start import driver, files
from oci_gpu_hook.start.digits import decimal, is_decimal
from oci_gpu_hook.start.inventory import (
    DEPENDENCY,
    DeviceNode,
    DriverFile,
    GpuInfo,
    Inventory,
    MigDevice,
    host_path,
)
from oci_gpu_hook.start.settings import Settings

NVIDIA_PROC = "/proc/driver/nvidia"
BINARY_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin")
FIRMWARE_DIRS = ("/lib/firmware/nvidia", "/usr/lib/firmware/nvidia")


def read_text(path: str, limit: int = 1 << 20) -> str:
    try:
        data = files.read_bounded(path, limit)
    except OSError as e:
        raise InventoryError(f"{path}: {e.strerror}") from None
    if len(data) > limit:
        raise InventoryError(f"{path}: larger than {limit} bytes")
    return data.decode("utf-8", "replace")


def _bus_order(bus_id: str) -> tuple[int, ...]:
    domain, bus, rest = bus_id.split(":")
    device, function = rest.split(".")
    return (int(domain, 16), int(bus, 16), int(device, 16), int(function, 16))


def check_node(dev_root: str, path: str, major: int, minor: int) -> DeviceNode:
    """A device node, trusted only if it is a char device with the expected numbers."""
    try:
        st = os.lstat(host_path(dev_root, path))
    except FileNotFoundError:
        return DeviceNode(path, major, minor, "missing")
    except OSError as e:
        return DeviceNode(path, major, minor, e.strerror)
    if not stat.S_ISCHR(st.st_mode):
        return DeviceNode(path, major, minor, "not a character device")
    if (os.major(st.st_rdev), os.minor(st.st_rdev)) != (major, minor):
        return DeviceNode(
            path, major, minor, f"is {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}, expected {major}:{minor}"
        )
    return DeviceNode(path, major, minor)


def read_imex_channels(settings: Settings, major: int | None) -> dict[str, DeviceNode]:
    """{"<n>": node} for each /dev/nvidia-caps-imex-channels/channel<n> there is (the driver, or
    nvidia-modprobe -i <n>, makes them on demand), checked against the major /proc/devices gives."""
    if major is None:
        return {}
    try:
        names = os.listdir(host_path(settings.dev_root, driver.IMEX_CHANNELS_DIR))
    except OSError:
        return {}
    channels = {}
    for name in names:
        number = decimal(name[len("channel") :]) if name.startswith("channel") else None
        if number is not None and number <= driver.IMEX_MAX_CHANNEL:
            channels[str(number)] = check_node(settings.dev_root, f"{driver.IMEX_CHANNELS_DIR}/{name}", major, number)
    return channels


def read_driver_version(settings: Settings) -> str:
    from oci_gpu_hook.start import procfs

    path = host_path(settings.proc_root, f"{NVIDIA_PROC}/version")
    if not os.path.exists(path):
        raise InventoryError(f"{path}: not found: the NVIDIA kernel driver is not loaded")
    return procfs.parse_driver_version(read_text(path), path)


def read_majors(settings: Settings) -> dict[str, int]:
    from oci_gpu_hook.start import procfs

    path = host_path(settings.proc_root, "/proc/devices")
    majors = procfs.parse_proc_devices(read_text(path))
    found = {name: majors[name] for name in driver.PROC_DEVICES_NAMES if name in majors}
    if found.get("nvidia", driver.NVIDIA_MAJOR) != driver.NVIDIA_MAJOR:
        raise InventoryError(f"{path}: 'nvidia' has major {found['nvidia']}, expected {driver.NVIDIA_MAJOR}")
    found.setdefault("nvidia", driver.NVIDIA_MAJOR)
    return found


def read_procfs_gpus(settings: Settings):
    """[(information dict)] in NVML index order (PCI bus order)."""
    from oci_gpu_hook.start import procfs

    gpus_dir = host_path(settings.proc_root, f"{NVIDIA_PROC}/gpus")
    try:
        entries = sorted(os.listdir(gpus_dir))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise InventoryError(f"{gpus_dir}: {e.strerror}") from None
    found = []
    for entry in entries:
        path = os.path.join(gpus_dir, entry, "information")
        info = procfs.parse_gpu_information(read_text(path), path)
        if info["minor"] is None:
            raise InventoryError(f"{path}: no 'Device Minor' line (this driver is too old; 450 or newer is needed)")
        found.append(info)
    found.sort(key=lambda info: _bus_order(info["bus_id"]))
    return found


def read_dri_nodes(settings: Settings, bus_id: str) -> tuple[DeviceNode, ...]:
    """A GPU's DRM card and render nodes, found as udev names them: /dev/dri/by-path/
    pci-<bus id>-card -> ../card1 (and -render). None when nvidia-drm is not loaded. A link that
    leads anywhere but a char 226 node in /dev/dri is not used."""
    found = []
    for kind, prefix in (("card", "card"), ("render", "renderD")):
        link = host_path(settings.dev_root, f"{driver.DRI_BY_PATH}/pci-{bus_id}-{kind}")
        try:
            value = os.readlink(link)
        except OSError:
            continue
        name = value[3:] if value.startswith("../") else ""
        if not (name.startswith(prefix) and is_decimal(name[len(prefix) :])):
            continue
        try:
            st = os.lstat(host_path(settings.dev_root, f"/dev/dri/{name}"))
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == driver.DRM_MAJOR:
            found.append(DeviceNode(f"/dev/dri/{name}", driver.DRM_MAJOR, os.minor(st.st_rdev)))
    return tuple(found)


def read_mig_devices(settings: Settings, gpu_minor: int, caps_major: int | None, nvml_mig) -> tuple[MigDevice, ...]:
    """MIG devices of one GPU: cap minors from procfs, order and UUIDs from NVML when known."""
    import glob

    from oci_gpu_hook.start import procfs

    base = f"{NVIDIA_PROC}/capabilities/gpu{gpu_minor}/mig"
    instances = {}
    for gi_access in glob.glob(host_path(settings.proc_root, f"{base}/gi*/access")):
        gi_dir = os.path.dirname(gi_access)
        gi = decimal(os.path.basename(gi_dir)[2:])
        if gi is None:
            continue
        for ci_access in glob.glob(os.path.join(gi_dir, "ci*", "access")):
            ci = decimal(os.path.basename(os.path.dirname(ci_access))[2:])
            if ci is not None:
                instances[(gi, ci)] = (gi_access, ci_access)
    if nvml_mig is not None:
        order = [((m["gi"], m["ci"]), m) for m in nvml_mig]
    else:
        order = [(key, {}) for key in sorted(instances)]
    devices = []
    for key, facts in order:
        if key not in instances:
            raise NvmlError(
                f"NVML lists MIG device gi{key[0]}/ci{key[1]} of GPU minor {gpu_minor}, "
                f"but {base}/gi{key[0]}/ci{key[1]}/access does not exist"
            )
        if caps_major is None:
            raise InventoryError("MIG devices exist but /proc/devices has no 'nvidia-caps' major")
        gi_access, ci_access = instances[key]
        gi_minor = procfs.parse_cap_minor(read_text(gi_access), gi_access)
        ci_minor = procfs.parse_cap_minor(read_text(ci_access), ci_access)
        devices.append(
            MigDevice(
                index=len(devices),
                gi=key[0],
                ci=key[1],
                uuid=facts.get("uuid"),
                profile=facts.get("profile"),
                memory_total=facts.get("memory_total"),
                attributes=facts.get("attributes"),
                gi_cap=check_node(settings.dev_root, f"/dev/nvidia-caps/nvidia-cap{gi_minor}", caps_major, gi_minor),
                ci_cap=check_node(settings.dev_root, f"/dev/nvidia-caps/nvidia-cap{ci_minor}", caps_major, ci_minor),
                gi_access="/" + os.path.relpath(gi_access, settings.proc_root),
                ci_access="/" + os.path.relpath(ci_access, settings.proc_root),
            )
        )
    return tuple(devices)


MAX_SYMLINKS = 40


def resolve_in_root(root: str, path: str) -> str | None:
    """The host path of what path names inside root, every symlink followed with root as / (an
    absolute link, as Debian's /etc/alternatives ones are, stays inside a driver root that is not
    /); None for a loop. For root /, this is os.path.realpath."""
    pending = [p for p in path.split("/") if p]
    current: list = []
    links = 0
    while pending:
        name = pending.pop(0)
        if name == ".":
            continue
        if name == "..":
            if current:
                current.pop()
            continue
        candidate = os.path.join(root, *current, name)
        if os.path.islink(candidate):
            links += 1
            if links > MAX_SYMLINKS:
                return None
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = []
            pending = [p for p in target.split("/") if p] + pending
        else:
            current.append(name)
    return os.path.join(root, *current)


def _relative(root: str, real: str) -> str:
    return "/" + os.path.relpath(real, root)


def find_libraries(settings: Settings, version: str) -> tuple[DriverFile, ...]:
    """Driver libraries from the driver root's ld.so.cache, resolved inside the driver root to the
    versioned file, with the driver libraries each NEEDs; the VDPAU backend from <libdir>/vdpau/
    (not in the cache); and the libraries only another one needs (DEPENDENCY)."""
    from oci_gpu_hook.start import elf, ldcache

    root = settings.driver_root
    cache = host_path(root, "/etc/ld.so.cache")
    if not os.path.exists(cache):
        raise InventoryError(f"{cache}: not found: run ldconfig on the host after installing the driver")
    prefixes = {prefix: cap for cap, names in driver.LIBRARIES.items() for prefix in names}
    found: dict = {}  # relative path -> DriverFile
    search_dirs: set = set()  # (directory, kind) of the driver's libraries and of their links
    by_name: dict = {}  # (kind, ld cache name) -> real host path, for what libraries NEED

    def add(real: str, kind: str, capability: str, soname: str | None) -> DriverFile:
        relative = _relative(root, real)
        if relative in found:
            return found[relative]
        try:
            own, needed = elf.read_dynamic(real)
        except (OSError, elf.NotElf):  # listed all the same: what it needs is then unknown
            own, needed = None, ()
        f = DriverFile(capability, kind, relative, own or soname, tuple(needed))
        found[relative] = f
        return f

    for entry in ldcache.read(cache):
        if entry.word_size not in (32, 64):
            continue
        real = resolve_in_root(root, entry.path)
        # Only files of this driver version: a library left over from another driver must not
        # reach containers. resolve_in_root keeps every link inside the driver root.
        if real is None or not os.path.isfile(real) or not os.path.basename(real).endswith("." + version):
            continue
        kind = "library" if entry.word_size == 64 else "library32"
        by_name.setdefault((kind, entry.name), real)
        search_dirs.update({(os.path.dirname(entry.path), kind), (os.path.dirname(_relative(root, real)), kind)})
        prefix = entry.name.split(".so", 1)[0] + ".so"
        capability = prefixes.get(prefix)
        if capability is not None and os.path.basename(real) == f"{prefix}.{version}":
            # A 32-bit library keeps its own capability; compat32 decides whether 32-bit ones go in.
            add(real, kind, capability, entry.name)
    # VDPAU's backend, where the driver installs it: <libdir>/vdpau/ beside its libraries (or
    # beside their links: Debian's are in the library directory, its files elsewhere).
    import glob

    backend = f"{driver.VDPAU_PREFIX}.{version}"
    for directory, kind in sorted(search_dirs):
        for candidate in sorted(glob.glob(host_path(root, f"{directory}/{driver.VDPAU_DIR}/{driver.VDPAU_PREFIX}.*"))):
            real = resolve_in_root(root, _relative(root, candidate))
            if real is not None and os.path.isfile(real) and os.path.basename(real) == backend:
                add(real, kind, "video", "libvdpau_nvidia.so.1")
    # What the libraries need, from the ELF files: a driver library no capability lists is added
    # as a DEPENDENCY (it goes into a container only with a library that needs it).
    pending = list(found.values())
    while pending:
        f = pending.pop()
        for name in f.needs:
            real = by_name.get((f.kind, name))
            if real is not None and _relative(root, real) not in found:
                pending.append(add(real, f.kind, DEPENDENCY, name))
    return tuple(sorted(found.values(), key=lambda f: (f.kind, f.path)))


def _config_usable(path: str, libraries: set) -> bool:
    """A driver JSON configuration file is used only when the library it names (library_path) is
    one of the driver's: the EGL GBM and Wayland platform files name libraries of other packages,
    and mounting a file whose library is absent breaks the loader that reads it."""
    if not path.endswith(".json"):
        return True
    import json

    try:
        doc = json.loads(read_text(path, 1 << 16))
        library = next(v["library_path"] for v in doc.values() if isinstance(v, dict) and "library_path" in v)
    except (InventoryError, ValueError, StopIteration, TypeError):
        return False
    return os.path.basename(library) in libraries


def find_other_files(settings: Settings, version: str, libraries=()) -> tuple[DriverFile, ...]:
    import glob

    root = settings.driver_root

    def exists(path, want):
        return want(host_path(root, path))

    def resolved(path):
        """The path relative to the driver root of what path names there, if it is a file."""
        real = resolve_in_root(root, path)
        return _relative(root, real) if real is not None and os.path.isfile(real) else None

    files = []
    for capability, names in driver.BINARIES.items():
        for name in names:
            # Debian's /usr/bin/nvidia-smi is a link through /etc/alternatives: the file it
            # reaches inside the driver root is the mount source (the plan keeps the name).
            path = next((p for p in (resolved(f"{d}/{name}") for d in BINARY_DIRS) if p), None)
            if path and os.path.basename(path) == name:
                files.append(DriverFile(capability, "binary", path))
    for directory in FIRMWARE_DIRS:
        pattern = host_path(root, f"{directory}/{version}/gsp*.bin")
        for path in sorted(glob.glob(pattern)):
            files.append(DriverFile("utility", "firmware", f"{directory}/{version}/{os.path.basename(path)}"))
    for capability, sockets in driver.IPC_SOCKETS.items():
        for sock in sockets:
            if exists(sock, lambda p: os.path.exists(p) and stat.S_ISSOCK(os.stat(p).st_mode)):
                files.append(DriverFile(capability, "ipc", sock))
    names = {n for f in libraries for n in (f.soname, os.path.basename(f.path)) if n}
    for capability, paths in driver.CONFIG_FILES.items():
        for path in paths:
            source = resolved(path)
            if source is not None and _config_usable(host_path(root, source), names):
                files.append(DriverFile(capability, "config", source, target=path if source != path else None))
    return tuple(files)


def discover(settings: Settings, use_nvml: bool = True, nvml_timeout: float | None = None) -> Inventory:
    version = read_driver_version(settings)
    majors = read_majors(settings)
    libraries = find_libraries(settings, version)
    facts, nvml_error = None, None
    if use_nvml:
        from oci_gpu_hook.start import nvml

        library = nvml.library(libraries, settings.driver_root)
        if library is not None:
            # What procfs and the device nodes say does not wait for NVML: when it fails (no
            # kernel module, a driver upgraded without a reboot), the inventory holds every GPU
            # without NVML's facts, and says why; only what needs those facts is refused.
            try:
                facts = nvml.query(library, nvml.DEFAULT_TIMEOUT if nvml_timeout is None else nvml_timeout)
            except nvml.NvmlTimeout:
                raise  # a hung driver: no GPU is handed out on its word
            except NvmlError as e:
                nvml_error = e.message
    nvml_gpus = facts["gpus"] if facts else {}
    caps_major = majors.get("nvidia-caps")
    gpus = []
    for index, info in enumerate(read_procfs_gpus(settings)):
        extra = nvml_gpus.get(info["uuid"], {})
        brand = extra.get("brand")
        gpus.append(
            GpuInfo(
                index=index,
                minor=info["minor"],
                uuid=info["uuid"],
                bus_id=info["bus_id"],
                model=info["model"],
                node=check_node(settings.dev_root, f"/dev/nvidia{info['minor']}", driver.NVIDIA_MAJOR, info["minor"]),
                brand=driver.BRANDS[brand] if isinstance(brand, int) and 0 <= brand < len(driver.BRANDS) else None,
                compute_capability=extra.get("compute_capability"),
                memory_total=extra.get("memory_total"),
                mig=read_mig_devices(settings, info["minor"], caps_major, extra.get("mig") if facts else None),
                dri=read_dri_nodes(settings, info["bus_id"]),
            )
        )
    control = {
        "nvidiactl": (driver.NVIDIA_MAJOR, driver.NVIDIACTL_MINOR),
        "nvidia-modeset": (driver.NVIDIA_MAJOR, driver.NVIDIA_MODESET_MINOR),
    }
    if "nvidia-uvm" in majors:
        control["nvidia-uvm"] = (majors["nvidia-uvm"], driver.UVM_MINOR)
        control["nvidia-uvm-tools"] = (majors["nvidia-uvm"], driver.UVM_TOOLS_MINOR)
    mig_caps = {}
    if caps_major is not None:
        for name, minor in (("config", driver.MIG_CONFIG_CAP_MINOR), ("monitor", driver.MIG_MONITOR_CAP_MINOR)):
            mig_caps[name] = check_node(settings.dev_root, f"/dev/nvidia-caps/nvidia-cap{minor}", caps_major, minor)
    return Inventory(
        driver_version=version,
        cuda_version=facts["cuda_version"] if facts else None,
        nvml=facts is not None,
        driver_root=settings.driver_root,
        dev_root=settings.dev_root,
        proc_root=settings.proc_root,
        majors=majors,
        gpus=tuple(gpus),
        control_devices={name: check_node(settings.dev_root, f"/dev/{name}", *nums) for name, nums in control.items()},
        mig_caps=mig_caps,
        files=libraries + find_other_files(settings, version, libraries),
        nvml_error=nvml_error,
        imex_channels=read_imex_channels(settings, majors.get(driver.IMEX_MAJOR_NAME)),
    )
