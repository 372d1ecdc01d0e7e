"""What a container asks for: which GPUs, which driver capabilities, which requirements.

Pure: from the container's Spec and the Settings to a GpuRequest, or None for a container that is
not a GPU container (the hook then touches nothing). The rules follow NVIDIA's container stack so
that images and pod specs behave the same; where they are looser than safe (an image choosing a
host directory to mount through CUDA_MPS_PIPE_DIRECTORY) we are stricter, and say so.
Device ids are checked for syntax here and matched against the host in plan.py.
"""

from __future__ import annotations

import os

from oci_gpu_hook.errors import RequestError, printable
from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.start import driver
from oci_gpu_hook.start.prefilter_rule import (
    CDI_ANNOTATION_PREFIX,
    CDI_DEVICE_ENV_PREFIX,
    LEGACY_VARIABLE,
    NO_DEVICES,
    VISIBLE_DEVICES,
)
from oci_gpu_hook.start.requirements import Requirements, legacy_cuda_requirement, parse_bool, parse_requirements
from oci_gpu_hook.start.settings import Settings
from oci_gpu_hook.start.spec import VOLUME_MOUNT_DIR, Spec, name_under, volume_mount_device

DRIVER_CAPABILITIES = "NVIDIA_DRIVER_CAPABILITIES"
MIG_CONFIG_DEVICES = "NVIDIA_MIG_CONFIG_DEVICES"
MIG_MONITOR_DEVICES = "NVIDIA_MIG_MONITOR_DEVICES"
IMEX_CHANNELS = "NVIDIA_IMEX_CHANNELS"
# The device plugin's volume-mounts answer for IMEX channels: /dev/null at <this>/<n>.
IMEX_VOLUME_MOUNT_DIR = VOLUME_MOUNT_DIR + "/imex"
PRIVILEGED_CAPABILITY = "CAP_SYS_ADMIN"
MAX_VALUE_LENGTH = 64 << 10
MAX_DEVICE_IDS = 1024

ACCEPTED_DEVICES = "all, none, void, GPU indices, GPU-<uuid>, PCI bus ids, MIG-<uuid>, <gpu index>:<mig index>"
_HEX = frozenset("0123456789abcdefABCDEF")
_DIGITS = frozenset("0123456789")


def _digits(text: str, most: int) -> bool:
    return 0 < len(text) <= most and _DIGITS.issuperset(text)


def device_index(text: str) -> int | None:
    """A decimal index as libnvidia-container reads one (strtoumax: an optional '+', leading
    zeros allowed), or None."""
    digits = text[1:] if text.startswith("+") else text
    return int(digits) if _digits(digits, 19) else None


def _uuid_like(text: str) -> bool:
    return 0 < len(text) <= 64 and _HEX.union("-").issuperset(text)


def _bus_id(text: str) -> bool:
    """[domain:]bus:device.function with or without leading zeros in each field: 0000:3b:00.0,
    0:3b:0.0, 3b:00.0 (1 to 8 hex digits of domain, 1 or 2 of bus and device)."""
    parts = text.split(":")
    if len(parts) == 3:
        domain = parts.pop(0)
        if not (1 <= len(domain) <= 8 and _HEX.issuperset(domain)):
            return False
    if len(parts) != 2 or not (1 <= len(parts[0]) <= 2) or not _HEX.issuperset(parts[0]):
        return False
    device, dot, function = parts[1].partition(".")
    return 1 <= len(device) <= 2 and _HEX.issuperset(device) and dot == "." and function in tuple("01234567")


def valid_device_id(device_id: str) -> bool:
    """Syntax of one NVIDIA_VISIBLE_DEVICES id (string checks, not re: this is the start path)."""
    prefix = device_id[:8].upper()  # UUID prefixes match without regard to case, as NVIDIA's do
    if prefix == "MIG-GPU-":  # pre-R470 MIG naming: MIG-GPU-<uuid>/<gi>/<ci>
        parts = device_id[8:].split("/")
        return len(parts) == 3 and _uuid_like(parts[0]) and _digits(parts[1], 2) and _digits(parts[2], 2)
    if prefix.startswith(("GPU-", "MIG-")):
        return _uuid_like(device_id[4:])
    if device_index(device_id) is not None:
        return True
    gpu, colon, mig = device_id.partition(":")
    if colon and device_index(gpu) is not None and device_index(mig) is not None:
        return True
    return _bus_id(device_id)


ALL = "all"


class GpuRequest(Frozen):
    __slots__ = (
        "devices",
        "source",
        "capabilities",
        "requirements",
        "disable_require",
        "privileged",
        "mig_config",
        "mig_monitor",
        "mps_pipe_directory",
        "notes",
        "origins",
        "imex_channels",
    )
    _defaults = {"notes": (), "origins": (), "imex_channels": ()}
    devices: tuple[str, ...]  # ("all",), () for none, or device ids in the order given
    # where the device list came from: env, volume-mounts, cdi-annotation, legacy-image,
    # RUNTIME_CDI (the runtime applied the devices: plan.decide), or CDI_SPEC (`cdi generate`)
    source: str
    capabilities: frozenset[str]
    requirements: Requirements
    disable_require: bool
    privileged: bool
    mig_config: bool
    mig_monitor: bool
    mps_pipe_directory: str | None  # host directory to share, None when the image's choice is not allowed
    notes: tuple[str, ...]  # what was ignored, for the log and the dry run
    origins: tuple[tuple[str, str], ...]  # (device id, what named it), for messages: see asked_by
    imex_channels: tuple  # IMEX channel numbers (ints), or ("all",): every channel the host has

    def asked_by(self, device_id: str) -> str:
        """What in the container named device_id, as a message starts with it: the variable and
        its value, the volume mount, or the annotation and its value."""
        for name, where in self.origins:
            if name == device_id:
                return where
        return self.source

    @property
    def all_devices(self) -> bool:
        # "all" ends the list; ids before it must still name devices (see read_device_list)
        return bool(self.devices) and self.devices[-1] == ALL

    def describe(self) -> str:
        devices = ", ".join(self.devices) or "none"
        # Requirement variable names are the image's (NVIDIA_REQUIRE_<anything>).
        imex = f"; IMEX channels: {', '.join(str(c) for c in self.imex_channels)}" if self.imex_channels else ""
        return printable(
            f"devices: {devices} (from {self.source}); capabilities: {', '.join(sorted(self.capabilities))}; "
            f"requirements: {'disabled' if self.disable_require else self.requirements.describe()}{imex}"
        )


def _bounded(name: str, value: str) -> str:
    if len(value) > MAX_VALUE_LENGTH:
        raise RequestError(f"{name}: the value is longer than {MAX_VALUE_LENGTH} characters")
    return value


def read_device_list(parts, name: str):
    """The device list that parts make, read in order as one list. parts: (value, where) for each
    place in the container that names devices (the variable, each volume mount, each annotation),
    where saying it as a message starts with it; name: all of them, for the limits.
    -> (None (not a GPU container), () (none), ("all",) or checked ids; origins: (id, where))."""
    _bounded(name, ",".join(value for value, _ in parts))
    entries = [(entry.strip(), where) for value, where in parts for entry in value.split(",")]
    entries = [(entry, where) for entry, where in entries if entry]  # empty entries are tolerated, as by NVIDIA
    if not entries or any(entry == NO_DEVICES for entry, _ in entries):
        return None, ()
    for position, (entry, where) in enumerate(entries):
        if entry.lower() == ALL:
            # As libnvidia-container reads the list: in order, and "all" (any case) ends it. The
            # ids before it must still name devices; those after it are not read.
            entries = entries[:position] + [(ALL, where)]
            break
    ids = [(entry, where) for entry, where in entries if entry not in ("none", ALL)]
    if len(ids) > MAX_DEVICE_IDS:
        raise RequestError(f"{name}: {len(ids)} device ids; at most {MAX_DEVICE_IDS} are accepted")
    origins = {}
    for device_id, where in ids:
        if not valid_device_id(device_id):
            shown = device_id if len(device_id) <= 80 else device_id[:80] + "..."
            raise RequestError(f"{where}: {shown}: unknown device (accepted: {ACCEPTED_DEVICES})")
        origins.setdefault(device_id, where)  # duplicates collapse, order kept
    devices = tuple(origins) + ((ALL,) if entries[-1][0] == ALL else ())
    return devices, tuple(origins.items())


def _short(value: str) -> str:
    return value if len(value) <= 120 else value[:120] + "..."


def _volume_mount_devices(spec: Spec) -> tuple[tuple[str, str], ...]:
    named = ((m.source, volume_mount_device(m.destination)) for m in spec.mounts)
    return tuple((name, f"volume mount {VOLUME_MOUNT_DIR}/{_short(name)}") for source, name in named
                 if source == "/dev/null" and name)  # fmt: skip


def _cdi_annotation_devices(spec: Spec, kind: str) -> tuple[tuple[str, str], ...]:
    names = []
    for key in sorted(spec.annotations):
        if key.startswith(CDI_ANNOTATION_PREFIX):
            value = _bounded(key, spec.annotations[key])
            for device in value.split(","):
                device_kind, sep, name = device.strip().partition("=")
                if sep and device_kind == kind and name:
                    names.append((name, f"annotation {_short(key)}={_short(value)}"))
    return tuple(names)


RUNTIME_CDI = "cdi-runtime"
CDI_SPEC = "cdi"  # a request `cdi generate` makes for the spec's edits, never a container's


def cdi_request(devices, source: str, capabilities, settings: Settings, privileged: bool = False,
                mps_pipe_directory: str | None = None, origins=()) -> GpuRequest:  # fmt: skip
    """The request of devices a CDI spec gives, the one constructor for both ends of a spec:
    `cdi generate` (CDI_SPEC: the edits for the capabilities it is generated with) and the start
    of a container whose devices the runtime applied from it (RUNTIME_CDI). Its devices and
    capabilities alone (those settings do not support left out): a spec is for any image, so no
    requirement is checked, and it carries no MIG config or monitor node and no IMEX channel."""
    return GpuRequest(
        devices=tuple(devices),
        source=source,
        capabilities=frozenset(capabilities) & frozenset(settings.supported_capabilities),
        requirements=parse_requirements({}),
        disable_require=True,
        privileged=privileged,
        mig_config=False,
        mig_monitor=False,
        mps_pipe_directory=mps_pipe_directory,
        origins=tuple(origins),
    )


def runtime_cdi_devices(spec: Spec):
    """(device list or None, origins, RUNTIME_CDI): the devices of the spec `cdi generate` wrote
    that the runtime applied, each named by its OCI_GPU_HOOK_CDI_DEVICE_<name>=<id> variable. The
    variables are the pod's to forge too: plan.decide trusts them only where config.json's
    linux.devices, which the runtime alone writes, holds the devices' nodes."""
    parts = tuple((value, f"{key}={_short(value)}") for key, value in sorted(spec.env.items())
                  if key.startswith(CDI_DEVICE_ENV_PREFIX))  # fmt: skip
    if not parts:
        return None, (), RUNTIME_CDI
    return (*read_device_list(parts, f"{CDI_DEVICE_ENV_PREFIX}* variables"), RUNTIME_CDI)


def _runtime_cdi_request(devices, origins, privileged: bool, settings: Settings) -> GpuRequest:
    """The request for a container whose devices the runtime applied: its devices alone. The
    hook gives it nothing, so nothing else the image asks for (capabilities, requirements, MIG
    flags, IMEX, MPS) is read: none of it can fail a start the runtime has configured."""
    return cdi_request(devices, RUNTIME_CDI, {"utility"}, settings, privileged, origins=origins)


def select_devices(spec: Spec, settings: Settings, privileged: bool, legacy: bool):
    """(device list or None, origins: what named each id, the list's source)."""
    if settings.accept_volume_mounts:
        parts = _volume_mount_devices(spec)
        if parts:
            return (*read_device_list(parts, f"volume mounts under {VOLUME_MOUNT_DIR}"), "volume-mounts")
    if not (privileged or settings.accept_envvar_when_unprivileged):
        # The admin allows only the device plugin's mounts to pick GPUs for unprivileged
        # containers; the image's own env and the pod's annotations are ignored.
        return None, (), "env"
    if settings.accept_cdi_annotations:
        parts = _cdi_annotation_devices(spec, settings.cdi_kind)
        if parts:
            return (*read_device_list(parts, f"{CDI_ANNOTATION_PREFIX}* annotations"), "cdi-annotation")
    value = spec.env.get(VISIBLE_DEVICES)
    if value is None:
        return ((ALL,), (), "legacy-image") if legacy else (None, (), "env")
    return (*read_device_list(((value, f"{VISIBLE_DEVICES}={_short(value)}"),), VISIBLE_DEVICES), "env")


def parse_capabilities(value: str | None, supported: tuple[str, ...], legacy: bool) -> frozenset[str]:
    if value is None and legacy:
        asked = driver.parse_capabilities("all")
    elif not value or not value.strip():
        asked = driver.parse_capabilities(",".join(driver.DEFAULT_CAPABILITIES))
    else:
        _bounded(DRIVER_CAPABILITIES, value)
        try:
            asked = driver.parse_capabilities(value)
        except driver.UnknownCapability as e:
            raise RequestError(
                f"{DRIVER_CAPABILITIES}={_short(value)}: unknown capability {e.args[0][:40]!r} "
                f"(accepted: {', '.join(driver.CAPABILITIES)}, all)"
            ) from None
    return frozenset(asked & set(supported))


def _mig_flag(spec: Spec, name: str, privileged: bool) -> bool:
    value = spec.env.get(name)
    if not value:
        return False
    if not privileged:
        raise RequestError(f"{name}={_short(value)}: only privileged containers (CAP_SYS_ADMIN) may ask for it")
    if value != ALL:
        raise RequestError(f"{name}={_short(value)}: unsupported value (accepted: all)")
    return True


def _mps_pipe_directory(spec: Spec, settings: Settings):
    """(host directory or None, note). The image would choose a host directory to mount, so
    only directories the admin listed are shared; another choice is ignored, not fatal, because
    images also set the variable for their own MPS daemon."""
    value = spec.env.get("CUDA_MPS_PIPE_DIRECTORY") or driver.MPS_PIPE_DIRECTORY
    path = os.path.normpath(value) if value.startswith("/") else ""
    if path in settings.mps_pipe_directories:
        return path, None
    if path and any(os.path.normpath(m.destination) == path for m in spec.mounts):
        # Mounted there by the runtime already (the device plugin's MPS answer): nothing to do.
        return None, None
    # A note is no HookError: it is shown (plan, log, syslog) as built, so it escapes itself.
    return None, printable(
        f"CUDA_MPS_PIPE_DIRECTORY={_short(value)} ignored: not in mps_pipe_directories "
        f"({', '.join(settings.mps_pipe_directories)})"
    )


def _imex_channels(spec: Spec, settings: Settings, privileged: bool) -> tuple:
    """The IMEX channels asked for, by the same rules as the GPUs: the device plugin's mounts
    (/var/run/nvidia-container-devices/imex/<n>) where accepted, else NVIDIA_IMEX_CHANNELS where
    the image's env may choose (privileged, or accept_envvar_when_unprivileged). Channel numbers,
    or all (every channel the host has; NVIDIA's hook gives none for all), or none/void."""
    where, value = None, None
    if settings.accept_volume_mounts:
        named = [name_under(m.destination, IMEX_VOLUME_MOUNT_DIR) for m in spec.mounts if m.source == "/dev/null"]
        named = [n for n in named if n]
        if named:
            where, value = f"volume mounts under {IMEX_VOLUME_MOUNT_DIR}", ",".join(named)
    if value is None and (privileged or settings.accept_envvar_when_unprivileged):
        value = spec.env.get(IMEX_CHANNELS)
        where = f"{IMEX_CHANNELS}={_short(value or '')}"
    if not value:
        return ()
    _bounded(IMEX_CHANNELS, value)
    channels = []
    for entry in (e.strip() for e in value.split(",")):
        if entry.lower() == ALL:
            return (ALL,)
        if entry in ("", "none", NO_DEVICES):
            continue
        if not _digits(entry, 4) or int(entry) > driver.IMEX_MAX_CHANNEL:
            raise RequestError(f"{where}: {_short(entry)[:40]}: not an IMEX channel (accepted: all, none, "
                               f"channel numbers 0 to {driver.IMEX_MAX_CHANNEL})")  # fmt: skip
        channels.append(int(entry))
    return tuple(dict.fromkeys(channels))


def parse_request(spec: Spec, settings: Settings) -> GpuRequest | None:
    env = spec.env
    privileged = PRIVILEGED_CAPABILITY in spec.bounding_capabilities
    # Images built before NVIDIA_REQUIRE_CUDA existed carry only CUDA_VERSION.
    legacy = LEGACY_VARIABLE in env and not env.get("NVIDIA_REQUIRE_CUDA")
    devices, origins, source = select_devices(spec, settings, privileged, legacy)
    if devices is None:
        # Not a container the hook configures; maybe one whose devices the runtime applied.
        devices, origins, _ = runtime_cdi_devices(spec)
        return None if devices is None else _runtime_cdi_request(devices, origins, privileged, settings)
    requirements = parse_requirements(env)
    if legacy and env[LEGACY_VARIABLE]:
        requirements = parse_requirements(
            {
                "NVIDIA_REQUIRE_CUDA": legacy_cuda_requirement(env[LEGACY_VARIABLE]),
                **{k: v for k, v in env.items() if k != "NVIDIA_REQUIRE_CUDA"},
            }
        )
    mps_directory, mps_note = _mps_pipe_directory(spec, settings)
    return GpuRequest(
        devices=devices,
        source=source,
        capabilities=parse_capabilities(env.get(DRIVER_CAPABILITIES), settings.supported_capabilities, legacy),
        requirements=requirements,
        disable_require=settings.disable_require or parse_bool(env.get("NVIDIA_DISABLE_REQUIRE", "")),
        privileged=privileged,
        mig_config=_mig_flag(spec, MIG_CONFIG_DEVICES, privileged),
        mig_monitor=_mig_flag(spec, MIG_MONITOR_DEVICES, privileged),
        mps_pipe_directory=mps_directory,
        notes=(mps_note,) if mps_note else (),
        origins=origins,
        imex_channels=_imex_channels(spec, settings, privileged),
    )
