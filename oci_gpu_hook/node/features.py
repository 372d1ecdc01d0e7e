"""`oci-gpu-hook labels`: the node's GPU labels as a feature file for NFD's local source, under
the label names of NVIDIA's GPU feature discovery (nvidia.com/gpu.product, ...), from the same
inventory the hook uses. Pure but for write() and watch().

The labels describe the resources the device plugin offers (plugin/resources.py, from the same
configuration), as GFD builds its resource labels from the device plugin's resource manager: one
rule decides what the node offers, and a configuration the plugin refuses here is refused here
too, in the same words. nvidia.com/gpu.* describe the GPUs (every one counted; without sharing
where every GPU has MIG on); under `single` the MIG devices the plugin offers as nvidia.com/gpu
are then described as if they were the GPUs (GFD writes -MIG-INVALID labels where the plugin
refuses); under `mixed` each nvidia.com/mig-<profile> resource gets its nvidia.com/mig-<profile>.*
labels. Every value is GFD's wherever GFD writes the label (docs/monitoring.md lists them, and
where we differ).
"""

from __future__ import annotations

import os
import re
import time

from oci_gpu_hook.errors import HookError
from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.start.digits import decimal

PREFIX = "nvidia.com/"
# GFD's family names, by compute capability major (and minor where it splits a major).
_FAMILIES = {3: "kepler", 5: "maxwell", 6: "pascal", 7: "volta", 8: "ampere", 9: "hopper", 10: "blackwell",
             12: "blackwell"}  # fmt: skip
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_PROFILE = re.compile(r"^([0-9]+)g\.([0-9]+)gb$")


class LabelError(HookError):
    """A label Kubernetes would refuse, or a feature file that cannot be written."""


def family(compute_capability: str | None) -> str | None:
    if not compute_capability:
        return None
    major, _, minor = compute_capability.partition(".")
    if major == "7" and minor == "5":
        return "turing"
    if major == "8" and minor == "9":
        return "ada-lovelace"
    number = decimal(major)
    return None if number is None else _FAMILIES.get(number)


def mig_capable(gpu) -> bool:
    """MIG-capable parts: A100/A30 (8.0), Hopper (9.x) and Blackwell (10.x) data-centre GPUs; a
    GPU with MIG devices is capable whatever it reports."""
    return (
        bool(gpu.mig)
        or gpu.compute_capability in ("8.0",)
        or (gpu.compute_capability or "").split(".")[0]
        in (
            "9",
            "10",
        )
    )


# GFD's gpu.mode, by the PCI class of every GPU, where all have one: a 3D controller computes,
# a VGA controller also drives displays; GPUs of two classes, or one GFD cannot read, make it
# unknown (gpu_mode).
_MODES = {"0x030200": "compute", "0x030000": "graphics"}
_NOT_IN_VALUE = re.compile(r"[^-A-Za-z0-9_.]")
_NOT_IN_PRODUCT = re.compile(r"[^-A-Za-z0-9_. ]")


def product(model: str) -> str:
    """The model as GFD writes it in a label: characters a label cannot hold left out, spaces
    made dashes."""
    return "-".join(_NOT_IN_PRODUCT.sub("", model).split())


class HostFacts(Frozen):
    """What the labels read beside the inventory: DMI's product name, each GPU's PCI class and
    the vGPU labels, from sysfs (node.sys_root)."""

    __slots__ = ("machine", "pci_classes", "vgpu")
    _defaults = {"vgpu": {}}
    machine: str  # GFD's gpu.machine value
    pci_classes: dict  # bus id -> "0x030200", or None where GFD cannot read the GPU (pci_class)
    # {label name: value} where every GPU's configuration space was read whole: in a vGPU guest
    # vgpu_labels', else vgpu.present false; {} where one was not (GFD then fails)
    vgpu: dict


# A PCI configuration space: the status register's "capabilities list" bit, the list's first
# pointer, and the vendor-specific capability's id (PCI Local Bus Specification 3.0, 6.7).
_PCI_STATUS, _PCI_HAS_CAPABILITIES, _PCI_CAPABILITIES, _PCI_VENDOR_SPECIFIC = 0x06, 0x10, 0x34, 0x09
_NVIDIA_VENDOR = "0x10de"
# NVIDIA's vGPU signature in that capability ("VF" at bytes 3 and 4), its records from byte 5,
# and the host driver record's two 10-byte strings (as GFD reads them).
_VGPU_SIGNATURE, _VGPU_RECORDS, _VGPU_STRING = b"VF", 5, 10


def vendor_capability(config: bytes) -> bytes | None:
    """The vendor-specific capability of a PCI configuration space, or None. A space read short
    (without CAP_SYS_ADMIN, sysfs gives the first 64 bytes) has none to find."""
    if len(config) < 256 or not config[_PCI_STATUS] & _PCI_HAS_CAPABILITIES:
        return None
    seen, position = set(), config[_PCI_CAPABILITIES]
    while position and position not in seen and position + 2 < len(config) and config[position] != 0xFF:
        seen.add(position)
        if config[position] == _PCI_VENDOR_SPECIFIC:
            return config[position : position + config[position + 2]]
        position = config[position + 1]
    return None


def vgpu_labels(capability: bytes | None) -> dict:
    """GFD's vgpu.* labels from a GPU's vendor-specific capability: vgpu.present where it carries
    NVIDIA's vGPU signature (a vGPU guest), and the host's driver version and branch from its
    host driver record (record id 0)."""
    if capability is None or capability[3:5] != _VGPU_SIGNATURE:
        return {}
    labels = {"vgpu.present": "true"}
    position = _VGPU_RECORDS
    while position + 1 < len(capability) and capability[position] != 0 and capability[position + 1]:
        position += capability[position + 1]
    end = position + 2 + 2 * _VGPU_STRING
    if position < len(capability) and capability[position] == 0 and end <= len(capability):
        version = capability[position + 2 : position + 2 + _VGPU_STRING]
        branch = capability[position + 2 + _VGPU_STRING : end]
        # Bytes from the hypervisor: what a label cannot hold is left out, so they never fail the file.
        for name, text in (("vgpu.host-driver-version", version), ("vgpu.host-driver-branch", branch)):
            labels[name] = _NOT_IN_VALUE.sub("", text.strip(b"\0").decode("ascii", "replace"))[:63].strip("-_.")
    return labels


def _hex(text: str | None) -> int | None:
    """A sysfs attribute in the kernel's 0x-prefixed hexadecimal (vendor, device, class)."""
    if text is None or not text.startswith("0x") or not 2 < len(text) <= 18:
        return None
    return int(text, 16) if all(c in "0123456789abcdefABCDEF" for c in text[2:]) else None


def pci_class(read, bus_id: str) -> str | None:
    """A GPU's PCI class as GFD reads it for gpu.mode, "0x030200", or None. GFD reads it with
    go-nvlib's nvpci, which takes the GPU from sysfs whole: its vendor (NVIDIA's), class and
    device (hexadecimal), NUMA node (decimal, -1 without NUMA) and resource list (three fields a
    line); where one is missing or malformed GFD labels the mode unknown, and so does this.
    read(path): the attribute's text, stripped, or None."""
    device = f"/sys/bus/pci/devices/{bus_id}"
    vendor, number, device_id = (_hex(read(f"{device}/{name}")) for name in ("vendor", "class", "device"))
    numa_node, resource = read(f"{device}/numa_node"), read(f"{device}/resource")
    if vendor != int(_NVIDIA_VENDOR, 16) or number is None or device_id is None or numa_node is None:
        return None
    if decimal(numa_node[1:] if numa_node.startswith("-") else numa_node) is None or resource is None:
        return None
    if any(len(line.split(" ")) != 3 for line in resource.split("\n")):
        return None
    return f"0x{number:06x}"


def gpu_mode(gpus, pci_classes: dict) -> str:
    """GFD's gpu.mode: the mode of the GPUs' one PCI class, unknown where they have several or
    one could not be read."""
    classes = {pci_classes.get(gpu.bus_id) for gpu in gpus}
    return _MODES.get(classes.pop() or "", "unknown") if len(classes) == 1 else "unknown"


def machine_label(product_name: str | None) -> str:
    """gpu.machine as GFD writes it (spaces made dashes; unknown when DMI has no name). GFD leaves
    other characters in, and the label is then refused; here they are left out, so that the
    file stays valid (a product name with , or / is rare)."""
    if not product_name or not product_name.strip():
        return "unknown"
    value = _NOT_IN_VALUE.sub("", "-".join(product_name.strip().split(" ")))[:63].strip("-_.")
    return value or "unknown"


def host_facts(sys_root: str, inventory) -> HostFacts:
    from oci_gpu_hook.start.inventory import host_path

    def read(path):
        try:
            with open(host_path(sys_root, path), errors="replace") as f:
                return f.read(4096).strip()
        except OSError:
            return None

    def config(bus_id):
        try:
            with open(host_path(sys_root, f"/sys/bus/pci/devices/{bus_id}/config"), "rb") as f:
                return f.read(4096)
        except OSError:
            return b""

    # GFD looks at every NVIDIA function: one whose vendor it cannot read, or whose space it
    # reads short, fails its vGPU labels (none written here); none with NVIDIA's vGPU signature
    # is vgpu.present=false.
    vgpu: dict = {}
    whole = bool(inventory.gpus)
    for gpu in inventory.gpus:
        vendor = read(f"/sys/bus/pci/devices/{gpu.bus_id}/vendor")
        if vendor == _NVIDIA_VENDOR:
            space = config(gpu.bus_id)
            whole = whole and len(space) >= 256
            vgpu.update(vgpu_labels(vendor_capability(space)))
        else:
            whole = whole and vendor is not None
    if not whole:
        vgpu = {}
    elif not vgpu:
        vgpu = {"vgpu.present": "false"}
    return HostFacts(
        machine=machine_label(read("/sys/class/dmi/id/product_name")),
        pci_classes={g.bus_id: pci_class(read, g.bus_id) for g in inventory.gpus},
        vgpu=vgpu,
    )


def _resource_labels(key: str, parts, count: int, replicas: int, strategy: str) -> dict:
    """GFD's base labels of one resource: product (-SHARED when shared), count, replicas and
    sharing-strategy (none, time-slicing or mps)."""
    return {
        f"{key}.product": "-".join(parts) + ("-SHARED" if replicas > 1 else ""),
        f"{key}.count": count,
        f"{key}.replicas": replicas,
        f"{key}.sharing-strategy": strategy,
    }


def _gpu_labels(gpus, offered) -> dict:
    """gpu.* of the whole GPUs, as GFD writes them whatever the MIG strategy: every GPU counted,
    shared as the plugin's nvidia.com/gpu (offered, None where it offers none); where every GPU
    has MIG on, without sharing (replicas 0), as no whole GPU is offered."""
    first = gpus[0]
    replicas, strategy = (1, "none") if offered is None else (offered.replicas, offered.sharing_strategy)
    if all(g.mig for g in gpus):
        replicas, strategy = 0, "none"
    labels = _resource_labels("gpu", [product(first.model)], len(gpus), replicas, strategy)
    if first.memory_total:
        labels["gpu.memory"] = first.memory_total >> 20
    if first.compute_capability:
        major, _, minor = first.compute_capability.partition(".")
        labels["gpu.family"] = family(first.compute_capability) or "undefined"
        labels["gpu.compute.major"], labels["gpu.compute.minor"] = major, minor
    return labels


def _mig_labels(key: str, offered) -> dict:
    """The labels of a resource of MIG devices of one profile (key: gpu under single,
    mig-<profile> under mixed): GFD's base labels, then the MIG device's attributes."""
    units = offered.units
    devices = [u.mig for u in units]
    profile = devices[0].profile.replace("+", ".")
    labels = _resource_labels(key, [product(units[0].gpu.model), "MIG", profile], len(devices), offered.replicas,
                              offered.sharing_strategy)  # fmt: skip
    if devices[0].memory_total:
        labels[f"{key}.memory"] = devices[0].memory_total >> 20
    match = _PROFILE.match(devices[0].profile)
    if match:  # a MIG device here is a GPU instance with one compute instance over all of it
        labels[f"{key}.slices.gi"] = labels[f"{key}.slices.ci"] = int(match.group(1))
    for name, value in sorted((getattr(devices[0], "attributes", None) or {}).items()):
        labels[f"{key}.{name}"] = value
    return labels


def compute(inventory, config, host: HostFacts | None = None, where: str = "device plugin configuration") -> dict:
    """{label: value} (names with the nvidia.com/ prefix), checked against Kubernetes' syntax, of
    the resources the device plugin offers under config (plugin/config.py's PluginConfig); the
    plugin's ConfigError where it would refuse config on this node. host: the machine and PCI
    class labels. where: what config came from, for that error."""
    from oci_gpu_hook.node.plugin.config import GPU_RESOURCE, MIG_RESOURCE_PREFIX
    from oci_gpu_hook.node.plugin.resources import resources

    offered = {r.configured_name: r for r in resources(inventory, config, where)}
    gpus = list(inventory.gpus)
    labels = {}
    driver = inventory.driver_version.split(".")
    major, minor, rev = driver[0], driver[1] if len(driver) > 1 else "0", driver[2] if len(driver) > 2 else ""
    # The old names and GFD's newer ones, both, as GFD writes them.
    labels["cuda.driver.major"], labels["cuda.driver.minor"], labels["cuda.driver.rev"] = major, minor, rev
    labels["cuda.driver-version.major"], labels["cuda.driver-version.minor"] = major, minor
    labels["cuda.driver-version.revision"] = rev
    labels["cuda.driver-version.full"] = inventory.driver_version
    if inventory.cuda_version:
        cuda_major, _, cuda_minor = inventory.cuda_version.partition(".")
        cuda_minor = cuda_minor or "0"
        labels["cuda.runtime.major"], labels["cuda.runtime.minor"] = cuda_major, cuda_minor
        labels["cuda.runtime-version.major"], labels["cuda.runtime-version.minor"] = cuda_major, cuda_minor
        labels["cuda.runtime-version.full"] = f"{cuda_major}.{cuda_minor}"
    labels["mig.capable"] = "true" if any(mig_capable(g) for g in gpus) else "false"
    labels["mig.strategy"] = config.mig_strategy
    # MPS shares whole GPUs only: GFD fails to label a node with MPS and a GPU in MIG mode.
    labels["mps.capable"] = "true" if config.mps and not any(g.mig for g in gpus) else "false"
    if host is not None:
        labels.update(host.vgpu)
        labels["gpu.machine"] = host.machine
        if gpus:
            labels["gpu.mode"] = gpu_mode(gpus, host.pci_classes)
    gpu = offered.get(GPU_RESOURCE)
    if not gpus:
        labels["gpu.count"] = 0
    else:
        labels.update(_gpu_labels(gpus, gpu))
    if gpu is not None and gpu.units and gpu.units[0].mig is not None:  # single, with MIG on
        labels.update(_mig_labels("gpu", gpu))
    for name, resource in sorted(offered.items()):
        if name.startswith(MIG_RESOURCE_PREFIX):  # mixed: nvidia.com/mig-1g.10gb.me, as a label mig-1g.10gb.me
            labels.update(_mig_labels(name[len(PREFIX) :], resource))
    out = {PREFIX + key: str(value) for key, value in labels.items()}
    for key, value in out.items():
        check(key, value)
    return out


def check(key: str, value: str) -> None:
    """Kubernetes' label syntax: [prefix/]name, the prefix a DNS subdomain (<= 253), the name and
    the value (<= 63, the value may be empty) alphanumeric at both ends with -_. inside."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        raise LabelError(f"label {key!r}: the prefix is not a DNS subdomain")
    if not _NAME.match(name):
        raise LabelError(f"label {key!r}: not a valid label name")
    if value and not _NAME.match(value):
        raise LabelError(f"label {key}={value!r}: not a valid label value")


def render(labels: dict) -> str:
    return "".join(f"{key}={value}\n" for key, value in sorted(labels.items()))


def write(path: str, labels: dict) -> bool:
    """Write the feature file atomically when its text changes; True when it was written."""
    from oci_gpu_hook.start.files import write_atomically

    text = render(labels)
    try:
        with open(path) as f:
            if f.read() == text:
                return False
    except OSError:
        pass
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        # Only what --output or node.features_file names is written, never a directory of its own
        # making: NFD's features.d exists where NFD runs.
        from oci_gpu_hook.errors import HookError

        raise HookError(f"{directory}: no such directory (is NFD installed? --output or node.features_file names "
                        "the feature file)")  # fmt: skip
    write_atomically(path, text.encode(), 0o644)
    return True


def for_node(settings, inventory) -> dict:
    """The labels of what the device plugin offers on this node: its configuration
    (node.device_plugin_config, else node.mig_strategy and node.replicas, as the plugin reads it)
    is the one source of the MIG strategy and the replicas, for the plugin and the labels alike."""
    from oci_gpu_hook.node.plugin import config as plugin_config

    path = settings.node.device_plugin_config
    config = plugin_config.load(path, settings.node)
    return compute(inventory, config, host_facts(settings.node.sys_root, inventory), plugin_config.source(path))


def cached_inventory(settings):
    """The inventory as the node's other services last cached it (inventory_cache), taken as they
    left it: not checked against the host's fingerprint and never rebuilt here. For a labels
    process that sees neither the driver's files nor /dev nor NVML (the DaemonSet's labels pod):
    the services that do see them write the cache again as soon as the host changes. Read only
    when they (or this user) can have written it, as the hook reads its cache (read_trusted)."""
    from oci_gpu_hook.errors import InventoryError
    from oci_gpu_hook.start import inventory_cache, jsonio
    from oci_gpu_hook.start.inventory import Inventory
    from oci_gpu_hook.start.settings import read_trusted

    path = settings.inventory_cache
    try:
        doc = jsonio.loads(read_trusted(path, inventory_cache.MAX_BYTES))
    except FileNotFoundError:
        raise InventoryError(f"{path}: no inventory cached yet (the services that read the driver write it)") from None
    except OSError as e:
        raise InventoryError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:  # not a regular file, not root's alone, too large, not JSON
        raise InventoryError(f"{path}: not used: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != inventory_cache.FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else None
        raise InventoryError(f"{path}: an inventory of format {found!r}, not {inventory_cache.FORMAT}: written by "
                             "another version of the node services")  # fmt: skip
    try:
        return Inventory.from_json(doc["inventory"])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise InventoryError(f"{path}: not an inventory") from None


def refresh(settings, output: str, cached: bool = False) -> bool:
    """Labels from the current inventory (rediscovered when the driver changed: the inventory
    cache's fingerprint; with cached, the cache as it is: cached_inventory) written to output;
    True when the file changed."""
    from oci_gpu_hook.start import inventory_cache

    inventory = cached_inventory(settings) if cached else inventory_cache.load(settings)
    labels = for_node(settings, inventory)
    try:
        return write(output, labels)
    except OSError as e:
        raise LabelError(f"{output}: {e.strerror or e}") from None


def prepare(output: str, group: int) -> str:
    """Make the feature file output writable by a labels process of group `group` that may write
    nothing else of NFD's: root (uid 0, no capability needed: features.d is root's) does this
    before it runs, as the DaemonSet's init container. output must lie in a hidden directory of
    its own directly inside NFD's features.d (features.d/.oci-gpu-hook/oci-gpu-hook: NFD skips
    names that start with a dot). That directory is made root's and the group's, mode 0775 (and,
    where SELinux labels files, what containers may write: share_with_containers), and in
    features.d the file's name becomes a relative link to it, which NFD reads through (a file
    left there by an earlier version is replaced). Every step is on descriptors, links not
    followed. Returns the link's path."""
    directory = os.path.dirname(os.path.abspath(output))
    features_d, own, name = os.path.dirname(directory), os.path.basename(directory), os.path.basename(output)
    if not own.startswith(".") or own in (".", "..") or not name or name.startswith("."):
        raise LabelError(f"{output}: to be prepared, the feature file must be in a hidden directory of its own "
                         f"inside NFD's features.d (such as features.d/.oci-gpu-hook/oci-gpu-hook)")  # fmt: skip
    try:
        parent = os.open(features_d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise LabelError(f"{features_d}: no such directory (is NFD installed?)") from None
    except OSError as e:
        raise LabelError(f"{features_d}: {e.strerror or e}") from None
    try:
        _own_directory(parent, features_d, own, group)
        _link(parent, features_d, name, f"{own}/{name}")
    finally:
        os.close(parent)
    return os.path.join(features_d, name)


SELINUX_XATTR = "security.selinux"
# What a container's processes may write, as the policies with a container module name it
# (container-selinux's, refpolicy's), at s0 with no category: a labels pod writes there whatever
# categories CRI-O gave it, and a later pod (other categories) may replace what an earlier one left.
SHARED_CONTAINER_FILE = b"system_u:object_r:container_file_t:s0"
# What they may read and not write (the same policies' type for content given to containers
# read-only), at s0, which every pod's categories dominate.
READ_ONLY_CONTAINER_FILE = b"system_u:object_r:container_ro_file_t:s0"


def share_with_containers(fd: int, path: str, context: bytes, run_as: str) -> bool:
    """Where the directory of fd has an SELinux label, make it and the regular files in it context:
    what is made in it later inherits the directory's type. Nothing where the file system holds no
    label (SELinux off): False. The directory by its descriptor; a file in it through the
    descriptor's /proc link, itself not followed (a link there is left alone). run_as: where the
    error says this must run (the domain that may relabel)."""
    import stat

    try:
        label = os.getxattr(fd, SELINUX_XATTR)
    except OSError:
        return False  # no label here, or no SELinux: nothing to give
    try:
        if label.rstrip(b"\0") != context:
            os.setxattr(fd, SELINUX_XATTR, context)
        for name in os.listdir(fd):
            entry = f"/proc/self/fd/{fd}/{name}"
            try:
                if not stat.S_ISREG(os.stat(entry, follow_symlinks=False).st_mode):
                    continue
                if os.getxattr(entry, SELINUX_XATTR, follow_symlinks=False).rstrip(b"\0") != context:
                    os.setxattr(entry, SELINUX_XATTR, context, follow_symlinks=False)
            except FileNotFoundError:
                continue  # a file a rename took away meanwhile
    except OSError as e:
        raise LabelError(f"{path}: cannot label it {context.decode()} ({e.strerror or e}): {run_as}") from None
    return True


def share_cache(settings) -> bool:
    """Where SELinux labels files, label the inventory cache's directory (settings.inventory_cache's),
    and the files in it, READ_ONLY_CONTAINER_FILE, so that the labels container (container_t, which
    reads it with --cached-inventory) may read it and no container may write it: the node pod's init
    container, in spc_t, before its services write the cache. Under RHEL's policy the directory the
    kubelet makes in /var/cache is var_t, which container_t may not read. Refused for the hook's
    own directories (RUN_DIR, the records'), whose files are no container's business. False where
    nothing holds a label."""
    from oci_gpu_hook.start.settings import RUN_DIR

    path = os.path.dirname(os.path.abspath(settings.inventory_cache))
    records = os.path.abspath(settings.records_path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise LabelError(f"{path}: {e.strerror or e}") from None
    try:
        # By identity, not by name: /var/run/oci-gpu-hook is /run/oci-gpu-hook on most hosts.
        st = os.fstat(fd)
        for own in (RUN_DIR, records, os.path.dirname(records)):
            try:
                mine = os.stat(own)
            except OSError:
                continue  # not there: not this directory
            if (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino):
                raise LabelError(f"{path}: the hook's own directory ({own}), not shared with containers: give "
                                 "inventory_cache a directory of its own (the node pod's "
                                 "/var/cache/oci-gpu-hook)")  # fmt: skip
        return share_with_containers(fd, path, READ_ONLY_CONTAINER_FILE, "run this as SELinux type spc_t, with "
                                     "CAP_FOWNER (deploy/kubernetes/30-daemonset.yaml's init container)")  # fmt: skip
    finally:
        os.close(fd)


def _own_directory(parent: int, features_d: str, own: str, group: int) -> None:
    import stat

    path = os.path.join(features_d, own)
    try:
        os.mkdir(own, 0o700, dir_fd=parent)  # 0700 until it is the group's
    except FileExistsError:
        pass
    except OSError as e:
        raise LabelError(f"{path}: {e.strerror or e}") from None
    try:
        fd = os.open(own, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError as e:  # a link (ELOOP) or a file (ENOTDIR) there
        raise LabelError(f"{path}: not a directory ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise LabelError(f"{path}: owned by uid {st.st_uid}, not {os.geteuid()}: remove it")
        try:
            os.fchown(fd, -1, group)
            os.fchmod(fd, 0o775)
        except OSError as e:
            raise LabelError(f"{path}: cannot give it to group {group} ({e.strerror or e}): run this as its owner, "
                             f"in group {group}") from None  # fmt: skip
        share_with_containers(
            fd, path, SHARED_CONTAINER_FILE, "run this as SELinux type spc_t (deploy/kubernetes/31-labels.yaml)"
        )
    finally:
        os.close(fd)


def _link(parent: int, features_d: str, name: str, target: str) -> None:
    path = os.path.join(features_d, name)
    try:
        if os.readlink(name, dir_fd=parent) == target:
            return
    except OSError:
        pass  # absent, or not a link: replaced below
    temporary = f".{name}.{os.urandom(6).hex()}.tmp"
    try:
        os.symlink(target, temporary, dir_fd=parent)
        # A directory at the name is not replaced (EISDIR): only a file or a link is.
        os.rename(temporary, name, src_dir_fd=parent, dst_dir_fd=parent)
    except OSError as e:
        try:
            os.unlink(temporary, dir_fd=parent)
        except OSError:
            pass
        raise LabelError(f"{path}: cannot link it to {target}: {e.strerror or e}") from None


def watch(settings, output: str, interval: float, log, rounds: int | None = None, heartbeat: str | None = None,
          cached: bool = False) -> None:  # fmt: skip
    """refresh() every interval seconds; an error is logged once until it clears. heartbeat: a
    file touched after every round, failed or not (node.beat)."""
    from oci_gpu_hook.node import beat

    last_error = None
    while rounds is None or rounds > 0:
        try:
            if refresh(settings, output, cached):
                log(f"{output}: labels written")
            last_error = None
        except HookError as e:
            if e.message != last_error:
                log(e.message)
            last_error = e.message
        beat("labels", heartbeat)
        if rounds is not None:
            rounds -= 1
            if rounds == 0:
                break
        time.sleep(interval)
