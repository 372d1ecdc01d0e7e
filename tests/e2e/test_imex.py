"""IMEX channels through the hook in real runc containers (root, runc, busybox, gcc): the simulated
host has /dev/nvidia-caps-imex-channels/channel0 and channel1, and /proc/devices names their major
(nvidia-caps-imex-channels). A container asks by NVIDIA_IMEX_CHANNELS (numbers, all, none), or by
the device plugin's volume mounts (/var/run/nvidia-container-devices/imex/<n>); it gets exactly
those channel nodes, with the host's numbers, let through by the device cgroup."""

import json
import os

import pytest
from hookcheck import config_with

from oci_gpu_hook.toolkit import containers

pytestmark = pytest.mark.host(gpus=2, mig=[], needs=("runc", "busybox"))

CHANNELS = "/dev/nvidia-caps-imex-channels"
# Each channel the container has, with its numbers, and whether opening it reaches the driver (the
# simulated major has none: ENXIO) or is refused by the device cgroup (EPERM).
SHOW = (
    f"for c in {CHANNELS}/*; do test -e $c || continue; echo $(basename $c) $(stat -c '%t %T' $c); "
    "cat $c 2>&1 | grep -o -e 'No such device or address' -e 'Operation not permitted'; done; echo end"
)
STRICT = "accept_volume_mounts: true\naccept_envvar_when_unprivileged: false\n"


def run(tmp_path, host, env, settings="", mounts=(), name="c"):
    bundle = containers.make_bundle(str(tmp_path / f"bundle-{name}"), args=["sh", "-c", SHOW], env=env,
                                    config_file=config_with(host, tmp_path, settings))  # fmt: skip
    path = os.path.join(bundle, "config.json")
    config = json.load(open(path))
    config["mounts"] += [{"destination": d, "type": "bind", "source": "/dev/null", "options": ["rbind", "ro"]}
                         for d in mounts]  # fmt: skip
    json.dump(config, open(path, "w"))
    return containers.runc_run(bundle, f"ocigpu-{os.getpid()}-imex-{name}")


def channels(host, out) -> dict:
    """{channel name: (major, minor, what opening it said)} from SHOW's output."""
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "end", out.stdout
    found = {}
    for i in range(0, len(lines) - 1, 2):
        name, major, minor = lines[i].split()
        found[name] = (int(major, 16), int(minor, 16), lines[i + 1])
    return found


@pytest.mark.parametrize("value, expected", [("1", [1]), ("0,1", [0, 1]), ("all", [0, 1]), ("ALL", [0, 1]),
                                             ("none", []), (" 1 , 1 ", [1])])  # fmt: skip
def test_the_channels_asked_for_and_no_other(tmp_path, host, value, expected):
    got = channels(host, run(tmp_path, host, {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": value}))
    major = host["imex_major"]
    assert got == {f"channel{n}": (major, n, "No such device or address") for n in expected}


def test_no_variable_no_channel(tmp_path, host):
    assert channels(host, run(tmp_path, host, {"NVIDIA_VISIBLE_DEVICES": "0"})) == {}


def test_the_device_plugins_mounts_and_not_the_pods_variable_under_strict_settings(tmp_path, host):
    mounts = [
        "/var/run/nvidia-container-devices/" + host["gpus"][0]["uuid"],
        "/var/run/nvidia-container-devices/imex/1",
    ]
    env = {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices", "NVIDIA_IMEX_CHANNELS": "all"}
    got = channels(host, run(tmp_path, host, env, STRICT, mounts))
    assert got == {"channel1": (host["imex_major"], 1, "No such device or address")}
    # And without the mount, the pod's own variable gets it nothing.
    got = channels(host, run(tmp_path, host, env, STRICT, mounts[:1], name="strict-env"))
    assert got == {}


@pytest.mark.parametrize("value, words", [
    ("7", "IMEX channel 7 (/dev/nvidia-caps-imex-channels/channel7): no such channel on this host; create it "
          "with nvidia-modprobe -i 7"),
    ("x", "NVIDIA_IMEX_CHANNELS=x: x: not an IMEX channel (accepted: all, none, channel numbers 0 to 2047)"),
    ("2048", "NVIDIA_IMEX_CHANNELS=2048: 2048: not an IMEX channel")])  # fmt: skip
def test_a_channel_the_host_lacks_is_one_line(tmp_path, host, value, words):
    out = run(tmp_path, host, {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": value})
    assert out.returncode != 0
    assert f"oci-gpu-hook: {words}" in out.stderr, out.stderr  # runc quotes the hook's one line


def test_the_plugins_allocate_answer_gives_the_channel(tmp_path, host):
    """The device plugin's imex configuration, each list strategy's answer run through runc."""
    from oci_gpu_hook.node.plugin import allocation
    from oci_gpu_hook.node.plugin import config as plugin_config
    from oci_gpu_hook.node.plugin import resources as plugin_resources
    from oci_gpu_hook.start import inventory_cache
    from oci_gpu_hook.start import settings as settings_module

    inventory = inventory_cache.load(settings_module.load(config_with(host, tmp_path, STRICT)))
    for strategy, settings in (("envvar", ""), ("volume-mounts", STRICT)):
        doc = {"flags": {"plugin": {"deviceListStrategy": strategy}}, "imex": {"channelIDs": [0]}}
        config = plugin_config.parse(doc, "test")
        (resource,) = plugin_resources.resources(inventory, config)
        answer = allocation.allocate(resource, [resource.devices[1].id], config, inventory, "nvidia.com/gpu")
        mounts = [c for c, h, _ in answer.mounts]
        got = channels(host, run(tmp_path, host, dict(answer.envs), settings, mounts, name=strategy))
        assert got == {"channel0": (host["imex_major"], 0, "No such device or address")}, strategy


def test_the_plugins_device_specs_and_a_missing_channel(tmp_path, host):
    """With passDeviceSpecs, or with CDI strategies only, the answer lists the channel's node for the
    runtime to make; a channel the host lacks is left out, or refused at start when required."""
    from oci_gpu_hook.errors import ConfigError
    from oci_gpu_hook.node.plugin import allocation
    from oci_gpu_hook.node.plugin import config as plugin_config
    from oci_gpu_hook.node.plugin import resources as plugin_resources
    from oci_gpu_hook.start import inventory_cache
    from oci_gpu_hook.start import settings as settings_module

    inventory = inventory_cache.load(settings_module.load(config_with(host, tmp_path, "")))
    node = (f"{CHANNELS}/channel1", f"{host['root']}{CHANNELS}/channel1", "rw")
    for plugin, envs in (({"deviceListStrategy": "cdi-cri"}, False), ({"passDeviceSpecs": True}, True)):
        config = plugin_config.parse({"flags": {"plugin": plugin}, "imex": {"channelIDs": [1, 9]}}, "test")
        (resource,) = plugin_resources.resources(inventory, config)
        answer = allocation.allocate(resource, [resource.devices[0].id], config, inventory, "nvidia.com/gpu")
        assert node in answer.devices and not any("channel9" in d[0] for d in answer.devices), plugin
        assert answer.envs.get("NVIDIA_IMEX_CHANNELS") == ("1" if envs else None), plugin
    required = plugin_config.parse({"imex": {"channelIDs": [1, 9], "required": True}}, "f.yaml")
    with pytest.raises(ConfigError, match=r"^f.yaml: imex.channelIDs: IMEX channel 9 .*: missing; it is required"):
        allocation.imex_nodes(required, inventory, "f.yaml")
