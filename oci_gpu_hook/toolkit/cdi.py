"""CDI (Container Device Interface) specs from the hook's own inventory and policy.

`oci-gpu-hook cdi generate` writes a spec that podman, CRI-O, containerd and Docker can apply
without our prestart hook. The edits are not a second copy of the rules: for each device the plan
(plan.build_plan) is built exactly as the hook would build it for a container asking for that
device, and its operations are translated:

- MountDevice -> deviceNodes (path, hostPath, type, major, minor); the runtime also derives the
  device cgroup rule from it, so DeviceRule operations need no translation;
- BindMount -> mounts with the plan's flags plus "bind" (optional sources, the IPC sockets and
  the MPS directory, only when they exist now: a CDI mount of a missing source fails the start);
- Symlink and RefreshLdcache -> one createContainer hook that runs `oci-gpu-hook ldcache-refresh`
  with the links and library directories, with an explicit environment;
- the /proc/driver/nvidia masking (tmpfs, sanitised copies) has no CDI form and is left out
  (NVIDIA's own CDI specs mount a copy of its params alone, through a hook program of theirs:
  docs/performance.md); so is the graphics application profile (a tmpfs and a file whose
  mask depends on the container's whole device set, which a per-device spec cannot know).

The plans are built with for_cdi: NVIDIA's CDI specs carry the libnvidia-ml.so and GBM backend
links, which its hook does not add.

Operations every device shares (control nodes, driver files, the hook) go to the spec's top-level
containerEdits; each device carries only its own nodes, and one variable that names it,
OCI_GPU_HOOK_CDI_DEVICE_<name>=<id>: the prestart hook, which the runtime runs too, reads them to
record the container for the node services (its limits, its pod), and gives it nothing.
"""

from __future__ import annotations

import json
import os

from oci_gpu_hook.errors import Exit, HookError, UsageError
from oci_gpu_hook.start import driver, files, ldcache_refresh, settings
from oci_gpu_hook.toolkit import install

SCHEMA_PATH = os.path.join(settings.SCHEMAS_DIR, "cdi.schema.json")
SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
DEFAULT_KIND = "nvidia.com/gpu"
DEFAULT_CAPABILITIES = ("utility", "compute")
HOOK_TIMEOUT = 20
# The spec's devices arrive with the runtime's CDI support; NVIDIA_VISIBLE_DEVICES=void keeps a
# prestart hook (ours through hooks.d, or NVIDIA's) from configuring the same container again.
SPEC_ENV = ["NVIDIA_VISIBLE_DEVICES=void"]
HOOK_SUBCOMMAND = ldcache_refresh.COMMAND


class CdiError(HookError):
    exit_code = Exit.CDI


# --- cdiVersion ---------------------------------------------------------------------------------


def _edits(spec: dict):
    yield spec.get("containerEdits") or {}
    for device in spec.get("devices", ()):
        yield device.get("containerEdits") or {}


def required_version(spec: dict) -> str:
    """The lowest cdiVersion that accepts every field the spec uses (the CDI version rules)."""
    edits = list(_edits(spec))
    kind_class = spec.get("kind", "").partition("/")[2]
    if any(e.get("additionalGids") or e.get("additionalGIDs") or e.get("intelRdt") for e in edits):
        return "0.7.0"
    if spec.get("annotations") or any(d.get("annotations") for d in spec.get("devices", ())) or "." in kind_class:
        return "0.6.0"
    names = [d.get("name", "") for d in spec.get("devices", ())]
    if any(name and not name[0].isalpha() for name in names):
        return "0.5.0"  # device names starting with a digit
    if any(node.get("hostPath") for e in edits for node in e.get("deviceNodes", ())):
        return "0.5.0"
    if any(mount.get("type") for e in edits for mount in e.get("mounts", ())):
        return "0.4.0"
    return "0.3.0"


# --- schema -------------------------------------------------------------------------------------


def load_schema() -> dict:
    with open(SCHEMA_PATH) as f:
        return json.load(f)


def validate(spec: dict) -> None:
    """Check against the shipped CDI schema; CdiError naming the first problem."""
    import jsonschema

    validator = jsonschema.Draft7Validator(load_schema())
    errors = sorted(validator.iter_errors(spec), key=lambda e: list(e.absolute_path))
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "(top level)"
        raise CdiError(f"the CDI spec does not validate: {where}: {errors[0].message}")
    need = required_version(spec)
    if _version_key(spec["cdiVersion"]) < _version_key(need):
        raise CdiError(f"the CDI spec says cdiVersion {spec['cdiVersion']} but its fields need {need}")


def _version_key(version: str) -> tuple:
    return tuple(int(p) for p in version.split("-", 1)[0].split("."))


# --- building -----------------------------------------------------------------------------------


def parse_kind(kind: str) -> str:
    vendor, sep, cls = kind.partition("/")
    ok_vendor = vendor and all(c.isalnum() or c in "-_." for c in vendor) and "." in vendor
    ok_class = cls and all(c.isalnum() or c in "-_." for c in cls) and cls[0].isalnum()
    if not (sep and ok_vendor and ok_class):
        raise UsageError(f"--vendor-class {kind!r}: expected VENDOR/CLASS, e.g. nvidia.com/gpu")
    return kind


def parse_capabilities(value: str) -> frozenset:
    try:
        caps = driver.parse_capabilities(value)
    except driver.UnknownCapability as e:
        accepted = ", ".join(driver.CAPABILITIES)
        raise UsageError(f"--capabilities: unknown capability {e.args[0]!r} (accepted: {accepted}, all)") from None
    if not caps:
        raise UsageError("--capabilities: at least one capability is needed")
    return caps


def _request(devices, capabilities, settings):
    from oci_gpu_hook.start.request import CDI_SPEC, cdi_request

    mps = driver.MPS_PIPE_DIRECTORY if driver.MPS_PIPE_DIRECTORY in settings.mps_pipe_directories else None
    return cdi_request(devices, CDI_SPEC, capabilities, settings, mps_pipe_directory=mps)


def _device_names(inventory):
    """(CDI device name, NVIDIA_VISIBLE_DEVICES id) for every GPU and MIG device."""
    names = []
    for gpu in inventory.gpus:
        names.append((str(gpu.index), str(gpu.index)))
        names.append((gpu.uuid, gpu.uuid))
        for mig in gpu.mig:
            names.append((f"{gpu.index}:{mig.index}", f"{gpu.index}:{mig.index}"))
            if mig.uuid:
                names.append((mig.uuid, mig.uuid))
    return names


def device_env(name: str, device_id: str) -> str:
    """The variable a device of the spec sets: one name per device, so that a container given
    several has them all (the runtime merges the devices' edits, and a variable of the same name
    would keep one value)."""
    from oci_gpu_hook.start.prefilter_rule import CDI_DEVICE_ENV_PREFIX

    return f"{CDI_DEVICE_ENV_PREFIX}{''.join(c if c.isalnum() else '_' for c in name)}={device_id}"


def _node(op) -> dict:
    return {"path": op.target, "hostPath": op.source, "type": "c", "major": op.major, "minor": op.minor}


def _is_proc_driver(op) -> bool:
    from oci_gpu_hook.start.plan import in_proc_driver

    return in_proc_driver(getattr(op, "target", "") or "")


def translate(plan, hook_prefix) -> dict:
    """containerEdits for a plan's operations (see the module docstring for the mapping)."""
    from oci_gpu_hook.start.plan import BindMount, MountDevice, RefreshLdcache, Symlink

    nodes, mounts, links, dirs = [], [], [], []
    for op in plan.operations:
        if _is_proc_driver(op):
            continue
        if isinstance(op, MountDevice):
            nodes.append(_node(op))
        elif isinstance(op, BindMount):
            if op.optional and not os.path.exists(op.source):
                continue
            mounts.append({"hostPath": op.source, "containerPath": op.target,
                           "options": list(op.flags) + ["bind"]})  # fmt: skip
        elif isinstance(op, Symlink):
            links.append(f"{op.target}={op.value}")
        elif isinstance(op, RefreshLdcache):
            dirs.extend(op.directories)
    edits = {}
    if nodes:
        edits["deviceNodes"] = nodes
    if mounts:
        edits["mounts"] = mounts
    if links or dirs:
        args = install.hook_args(hook_prefix, HOOK_SUBCOMMAND)
        for link in links:
            args += ["--link", link]
        for directory in dirs:
            args += ["--dir", directory]
        edits["hooks"] = [{"hookName": "createContainer", "path": hook_prefix[0], "args": args,
                           "env": list(install.HOOK_ENV), "timeout": HOOK_TIMEOUT}]  # fmt: skip
    return edits


def build_spec(inventory, settings, kind: str = DEFAULT_KIND, capabilities=DEFAULT_CAPABILITIES) -> dict:
    """The CDI spec (a dict) for every GPU and MIG device of the inventory, plus `all`."""
    from oci_gpu_hook.start.plan import LibraryLayout, MountDevice, decide_for

    if not inventory.gpus:
        raise CdiError("the host has no GPUs: there is nothing to put in a CDI spec")
    layout = LibraryLayout.for_rootfs(False)
    hook_prefix = install.installed_command()  # ldcache-refresh reads no configuration
    # The hook's decision (start/plan.decide_for) for a container asking for these devices.
    common = decide_for(_request((), capabilities, settings), inventory, layout, settings, for_cdi=True)
    shared_targets = {op.target for op in common.operations if isinstance(op, MountDevice)}
    edits = translate(common, hook_prefix)
    edits["env"] = list(SPEC_ENV)

    def own_nodes(device_ids):
        plan = decide_for(_request(device_ids, capabilities, settings), inventory, layout, settings, for_cdi=True)
        return [_node(op) for op in plan.operations if isinstance(op, MountDevice) and op.target not in shared_targets]

    devices = [{"name": name, "containerEdits": {"deviceNodes": own_nodes([device_id]),
                                                 "env": [device_env(name, device_id)]}}
               for name, device_id in _device_names(inventory) + [("all", "all")]]  # fmt: skip
    spec = {"cdiVersion": "", "kind": kind, "devices": devices, "containerEdits": edits}
    spec["cdiVersion"] = required_version(spec)
    return spec


# --- output -------------------------------------------------------------------------------------


def dump(spec: dict, fmt: str) -> str:
    header = "# Generated by `oci-gpu-hook cdi generate`; regenerate it after a driver or GPU change.\n"
    if fmt == "json":
        return json.dumps(spec, indent=2) + "\n"
    import yaml

    return header + yaml.safe_dump(spec, sort_keys=False, default_flow_style=False)


def format_for(output: str | None, fmt: str | None) -> str:
    if fmt:
        return fmt
    return "json" if output and output.endswith(".json") else "yaml"


def write_atomically(path: str, text: str, parents: bool = False) -> None:
    """Write the spec; a missing directory is an error unless parents (--parents) says to make it."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    if not parents and not os.path.isdir(directory):
        raise CdiError(f"{directory}: no such directory (--parents makes it)")
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        files.write_atomically(path, text.encode())
    except OSError as e:
        raise CdiError(f"{path}: cannot write: {e.strerror}") from None


def _spec_kind(path: str):
    try:
        text = files.read_bounded(path, 16 << 20).decode("utf-8", "replace")
    except OSError:
        return None
    try:
        if path.endswith(".json"):
            doc = json.loads(text)
        else:
            from oci_gpu_hook.start.settings import load_yaml

            doc = load_yaml(text)
    except Exception:  # noqa: BLE001 - someone else's broken file is only a reason not to warn
        return None
    return doc.get("kind") if isinstance(doc, dict) else None


def other_specs_with_kind(kind: str, output: str | None, dirs=SPEC_DIRS) -> list:
    """Spec files in the CDI directories, other than output, that define kind too."""
    found = []
    skip = os.path.realpath(output) if output else None
    for directory in dirs:
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            if not name.endswith((".yaml", ".yml", ".json")) or os.path.realpath(path) == skip:
                continue
            if _spec_kind(path) == kind:
                found.append(path)
    return found
