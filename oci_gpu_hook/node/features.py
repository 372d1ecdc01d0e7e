"""`oci-gpu-hook labels`: the node's GPU labels as a feature file for NFD's local source, under
the label names of NVIDIA's GPU feature discovery (nvidia.com/gpu.product, ...), from the same
inventory the hook uses. Pure but for write() and watch().

What the labels say about MIG follows the configured strategy, as GFD's do: `none` describes the
full GPUs; `single` describes the MIG devices as if they were the GPUs (every GPU must have MIG
on, with one profile); `mixed` describes the full GPUs without MIG, plus one set of
nvidia.com/mig-<profile>.* labels per MIG profile.
"""

from __future__ import annotations

import os
import re
import time

from oci_gpu_hook.errors import HookError

PREFIX = "nvidia.com/"
# GFD's family names, by compute capability major (and minor where it splits a major).
_FAMILIES = {3: "kepler", 5: "maxwell", 6: "pascal", 7: "volta", 8: "ampere", 9: "hopper", 10: "blackwell",
             12: "blackwell"}  # fmt: skip
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_PROFILE = re.compile(r"^(\d+)g\.(\d+)gb$")


class LabelError(HookError):
    pass


def family(compute_capability: str | None) -> str | None:
    if not compute_capability:
        return None
    major, _, minor = compute_capability.partition(".")
    if major == "7" and minor == "5":
        return "turing"
    if major == "8" and minor == "9":
        return "ada-lovelace"
    return _FAMILIES.get(int(major)) if major.isdigit() else None


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


def product(model: str) -> str:
    return "-".join(model.split())


def _gpu_labels(gpus, replicas: int, product_suffix: str = "", memory: int | None = None) -> dict:
    first = gpus[0]
    name = product(first.model) + product_suffix + ("-SHARED" if replicas > 1 else "")
    labels = {"gpu.count": len(gpus), "gpu.product": name, "gpu.replicas": replicas}
    memory = memory if memory is not None else first.memory_total
    if memory:
        labels["gpu.memory"] = memory >> 20
    if first.compute_capability:
        major, _, minor = first.compute_capability.partition(".")
        labels["gpu.family"] = family(first.compute_capability) or "undefined"
        labels["gpu.compute.major"], labels["gpu.compute.minor"] = major, minor
    return labels


def _mig_profile_labels(migs) -> dict:
    labels = {}
    by_profile = {}
    for mig in migs:
        if mig.profile:
            by_profile.setdefault(mig.profile, []).append(mig)
    for profile, devices in sorted(by_profile.items()):
        # Label names allow no "+": a media-extension profile (1g.10gb+me) is named 1g.10gb.me, as
        # NVIDIA's device plugin names its resource.
        key = f"mig-{profile.replace('+', '.')}"
        labels[f"{key}.count"] = len(devices)
        if devices[0].memory_total:
            labels[f"{key}.memory"] = devices[0].memory_total >> 20
        match = _PROFILE.match(profile)
        if match:  # a MIG device here is a GPU instance with one compute instance over all of it
            labels[f"{key}.slices.gi"] = labels[f"{key}.slices.ci"] = int(match.group(1))
    return labels


def compute(inventory, mig_strategy: str = "none", replicas: int = 1) -> dict:
    """{label: value} (names with the nvidia.com/ prefix), checked against Kubernetes' syntax."""
    gpus = list(inventory.gpus)
    labels = {}
    driver = inventory.driver_version.split(".")
    labels["cuda.driver.major"] = driver[0]
    labels["cuda.driver.minor"] = driver[1] if len(driver) > 1 else "0"
    labels["cuda.driver.rev"] = driver[2] if len(driver) > 2 else ""
    if inventory.cuda_version:
        major, _, minor = inventory.cuda_version.partition(".")
        labels["cuda.runtime.major"], labels["cuda.runtime.minor"] = major, minor or "0"
    labels["mig.capable"] = "true" if any(mig_capable(g) for g in gpus) else "false"
    labels["mig.strategy"] = mig_strategy
    migs = [m for g in gpus for m in g.mig]
    if mig_strategy == "single" and migs:  # with MIG on nowhere, single offers the GPUs, as none does
        profiles = {m.profile for m in migs}
        if any(not g.mig for g in gpus) or len(profiles) != 1 or None in profiles:
            found = ", ".join(sorted(p or "?" for p in profiles)) or "none"
            raise LabelError(
                f"mig_strategy single needs MIG on every GPU, with one profile throughout (found {len(migs)} "
                f"MIG devices; profiles: {found})"
            )
        (profile,) = profiles
        labels.update(_gpu_labels(gpus, replicas, f"-MIG-{profile.replace('+', '.')}", migs[0].memory_total))
        labels["gpu.count"] = len(migs)
    elif mig_strategy == "mixed":
        full = [g for g in gpus if not g.mig]
        if full:
            labels.update(_gpu_labels(full, replicas))
        else:
            labels["gpu.count"] = 0
        labels.update(_mig_profile_labels([m for g in gpus for m in g.mig]))
    elif gpus:
        labels.update(_gpu_labels(gpus, replicas))
    else:
        labels["gpu.count"] = 0
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
    from oci_gpu_hook.node import plugin_config

    config = plugin_config.load(settings.node.device_plugin_config, settings.node)
    sharing = config.sharing(plugin_config.GPU_RESOURCE)
    return compute(inventory, config.mig_strategy, sharing.replicas if sharing else 1)


def refresh(settings, output: str) -> bool:
    """Labels from the current inventory (rediscovered when the driver changed: the inventory
    cache's fingerprint) written to output; True when the file changed."""
    from oci_gpu_hook.start import inventory_cache

    labels = for_node(settings, inventory_cache.load(settings))
    try:
        return write(output, labels)
    except OSError as e:
        raise LabelError(f"{output}: {e.strerror or e}") from None


def watch(settings, output: str, interval: float, log, rounds: int | None = None, heartbeat: str | None = None) -> None:
    """refresh() every interval seconds; an error is logged once until it clears. heartbeat: a
    file touched after every round, failed or not (node.beat)."""
    from oci_gpu_hook.node import beat

    last_error = None
    while rounds is None or rounds > 0:
        try:
            if refresh(settings, output):
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
