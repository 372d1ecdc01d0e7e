"""`oci-gpu-hook labels`: GPU feature discovery labels from the inventory, on simulated hosts.

The expected values come from the simulator's own summary of the host (its ground truth), not
from the code under test."""

import os
import pathlib
import shutil
import stat
import subprocess
import tempfile
import time

import pytest
from hookcheck import checkout_command, config_with, expected_common, expected_gpu, expected_mig

from oci_gpu_hook.errors import ConfigError, HookError
from oci_gpu_hook.node import features
from oci_gpu_hook.node.plugin import config as plugin_config
from oci_gpu_hook.node.plugin.config import GPU_RESOURCE, PluginConfig, TimeSlicedResource
from oci_gpu_hook.start import inventory_cache
from oci_gpu_hook.start import settings as settings_module
from oci_gpu_hook.start.inventory import DeviceNode, GpuInfo, Inventory, MigDevice
from oci_gpu_hook.toolkit.containers import hook_command

pytestmark = pytest.mark.host(gpus=8, mig=[2], needs=("pynvml",))
NOBODY = 65534  # the run_as_nobody fixture's uid and gid


@pytest.fixture
def host_settings(host):
    return settings_module.load(f"{host['root']}/config.yaml")


@pytest.fixture
def inventory(host_settings):
    return inventory_cache.load(host_settings)


def plugin(strategy: str = "none", replicas: int = 1) -> PluginConfig:
    """The device plugin's configuration of a MIG strategy and nvidia.com/gpu's time-slicing
    replicas, as plugin_config.load gives it from node.mig_strategy and node.replicas."""
    shared = (TimeSlicedResource(GPU_RESOURCE, replicas, None),) if replicas > 1 else ()
    return PluginConfig(mig_strategy=strategy, time_slicing=shared)


def mps(strategy: str = "none", replicas: int = 4) -> PluginConfig:
    return plugin_config.parse({"version": "v1", "flags": {"migStrategy": strategy}, "sharing": {
        "mps": {"resources": [{"name": GPU_RESOURCE, "replicas": replicas}]}}}, "test")  # fmt: skip


# ---- compute -------------------------------------------------------------------------------------


def test_strategy_none_describes_every_full_gpu(host, inventory):
    labels = features.compute(inventory, plugin("none"))
    expected = {**expected_common(host, "none"), **expected_gpu(host, host["gpus"], 1)}
    assert labels == expected
    # The literal values the issue names, so a wrong summary cannot make the test agree with itself.
    assert labels["nvidia.com/gpu.count"] == "8"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB"
    assert labels["nvidia.com/gpu.memory"] == "40960"
    assert (labels["nvidia.com/gpu.compute.major"], labels["nvidia.com/gpu.compute.minor"]) == ("8", "0")
    assert [labels[f"nvidia.com/cuda.driver.{k}"] for k in ("major", "minor", "rev")] == ["550", "54", "15"]
    assert [labels[f"nvidia.com/cuda.driver-version.{k}"] for k in ("major", "minor", "revision", "full")] == [
        "550", "54", "15", "550.54.15"]  # fmt: skip
    assert [labels[f"nvidia.com/cuda.runtime.{k}"] for k in ("major", "minor")] == ["12", "4"]
    assert [labels[f"nvidia.com/cuda.runtime-version.{k}"] for k in ("major", "minor", "full")] == ["12", "4", "12.4"]
    for key, value in labels.items():
        features.check(key, value)


def test_strategy_none_from_settings(host, host_settings, tmp_path):
    """refresh() takes the strategy and replicas from the settings (defaults: none, 1), and the
    machine and mode from the simulated sysfs (node.sys_root)."""
    assert (host_settings.node.mig_strategy, host_settings.node.replicas) == ("none", 1)
    out = tmp_path / "features"
    assert features.refresh(host_settings, str(out)) is True
    expected = {**expected_common(host, "none", facts=True), **expected_gpu(host, host["gpus"], 1)}
    assert out.read_text() == "".join(f"{k}={v}\n" for k, v in sorted(expected.items()))
    text = out.read_text()
    assert "nvidia.com/gpu.machine=ProLiant-XL675d-Gen10-Plus\n" in text and "nvidia.com/gpu.mode=compute\n" in text


def test_strategy_mixed_with_replicas(host, host_settings, tmp_path):
    s = host_settings.replace(node=host_settings.node.replace(mig_strategy="mixed", replicas=4))
    labels = features.compute(inventory_cache.load(s), plugin_config.load(None, s.node))
    migs = [m for g in host["gpus"] for m in g["mig"]]
    # GFD counts every GPU in gpu.count, MIG on or not (the plugin offers the 7 without MIG)
    expected = {**expected_common(host, "mixed"), **expected_gpu(host, host["gpus"], 4)}
    profiles = sorted({m["profile"] for m in migs})
    assert profiles == ["1g.5gb", "2g.10gb", "3g.20gb"]
    for profile in profiles:
        devices = [m for m in migs if m["profile"] == profile]
        expected.update(expected_mig(f"mig-{profile}", host["gpus"][0]["model"]["name"], devices))
    assert labels == expected
    assert labels["nvidia.com/gpu.count"] == "8"
    assert labels["nvidia.com/gpu.product"].endswith("-SHARED")
    assert labels["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    # A real A100-SXM4-40GB's figures (its nvidia-smi and GFD's labels on it), not 5 GiB
    assert labels["nvidia.com/mig-3g.20gb.memory"] == "20096"
    assert labels["nvidia.com/mig-1g.5gb.memory"] == "4864"
    assert labels["nvidia.com/mig-1g.5gb.multiprocessors"] == "14"
    assert labels["nvidia.com/mig-2g.10gb.engines.decoder"] == "1"
    assert labels["nvidia.com/mig-1g.5gb.product"] == "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"
    # refresh() honours the same settings
    out = tmp_path / "features"
    assert features.refresh(s, str(out)) is True
    assert out.read_text() == features.render({**expected, **expected_common(host, "mixed", facts=True)})


def test_mixed_with_every_gpu_in_mig_mode_labels_the_gpus_without_sharing(simulated_host, tmp_path):
    """GFD's gpu.* for MIG-enabled GPUs under mixed: counted, with replicas 0 and no sharing, and
    each MIG profile's resource shared as the plugin's file says."""
    one = simulated_host(gpus=1, mig=[0])
    s = settings_module.load(f"{one['root']}/config.yaml")
    plugin_file = tmp_path / "plugin.yaml"
    plugin_file.write_text("version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
                           "    - name: nvidia.com/mig-1g.5gb\n      replicas: 3\n")  # fmt: skip
    s = s.replace(node=s.node.replace(device_plugin_config=str(plugin_file)))
    labels = features.for_node(s, inventory_cache.load(s))
    gpu = one["gpus"][0]
    expected = {**expected_common(one, "mixed", facts=True), **expected_gpu(one, one["gpus"], 1)}
    for mig in gpu["mig"]:
        shared = 3 if mig["profile"] == "1g.5gb" else 1
        expected.update(expected_mig(f"mig-{mig['profile']}", gpu["model"]["name"], [mig], shared))
    assert labels == expected
    assert labels["nvidia.com/gpu.replicas"] == "0" and labels["nvidia.com/gpu.count"] == "1"
    assert labels["nvidia.com/mig-1g.5gb.product"] == "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb-SHARED"
    assert labels["nvidia.com/mig-1g.5gb.sharing-strategy"] == "time-slicing"
    assert labels["nvidia.com/mig-2g.10gb.sharing-strategy"] == "none"


def test_machine_and_mode_come_from_sysfs(host, host_settings, inventory, tmp_path):
    """gpu.machine from DMI's product name, gpu.mode from the GPUs' PCI class, as GFD decides it
    (getModeForClasses): every GPU a VGA controller, graphics; every one a 3D controller,
    compute; GPUs of two classes, another class, or a GPU GFD cannot read, unknown."""
    facts = features.host_facts(host_settings.node.sys_root, inventory)
    assert facts.machine == "ProLiant-XL675d-Gen10-Plus"
    buses = [g.bus_id for g in inventory.gpus]
    assert [facts.pci_classes[b] for b in buses] == ["0x030200"] * len(buses)
    for classes, mode in ((["0x030000"] * 8, "graphics"), (["0x030200"] * 8, "compute"), (["0x038000"] * 8,
                          "unknown"), (["0x030000"] + ["0x030200"] * 7, "unknown"), (["0x030200"] * 7 + [None],
                          "unknown")):  # fmt: skip
        f = facts.replace(pci_classes=dict(zip(buses, classes)))
        assert features.compute(inventory, plugin(), host=f)["nvidia.com/gpu.mode"] == mode
    empty = features.host_facts(str(tmp_path), inventory)  # no sysfs there
    assert empty.machine == "unknown" and set(empty.pci_classes.values()) == {None}
    assert [features.machine_label(n) for n in ("DGX A100", "  ", None, "R750xa (rev/2)")] == [
        "DGX-A100", "unknown", "unknown", "R750xa-rev2"]  # fmt: skip


def test_mps_sharing_labels():
    """mps.capable and the sharing strategy as GFD writes them with sharing.mps."""
    labels = features.compute(_fake_inventory(migs=0), mps())
    assert labels["nvidia.com/mps.capable"] == "true"
    assert labels["nvidia.com/gpu.sharing-strategy"] == "mps"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB-SHARED"
    with_mig = features.compute(_fake_inventory(), mps("mixed"))
    assert with_mig["nvidia.com/mps.capable"] == "false"  # MPS shares no MIG device


def test_strategy_single_needs_mig_on_every_gpu(host, inventory):
    """Refused as the device plugin refuses it: the labels describe its resources."""
    with pytest.raises(ConfigError) as e:
        features.compute(inventory, plugin("single"), where="plugin.yaml")
    assert e.value.message == ("plugin.yaml: flags.migStrategy single needs MIG on every GPU with one profile; "
                               "this node has 7 GPUs without MIG and MIG profiles 1g.5gb, 2g.10gb, 3g.20gb; "
                               "use mixed")  # fmt: skip


def test_strategy_single_needs_one_profile(simulated_host):
    one = simulated_host(gpus=1, mig=[0])
    assert len(one["gpus"]) == 1 and len(one["gpus"][0]["mig"]) == 3  # MIG on every GPU, three profiles
    s = settings_module.load(f"{one['root']}/config.yaml")
    s = s.replace(node=s.node.replace(mig_strategy="single"))
    inventory = inventory_cache.load(s)
    assert all(g.mig for g in inventory.gpus)
    with pytest.raises(ConfigError) as e:
        features.compute(inventory, plugin_config.load(None, s.node))
    assert e.value.message == ("device plugin configuration: flags.migStrategy single needs MIG on every GPU with "
                               "one profile; this node has 0 GPUs without MIG and MIG profiles 1g.5gb, 2g.10gb, "
                               "3g.20gb; use mixed")  # fmt: skip
    with pytest.raises(ConfigError) as e:  # refresh() says the same, and writes nothing
        features.refresh(s, f"{one['root']}/never-written")
    assert e.value.message.startswith("node settings (node.mig_strategy, node.replicas): flags.migStrategy single")
    assert not os.path.exists(f"{one['root']}/never-written")


def _fake_inventory(profile="1g.5gb", gpus=2, driver="550.54", cuda=None, migs=7) -> Inventory:
    def cap(minor):
        return DeviceNode(f"/dev/nvidia-caps/nvidia-cap{minor}", 510, minor)

    def mig(gpu, index):
        return MigDevice(index=index, gi=index + 1, ci=0, uuid=f"MIG-{gpu:04d}{index:04d}-0000-0000-0000-0000",
                         gi_cap=cap(100 * gpu + 2 * index), ci_cap=cap(100 * gpu + 2 * index + 1), gi_access="",
                         ci_access="", profile=profile, memory_total=4864 << 20,
                         attributes={"multiprocessors": 14})  # fmt: skip

    gpu = [
        GpuInfo(index=i, minor=i, uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000", bus_id=f"0000:0{i}:00.0",
                model="NVIDIA A100-SXM4-40GB", mig=tuple(mig(i, m) for m in range(migs)),
                node=DeviceNode(f"/dev/nvidia{i}", 195, i), memory_total=40 << 30, compute_capability="8.0")
        for i in range(gpus)
    ]  # fmt: skip
    return Inventory(driver_version=driver, cuda_version=cuda, nvml=True, driver_root="/", dev_root="/",
                     proc_root="/", majors={"nvidia": 195}, gpus=tuple(gpu), control_devices={}, mig_caps={},
                     files=())  # fmt: skip


def test_strategy_single_with_one_profile_describes_the_mig_devices():
    """No simulated layout has one profile throughout: a hand-made inventory covers that branch."""
    labels = features.compute(_fake_inventory(), plugin("single", 2))
    assert labels == {
        "nvidia.com/cuda.driver.major": "550",
        "nvidia.com/cuda.driver.minor": "54",
        "nvidia.com/cuda.driver.rev": "",  # no third component: an empty value, which is valid
        "nvidia.com/cuda.driver-version.major": "550",
        "nvidia.com/cuda.driver-version.minor": "54",
        "nvidia.com/cuda.driver-version.revision": "",
        "nvidia.com/cuda.driver-version.full": "550.54",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.strategy": "single",
        "nvidia.com/mps.capable": "false",
        "nvidia.com/gpu.count": "14",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb-SHARED",
        "nvidia.com/gpu.replicas": "2",
        "nvidia.com/gpu.sharing-strategy": "time-slicing",
        "nvidia.com/gpu.memory": "4864",
        "nvidia.com/gpu.multiprocessors": "14",
        "nvidia.com/gpu.slices.gi": "1",
        "nvidia.com/gpu.slices.ci": "1",
        # the whole GPUs' architecture stays, as in GFD's single labels
        "nvidia.com/gpu.family": "ampere",
        "nvidia.com/gpu.compute.major": "8",
        "nvidia.com/gpu.compute.minor": "0",
    }


def test_a_media_extension_profile_makes_valid_labels():
    """Label names take no "+": 1g.10gb+me is named 1g.10gb.me, as NVIDIA's device plugin does."""
    mixed = features.compute(_fake_inventory(profile="1g.10gb+me"), plugin("mixed"))
    assert mixed["nvidia.com/mig-1g.10gb.me.count"] == "14"
    single = features.compute(_fake_inventory(profile="1g.10gb+me"), plugin("single"))
    assert single["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB-MIG-1g.10gb.me"


# ---- check / family ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value",
    [
        ("nvidia.com/" + "a" * 64, "x"),  # name longer than 63
        ("nvidia.com/gpu.product", "has space"),
        ("Nvidia.com/gpu.count", "1"),  # prefix not a (lower-case) DNS subdomain
        ("nvidia.com/", "1"),  # empty name
        ("nvidia.com/gpu.count", "x" * 64),  # value longer than 63
        ("nvidia.com/-gpu", "1"),  # name must start alphanumeric
        ("nvidia.com/gpu.product", "A100-"),  # value must end alphanumeric
        ("nvidia..com/gpu.count", "1"),  # empty DNS label in the prefix
        ("a" * 254 + "/gpu.count", "1"),  # prefix longer than 253
    ],
)
def test_check_rejects(key, value):
    with pytest.raises(features.LabelError):
        features.check(key, value)


@pytest.mark.parametrize(
    "key, value",
    [
        ("nvidia.com/cuda.driver.rev", ""),  # empty value
        ("nvidia.com/" + "a" * 63, "b" * 63),  # at the limits
        ("gpu.count", "8"),  # no prefix
        ("nvidia.com/mig-1g.5gb.count", "A_b.c-9"),
    ],
)
def test_check_accepts(key, value):
    features.check(key, value)


@pytest.mark.parametrize(
    "capability, name",
    [
        ("3.7", "kepler"),
        ("5.2", "maxwell"),
        ("6.0", "pascal"),
        ("7.0", "volta"),
        ("7.5", "turing"),
        ("8.0", "ampere"),
        ("8.6", "ampere"),
        ("8.9", "ada-lovelace"),
        ("9.0", "hopper"),
        ("10.0", "blackwell"),
        ("12.0", "blackwell"),
        (None, None),
        ("", None),
        ("x.y", None),
        ("\u0668.0", None),  # an Arabic-Indic 8, which int() reads as 8: not a compute capability
        ("\u00b9.0", None),  # a superscript 1, which int() refuses
    ],
)
def test_family(capability, name):
    assert features.family(capability) == name


# ---- write / refresh -----------------------------------------------------------------------------


def test_write_is_atomic_and_only_when_changed(tmp_path):
    path = tmp_path / "features.d" / "oci-gpu-hook"
    labels = {"nvidia.com/gpu.count": "2", "nvidia.com/cuda.driver.major": "550", "nvidia.com/a": ""}
    # A directory that is not there is not made (issue 32): only what the flags and configuration
    # name is written.
    with pytest.raises(HookError, match=f"^{tmp_path}/features.d: no such directory \\(is NFD installed"):
        features.write(str(path), labels)
    assert not path.parent.exists()
    path.parent.mkdir()
    assert features.write(str(path), labels) is True
    assert path.read_text() == "nvidia.com/a=\nnvidia.com/cuda.driver.major=550\nnvidia.com/gpu.count=2\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    first = path.stat()
    assert features.write(str(path), dict(reversed(list(labels.items())))) is False  # same text
    assert path.stat().st_ino == first.st_ino and path.stat().st_mtime_ns == first.st_mtime_ns
    assert features.write(str(path), {**labels, "nvidia.com/gpu.count": "3"}) is True
    # replaced by rename: a new inode, nothing half-written left beside it
    assert path.stat().st_ino != first.st_ino
    assert path.read_text().splitlines()[-1] == "nvidia.com/gpu.count=3"
    assert os.listdir(path.parent) == ["oci-gpu-hook"]


def test_write_to_a_bare_relative_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert features.write("features", {"nvidia.com/gpu.count": "1"}) is True
    assert (tmp_path / "features").read_text() == "nvidia.com/gpu.count=1\n"


def test_refresh_reports_an_unwritable_output(host_settings, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(HookError) as e:
        features.refresh(host_settings, str(blocker / "features"))
    assert e.value.message.startswith(f"{blocker}: no such directory")


def test_driver_change_refreshes_the_file(tmp_path, require):
    require("root", "gcc", "pynvml")
    from oci_gpu_hook.toolkit.simulate import remove_host, simulate

    root = str(tmp_path / "h")
    before = simulate(root, gpus=2, driver_version="550.54.15")
    s = settings_module.load(f"{root}/config.yaml")
    out = tmp_path / "features"
    assert features.refresh(s, str(out)) is True
    labels = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert labels["nvidia.com/cuda.driver.major"] == "550"
    assert labels["nvidia.com/gpu.count"] == "2"
    assert features.refresh(s, str(out)) is False  # nothing changed

    remove_host(root)
    after = simulate(root, gpus=2, driver_version="555.42.02")
    assert after["root"] == before["root"]
    # The same settings: only the inventory cache's fingerprint tells that the driver changed.
    assert features.refresh(s, str(out)) is True
    labels = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert [labels[f"nvidia.com/cuda.driver.{k}"] for k in ("major", "minor", "rev")] == ["555", "42", "02"]
    assert features.refresh(s, str(out)) is False


# ---- the DaemonSet's labels pod: the cached inventory, a directory of its own in features.d ------


def _cache_for(host, tmp_path, **changes) -> str:
    """A configuration whose inventory cache is tmp_path's, and that cache as root keeps it."""
    config = config_with(host, tmp_path, f"inventory_cache: {tmp_path}/cache/inventory.json")
    inventory_cache.load(settings_module.load(config))
    return config


def test_the_cached_inventory_is_taken_as_its_writer_left_it(host, tmp_path):
    """--cached-inventory: the labels pod sees neither the driver nor /dev, so it cannot check the
    cache against the host; the node pod, which sees them, keeps the cache current. A cache
    whose fingerprint is not the host's is still the inventory (its writer replaces it)."""
    import json

    config = _cache_for(host, tmp_path)
    s = settings_module.load(config)
    path = tmp_path / "cache" / "inventory.json"
    expected = inventory_cache.load(s)
    doc = json.loads(path.read_text())
    doc["fingerprint"]["gpus"] = ["another host's"]
    path.write_text(json.dumps(doc))
    assert inventory_cache.read(s) is None  # the hook's reader rebuilds it
    assert features.cached_inventory(s).to_json() == expected.to_json()


@pytest.mark.parametrize("case", ["missing", "writable-by-others", "other-format", "not-an-inventory", "a-link"])
def test_a_cached_inventory_that_cannot_be_used_is_one_line(host, tmp_path, case):
    """Never a rebuild from the host (labels could not see it), never a file others may change."""
    import json

    from oci_gpu_hook.errors import InventoryError

    s = settings_module.load(_cache_for(host, tmp_path))
    path = tmp_path / "cache" / "inventory.json"
    doc = json.loads(path.read_text())
    if case == "missing":
        path.unlink()
    elif case == "writable-by-others":
        path.chmod(0o666)
    elif case == "other-format":
        path.write_text(json.dumps({**doc, "format": 1}))
    elif case == "not-an-inventory":
        path.write_text(json.dumps({**doc, "inventory": {"gpus": 3}}))
    else:
        os.rename(path, tmp_path / "cache" / "elsewhere.json")
        path.symlink_to("elsewhere.json")
    with pytest.raises(InventoryError) as e:
        features.cached_inventory(s)
    message = e.value.message
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    assert {
        "missing": "no inventory cached yet",
        "writable-by-others": "with mode 0666",
        "other-format": "an inventory of format 1, not",
        "not-an-inventory": "not an inventory",
        "a-link": "Too many levels of symbolic links",
    }[case] in message, message
    assert not (tmp_path / "features").exists()


def _features_d(tmp_path):
    """NFD's features.d as NFD's worker makes it (root's, 0755), with another vendor's file and the
    file an earlier version of the DaemonSet wrote there as root."""
    features_d = tmp_path / "features.d"
    features_d.mkdir(mode=0o755)
    (features_d / "other-vendor").write_text("example.com/thing=1\n")
    (features_d / "oci-gpu-hook").write_text("nvidia.com/gpu.count=1\n")
    return features_d


def test_the_labels_pod_writes_as_no_one_on_the_host(host, tmp_path, run_as_nobody, require):
    """The DaemonSet's labels pod (deploy/kubernetes/31-labels.yaml, issue 46): its init container,
    uid 0 with no capability, in the labels' group, makes features.d/.oci-gpu-hook that group's
    and links NFD's name to the file in it; then labels, another user altogether (here nobody,
    65534) with no capability, writes the feature file from the cached inventory, seeing nothing
    of the simulated host's driver, /dev or /proc (they lie in root's 0700 tmp directory). NFD
    reads the labels through the link; nothing else in features.d changed."""
    require("root", "setpriv")
    place = tempfile.mkdtemp(prefix="oci-gpu-hook-labels-", dir="/tmp")  # where nobody may go
    try:
        os.chmod(place, 0o755)
        shutil.copytree(f"{host['root']}/sys", f"{place}/sys", symlinks=True)  # labels' own /sys
        features_d = _features_d(pathlib.Path(place))
        output = f"{features_d}/.oci-gpu-hook/oci-gpu-hook"
        config = config_with(host, place, f"inventory_cache: {place}/cache/inventory.json\n"
                             f"node: {{sys_root: {place}, features_file: {output}}}")  # fmt: skip
        inventory_cache.load(settings_module.load(config))  # the node pod's, root's
        os.chmod(f"{place}/cache", 0o755)
        init = ["setpriv", "--regid", str(NOBODY), "--clear-groups", "--bounding-set=-all", "--inh-caps=-all",
                "--no-new-privs", "--", *checkout_command(), "--config", config, "labels", "--prepare-for",
                str(NOBODY)]  # fmt: skip
        prepare = subprocess.run(init, capture_output=True, text=True, timeout=120)
        assert (prepare.returncode, prepare.stdout, prepare.stderr) == (
            0, f"{features_d}/oci-gpu-hook: prepared for group {NOBODY}\n", ""), prepare.stderr  # fmt: skip
        command = ["-m", "oci_gpu_hook", "--config", config, "labels"]
        # The CLI's third-party imports: click, and PyYAML and jsonschema's own for the configuration.
        modules = ("oci_gpu_hook", "click", "yaml", "jsonschema", "jsonschema_specifications", "referencing",
                   "rpds", "attrs", "attr", "typing_extensions")  # fmt: skip
        # Without the cache alone it would read the host's driver, and it can see none of it.
        blind = run_as_nobody(command, modules=modules, capture_output=True, text=True, timeout=120)
        assert blind.returncode == 4 and len(blind.stderr.splitlines()) == 1, blind.stderr
        done = run_as_nobody([*command, "--cached-inventory"], modules=modules, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert (done.returncode, done.stdout, done.stderr) == (0, f"{output}: written\n", "")
        expected = {**expected_common(host, "none", facts=True), **expected_gpu(host, host["gpus"], 1)}
        assert (features_d / "oci-gpu-hook").read_text() == features.render(expected)  # as NFD reads it
        assert os.readlink(features_d / "oci-gpu-hook") == ".oci-gpu-hook/oci-gpu-hook"
        assert sorted(os.listdir(features_d)) == [".oci-gpu-hook", "oci-gpu-hook", "other-vendor"]
        assert (features_d / "other-vendor").read_text() == "example.com/thing=1\n"
        paths = (features_d, features_d / ".oci-gpu-hook", pathlib.Path(output))
        owners = [(st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) for st in map(os.lstat, paths)]
        assert owners == [(0, 0, 0o755), (0, NOBODY, 0o775), (NOBODY, NOBODY, 0o644)]
        assert os.listdir(features_d / ".oci-gpu-hook") == ["oci-gpu-hook"]
    finally:
        shutil.rmtree(place)


def test_preparing_twice_changes_nothing_and_a_wrong_place_is_refused(tmp_path):
    features_d = _features_d(tmp_path)
    output = f"{features_d}/.oci-gpu-hook/oci-gpu-hook"
    assert features.prepare(output, 4242) == f"{features_d}/oci-gpu-hook"
    first = os.lstat(features_d / "oci-gpu-hook")
    assert features.prepare(output, 4242) == f"{features_d}/oci-gpu-hook"
    assert os.lstat(features_d / "oci-gpu-hook").st_ino == first.st_ino  # the link as it was
    st = os.stat(features_d / ".oci-gpu-hook")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 4242, 0o775)
    assert sorted(os.listdir(features_d)) == [".oci-gpu-hook", "oci-gpu-hook", "other-vendor"]
    # The file straight in features.d, where labels would need all of features.d to write it.
    with pytest.raises(HookError, match="must be in a hidden directory of its own inside NFD's features.d"):
        features.prepare(f"{features_d}/oci-gpu-hook", 4242)
    with pytest.raises(HookError, match="no such directory \\(is NFD installed"):
        features.prepare(f"{tmp_path}/missing/.oci-gpu-hook/oci-gpu-hook", 4242)


KUBERNETES_FILE = b"unconfined_u:object_r:kubernetes_file_t:s0"  # what RHEL's policy gives NFD's features.d


def test_where_files_carry_selinux_labels_the_own_directory_is_what_containers_may_write(tmp_path, require):
    """Under RHEL's policy what is made in NFD's features.d is kubernetes_file_t, which the labels
    container (container_t) may not write: the init container labels its own directory, and each
    regular file in it (one an earlier pod left, with other categories), container_file_t at s0.
    A link there keeps its label; where the file system holds no label (SELinux off), none is
    added. This machine's kernel has no SELinux: root sets the attribute as the policy would have
    (in the node VM under RHEL's enforcing policy the init container then ran)."""
    require("root")
    features_d = _features_d(tmp_path)
    own = features_d / ".oci-gpu-hook"
    own.mkdir(mode=0o700)
    (own / "oci-gpu-hook").write_text("nvidia.com/gpu.count=2\n")
    os.symlink("oci-gpu-hook", own / "a-link")
    earlier_pod = b"system_u:object_r:container_file_t:s0:c1,c2"
    labelled = ((features_d, KUBERNETES_FILE), (own, KUBERNETES_FILE), (own / "oci-gpu-hook", earlier_pod),
                (own / "a-link", KUBERNETES_FILE))  # fmt: skip
    for path, label in labelled:
        os.setxattr(path, features.SELINUX_XATTR, label, follow_symlinks=False)
    features.prepare(f"{own}/oci-gpu-hook", 4242)
    label = lambda path: os.getxattr(path, features.SELINUX_XATTR, follow_symlinks=False).rstrip(b"\0")  # noqa: E731
    assert label(own) == label(own / "oci-gpu-hook") == features.SHARED_CONTAINER_FILE
    assert label(own / "a-link") == KUBERNETES_FILE
    assert label(features_d) == KUBERNETES_FILE  # NFD's own directory is not ours to label
    # Without labels: none added.
    (tmp_path / "bare").mkdir()
    bare = _features_d(tmp_path / "bare")
    features.prepare(f"{bare}/.oci-gpu-hook/oci-gpu-hook", 4242)
    with pytest.raises(OSError):
        os.getxattr(bare / ".oci-gpu-hook", features.SELINUX_XATTR)


@pytest.mark.parametrize("case", ["a-link", "a-file", "another-owner"])
def test_a_directory_others_made_is_not_taken(tmp_path, case):
    """Whatever is at features.d/.oci-gpu-hook, the init container only takes a directory of its
    own uid: a link is not followed (it would give the group a directory elsewhere), a file or
    another user's directory is left alone. Nothing is linked then."""
    features_d = _features_d(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    own = features_d / ".oci-gpu-hook"
    if case == "a-link":
        own.symlink_to(elsewhere)
    elif case == "a-file":
        own.write_text("")
    else:
        own.mkdir()
        os.chown(own, 4243, 4243)
    with pytest.raises(HookError) as e:
        features.prepare(f"{own}/oci-gpu-hook", 4242)
    assert e.value.message.startswith(f"{own}: "), e.value.message
    assert (features_d / "oci-gpu-hook").read_text() == "nvidia.com/gpu.count=1\n"  # not replaced
    st = os.stat(elsewhere)
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0o700)


VAR_FILE = b"system_u:object_r:var_t:s0"  # what RHEL's policy gives what the kubelet makes in /var/cache


def test_the_node_pod_labels_its_cache_for_the_labels_pod_to_read(host, hook_cli, tmp_path, require):
    """Under RHEL's policy the node pod's cache directory (which the kubelet makes in /var/cache)
    and the cache in it are var_t, which the labels container (container_t) may not read: the node
    pod's init container, `inventory share`, labels the directory and each regular file in it
    container_ro_file_t at s0 (what files made there later inherit), and leaves a link alone.
    Where nothing holds a label (SELinux off) none is added. This machine's kernel has no SELinux:
    root sets the attribute as the policy would have (in the node VM the labels pod then read it
    under RHEL's enforcing policy)."""
    require("root")
    cache = tmp_path / "cache"
    config = config_with(host, tmp_path, f"inventory_cache: {cache}/inventory.json")
    inventory_cache.load(settings_module.load(config))  # as the node pod's services write it
    os.symlink("inventory.json", cache / "a-link")
    for path in (cache, cache / "inventory.json", cache / "a-link"):
        os.setxattr(path, features.SELINUX_XATTR, VAR_FILE, follow_symlinks=False)
    label = lambda path: os.getxattr(path, features.SELINUX_XATTR, follow_symlinks=False).rstrip(b"\0")  # noqa: E731
    for _ in range(2):  # and again, as at the pod's next start: nothing changes
        p = hook_cli("--config", config, "inventory", "share")
        assert (p.returncode, p.stdout, p.stderr) == (0, f"{cache}: system_u:object_r:container_ro_file_t:s0\n", "")
        assert label(cache) == label(cache / "inventory.json") == features.READ_ONLY_CONTAINER_FILE
        assert label(cache / "a-link") == VAR_FILE
    # Without labels: none added.
    bare = tmp_path / "bare"
    bare.mkdir()
    p = hook_cli("--config", config_with(host, bare, f"inventory_cache: {bare}/inventory.json"), "inventory", "share")
    assert (p.returncode, p.stdout, p.stderr) == (0, f"{bare}: no SELinux labels here: nothing to do\n", "")
    with pytest.raises(OSError):
        os.getxattr(bare, features.SELINUX_XATTR)


@pytest.mark.parametrize("place", ["run-directory", "run-directory-by-a-linked-parent", "records", "records-parent"])
def test_the_hooks_own_directories_are_not_shared(host, tmp_path, place):
    """The hook's run directory holds its compiled settings and journals, the records directory
    every container's record: a cache configured there is refused, and nothing is labelled. By
    the directory itself, not its name (/var/run/oci-gpu-hook is /run/oci-gpu-hook where /var/run
    links to /run). In this process settings.RUN_DIR is the test's own (conftest)."""
    records = tmp_path / "records"
    records.mkdir()
    run_dir = settings_module.RUN_DIR
    (tmp_path / "var-run").symlink_to(os.path.dirname(run_dir))
    cache = {"run-directory": run_dir, "records": records, "records-parent": tmp_path,
             "run-directory-by-a-linked-parent": tmp_path / "var-run" / os.path.basename(run_dir)}[place]  # fmt: skip
    config = config_with(host, tmp_path, f"inventory_cache: {cache}/inventory.json\nrecords_directory: {records}")
    with pytest.raises(HookError) as e:
        features.share_cache(settings_module.load(config))
    assert e.value.message.startswith(f"{cache}: the hook's own directory ("), e.value.message
    assert "not shared with containers" in e.value.message


@pytest.mark.parametrize("place", ["records", "a-link", "absent"])
def test_cli_share_refuses_in_one_line(host, hook_cli, tmp_path, place):
    """Refused by the CLI (a process of its own): one line naming the directory, nothing on
    stdout. A link at the directory itself is not followed to a directory elsewhere; a missing
    one is named."""
    records = tmp_path / "records"
    records.mkdir()
    cache = {"records": records, "a-link": tmp_path / "link", "absent": tmp_path / "absent"}[place]
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    config = config_with(host, tmp_path / "elsewhere", f"inventory_cache: {cache}/inventory.json\n"
                         f"records_directory: {records}")  # fmt: skip
    p = hook_cli("--config", config, "inventory", "share")
    assert (p.returncode, p.stdout, len(p.stderr.splitlines())) == (1, "", 1), p.stderr
    assert p.stderr.startswith(f"oci-gpu-hook: {cache}: "), p.stderr


def test_cli_prepare_takes_only_output(host, hook_cli, tmp_path):
    for extra in (["--watch", "5"], ["--cached-inventory"], ["--output", "-"]):
        p = hook_cli("--config", f"{host['root']}/config.yaml", "labels", "--prepare-for", "4242", *extra)
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip().endswith("--prepare-for prepares the feature file's directory and exits: it takes "
                                         "only --output"), p.stderr  # fmt: skip


# ---- the command ---------------------------------------------------------------------------------


def test_cli_prints_the_labels(host, hook_cli):
    p = hook_cli("--config", f"{host['root']}/config.yaml", "labels", "--output", "-")
    assert p.returncode == 0, p.stderr
    expected = {**expected_common(host, "none", facts=True), **expected_gpu(host, host["gpus"], 1)}
    assert p.stdout == features.render(expected)


def test_a_simulated_hosts_labels_stay_inside_it(hook_cli, tmp_path, require):
    """With a simulated host's configuration and no --output, labels go to the feature file the
    configuration names, inside the host: the machine's own /etc is not touched (issue 32)."""
    require("root", "gcc", "pynvml")
    from oci_gpu_hook.toolkit.simulate import build, simulate

    root = str(tmp_path / "h")
    simulate(root, gpus=1)
    real = "/etc/kubernetes/node-feature-discovery/features.d/oci-gpu-hook"
    before = os.path.exists(real) and os.stat(real).st_mtime_ns
    p = hook_cli("--config", f"{root}/config.yaml", "labels")
    assert (p.returncode, p.stdout) == (0, f"{root}/{build.FEATURES_FILE}: written\n"), p.stderr
    assert (os.path.exists(real) and os.stat(real).st_mtime_ns) == before


def test_cli_writes_the_file_once(host, hook_cli, tmp_path):
    out = tmp_path / "nfd" / "oci-gpu-hook"
    out.parent.mkdir()  # NFD's features.d: there where NFD runs
    args = ("--config", f"{host['root']}/config.yaml", "labels", "--output", str(out))
    p = hook_cli(*args)
    assert (p.returncode, p.stdout) == (0, f"{out}: written\n"), p.stderr
    expected = {**expected_common(host, "none", facts=True), **expected_gpu(host, host["gpus"], 1)}
    assert out.read_text() == features.render(expected)
    p = hook_cli(*args)
    assert (p.returncode, p.stdout) == (0, f"{out}: unchanged\n"), p.stderr


def test_cli_with_settings_from_the_config_file(host, hook_cli, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        open(f"{host['root']}/config.yaml").read().replace("node:\n", "node:\n  mig_strategy: mixed\n  replicas: 2\n")
    )
    p = hook_cli("--config", str(config), "labels", "--output", "-")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "nvidia.com/mig.strategy=mixed" in lines
    assert "nvidia.com/gpu.count=8" in lines  # every GPU, as GFD counts them
    assert "nvidia.com/gpu.replicas=2" in lines
    assert "nvidia.com/gpu.product=NVIDIA-A100-SXM4-40GB-SHARED" in lines
    assert "nvidia.com/mig-2g.10gb.count=1" in lines


@pytest.mark.parametrize("node", ["  mig_strategy: bogus\n", "  replicas: 0\n"])
def test_cli_bad_config_is_one_line(host, hook_cli, tmp_path, node):
    config = tmp_path / "config.yaml"
    config.write_text(open(f"{host['root']}/config.yaml").read().replace("node:\n", "node:\n" + node))
    p = hook_cli("--config", str(config), "labels", "--output", "-")
    assert p.returncode != 0
    assert p.stdout == ""
    assert len(p.stderr.splitlines()) == 1, p.stderr
    assert "Traceback" not in p.stderr
    assert p.stderr.startswith(f"oci-gpu-hook: {config}: node.")


def test_cli_single_strategy_error_is_one_line(host, hook_cli, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(open(f"{host['root']}/config.yaml").read().replace("node:\n", "node:\n  mig_strategy: single\n"))
    out = tmp_path / "features"
    p = hook_cli("--config", str(config), "labels", "--output", str(out))
    assert p.returncode != 0
    assert len(p.stderr.splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "flags.migStrategy single needs MIG on every GPU" in p.stderr
    assert not out.exists()
    # The device plugin refuses the same node with the same line: one rule decides for both.
    plugin = hook_cli("--config", str(config), "device-plugin", "--check")
    assert (plugin.returncode, plugin.stderr) == (p.returncode, p.stderr)


def test_the_device_plugins_configuration_is_the_one_source(simulated_host, tmp_path, require):
    """Labels describe what the plugin offers (issue 32): its configuration file's replicas and MIG
    strategy, not node.replicas and node.mig_strategy beside it; `single` with MIG on nowhere
    offers the GPUs, for the labels as for the plugin."""
    require("root", "gcc", "pynvml")
    from oci_gpu_hook.node.plugin import resources

    host = simulated_host(gpus=2)
    plugin_file = tmp_path / "plugin.yaml"
    plugin_file.write_text("version: v1\nflags:\n  migStrategy: single\nsharing:\n  timeSlicing:\n    resources:\n"
                           "    - name: nvidia.com/gpu\n      replicas: 4\n")  # fmt: skip
    config = tmp_path / "config.yaml"
    config.write_text(open(f"{host['root']}/config.yaml").read().replace(
        "node:\n", f"node:\n  device_plugin_config: {plugin_file}\n  replicas: 1\n  mig_strategy: none\n"))  # fmt: skip
    settings = settings_module.load(str(config))
    inventory = inventory_cache.load(settings)
    labels = features.for_node(settings, inventory)
    assert labels["nvidia.com/gpu.replicas"] == "4" and labels["nvidia.com/gpu.product"].endswith("-SHARED")
    assert labels["nvidia.com/mig.strategy"] == "single" and labels["nvidia.com/gpu.count"] == "2"
    offered = resources.resources(inventory, plugin_config.load(str(plugin_file), settings.node), "plugin")
    assert [(r.name, len(r.devices), r.replicas) for r in offered] == [("nvidia.com/gpu", 2 * 4, 4)]


def test_labels_need_no_capability(host, host_settings, tmp_path, require):
    """`labels --watch` needs no capability and no new privileges: run so, it reads the inventory
    the others cache, writes the feature file and beats after every round for its liveness probe.
    (The DaemonSet's labels run as another user too, from the cached inventory alone:
    test_the_labels_pod_writes_as_no_one_on_the_host.)"""
    require("root", "setpriv")
    features_d = tmp_path / "features.d"
    features_d.mkdir(mode=0o755)
    out = features_d / "oci-gpu-hook"
    heartbeat = tmp_path / "beat"
    inventory_cache.load(host_settings)  # the cache, as the pod's privileged containers keep it
    labels = subprocess.Popen(["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--",
                               *hook_command(f"{host['root']}/config.yaml"), "labels", "--watch", "1", "--heartbeat",
                               str(heartbeat), "--output", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60  # a hang guard only
        while not heartbeat.exists():
            assert labels.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        with open(f"/proc/{labels.pid}/status") as f:
            caps = dict(line.split(":\t", 1) for line in f.read().splitlines() if line.startswith("Cap"))
        assert {k: v.strip() for k, v in caps.items() if k != "CapAmb"} == {
            "CapInh": "0000000000000000", "CapPrm": "0000000000000000", "CapEff": "0000000000000000",
            "CapBnd": "0000000000000000"}  # fmt: skip
        first = heartbeat.stat().st_mtime_ns
        while heartbeat.stat().st_mtime_ns == first:  # the next round beats too
            assert labels.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        labels.terminate()
        output = labels.communicate(timeout=60)[0]
    expected = {**expected_common(host, "none", facts=True), **expected_gpu(host, host["gpus"], 1)}
    assert out.read_text() == features.render(expected), output
    assert f"{out}: labels written" in output and "Traceback" not in output


def test_heartbeat_needs_watch(host, hook_cli, tmp_path):
    p = hook_cli("--config", f"{host['root']}/config.yaml", "labels", "--heartbeat", str(tmp_path / "beat"))
    assert p.returncode == 2 and p.stderr.strip().endswith("--heartbeat needs --watch: a single run has no rounds "
                                                           "to beat"), p.stderr  # fmt: skip
    assert not (tmp_path / "beat").exists()


def test_product_names_as_gfd_writes_them():
    """GFD leaves out what a label cannot hold and makes the spaces dashes."""
    assert [features.product(m) for m in ("NVIDIA A100-SXM4-40GB", "Tesla  T4", "NVIDIA RTX A6000 (rev/2)")] == [
        "NVIDIA-A100-SXM4-40GB", "Tesla-T4", "NVIDIA-RTX-A6000-rev2"]  # fmt: skip


def _pci_config(capability: bytes | None, status: int = 0x10) -> bytes:
    """A 256-byte PCI configuration space (as root reads it from sysfs) whose capability list holds
    a power-management capability at 0x60 and, when given, a vendor-specific one at 0xd0."""
    config = bytearray(256)
    config[0:2] = b"\xde\x10"  # NVIDIA's vendor id
    config[0x06] = status
    config[0x34] = 0x60
    config[0x60:0x62] = bytes([0x01, 0xD0 if capability else 0x00])
    if capability:
        config[0xD0 : 0xD0 + len(capability)] = capability
    return bytes(config)


# NVIDIA's vGPU capability: id 0x09, next 0, length 27, "VF", the host driver record (id 0, then
# a length byte) with the host's driver version and branch, 10 bytes each.
VGPU_CAPABILITY = (
    bytes([0x09, 0x00, 27]) + b"VF" + b"\x00\x16" + b"460.16".ljust(10, b"\0") + b"r460_00".ljust(10, b"\0")
)


def _as_gfd_reads_sysfs(sys_root: str, gpus) -> dict:
    """gpu.mode and vgpu.* by GFD's rules, worked out here from each GPU's PCI configuration space
    (not from the code under test): the class code in bytes 0x09-0x0b (base class, subclass,
    interface); the capability list from the pointer at 0x34 (each entry: id, next, length), where
    NVIDIA's vendor-specific capability (id 0x09) with "VF" at its bytes 3 and 4 marks a vGPU, and
    its record 0, from byte 5, holds the host driver's version and branch (10 bytes each)."""
    classes, found = set(), {}
    for gpu in gpus:
        with open(f"{sys_root}/sys/bus/pci/devices/{gpu['bus_id']}/config", "rb") as f:
            space = f.read()
        classes.add(space[0x0B] << 16 | space[0x0A] << 8 | space[0x09])
        at = space[0x34]
        while at:
            if space[at] == 0x09 and space[at + 3 : at + 5] == b"VF" and space[at + 5] == 0:
                strings = space[at + 7 : at + 7 + 20]
                found = {"nvidia.com/vgpu.present": "true",
                         "nvidia.com/vgpu.host-driver-version": strings[:10].rstrip(b"\0").decode(),
                         "nvidia.com/vgpu.host-driver-branch": strings[10:].rstrip(b"\0").decode()}  # fmt: skip
            at = space[at + 1]
    mode = {0x030000: "graphics", 0x030200: "compute"}.get(classes.pop(), "unknown") if len(classes) == 1 else "unknown"
    return {"nvidia.com/gpu.mode": mode, **(found or {"nvidia.com/vgpu.present": "false"})}


SIMULATED_PCI = {
    "3D controllers, bare metal": {"gpus": 2},
    "display mode": {"gpus": 2, "graphics": [0, 1]},
    "one GPU in display mode": {"gpus": 2, "graphics": [1]},
    "vGPU guest": {"gpus": 2, "model": "l4", "vgpu_host_driver": ("550.54.16", "r551_40")},
}


@pytest.mark.parametrize("case", SIMULATED_PCI)
def test_gpu_mode_and_vgpu_labels_are_gfds_on_the_simulated_sysfs(simulated_host, tmp_path, case):
    """On a simulated host, gpu.mode and vgpu.* are what GFD's rules give from the PCI
    configuration space the simulator wrote, and what the host was described with. Where a GPU
    lacks sysfs's `resource`, which GFD's PCI reader needs, the mode is unknown, as GFD's is; where
    a space reads short (no CAP_SYS_ADMIN), no vgpu.* label is written (GFD fails)."""
    from hookcheck import expected_pci_labels

    one = simulated_host(**SIMULATED_PCI[case])
    s = settings_module.load(f"{one['root']}/config.yaml")
    inventory = inventory_cache.load(s)
    labels = features.for_node(s, inventory)
    expected = _as_gfd_reads_sysfs(one["root"], one["gpus"])
    assert {k: labels.get(k) for k in expected} == expected == expected_pci_labels(one)
    assert {k for k in labels if k.startswith("nvidia.com/vgpu.")} == set(expected) - {"nvidia.com/gpu.mode"}
    assert expected["nvidia.com/gpu.mode"] == {"display mode": "graphics", "one GPU in display mode": "unknown"}.get(
        case, "compute")  # fmt: skip
    sys_root = tmp_path / "sys-root"
    shutil.copytree(f"{one['root']}/sys", sys_root / "sys", symlinks=True)
    first = sys_root / "sys" / "bus" / "pci" / "devices" / one["gpus"][0]["bus_id"]
    (first / "resource").unlink()
    facts = features.host_facts(str(sys_root), inventory)
    assert features.compute(inventory, plugin(), host=facts)["nvidia.com/gpu.mode"] == "unknown"
    assert facts.vgpu == {k[len("nvidia.com/") :]: v for k, v in expected.items() if "vgpu" in k}
    config = (first / "config").read_bytes()
    (first / "config").write_bytes(config[:64])
    assert features.host_facts(str(sys_root), inventory).vgpu == {}


def test_vgpu_labels_from_the_pci_configuration_space(host, inventory, tmp_path):
    """vgpu.present and the host's driver version and branch, where a GPU's vendor-specific PCI
    capability carries NVIDIA's vGPU signature (a vGPU guest); vgpu.present=false on bare metal,
    every NVIDIA GPU's space read whole and none with the signature (no capability list, another
    vendor's capability, a list that loops); nothing where a space was read short (no
    CAP_SYS_ADMIN) or a GPU's vendor cannot be read, where GFD fails."""
    sys_root = tmp_path / "sysroot"
    first, second = inventory.gpus[0].bus_id, inventory.gpus[1].bus_id
    bare_metal = {"vgpu.present": "false"}

    def device(bus_id, config, vendor="0x10de"):
        d = sys_root / "sys" / "bus" / "pci" / "devices" / bus_id
        d.mkdir(parents=True, exist_ok=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text("0x030200\n")
        (d / "config").write_bytes(config)

    device(first, _pci_config(None))
    assert features.host_facts(str(sys_root), inventory).vgpu == {}  # the other GPUs' vendor unread
    for gpu in inventory.gpus[1:]:
        device(gpu.bus_id, _pci_config(None))
    assert features.host_facts(str(sys_root), inventory).vgpu == bare_metal
    labels = features.compute(inventory, plugin(), host=features.host_facts(str(sys_root), inventory))
    assert labels["nvidia.com/vgpu.present"] == "false" and "nvidia.com/vgpu.host-driver-version" not in labels
    device(second, _pci_config(VGPU_CAPABILITY))
    expected = {"vgpu.present": "true", "vgpu.host-driver-version": "460.16", "vgpu.host-driver-branch": "r460_00"}
    facts = features.host_facts(str(sys_root), inventory)
    assert facts.vgpu == expected
    labels = features.compute(inventory, plugin(), host=facts)
    assert {k: labels["nvidia.com/" + k] for k in expected} == expected
    device(second, _pci_config(VGPU_CAPABILITY)[:64])  # read without CAP_SYS_ADMIN
    assert features.host_facts(str(sys_root), inventory).vgpu == {}
    device(second, _pci_config(VGPU_CAPABILITY, status=0))  # no capability list
    assert features.host_facts(str(sys_root), inventory).vgpu == bare_metal
    device(second, _pci_config(bytes([0x09, 0x00, 8]) + b"XY\0\0\0"))  # another vendor's capability
    assert features.host_facts(str(sys_root), inventory).vgpu == bare_metal
    device(second, _pci_config(VGPU_CAPABILITY), vendor="0x8086")  # not NVIDIA's device: not looked at
    assert features.host_facts(str(sys_root), inventory).vgpu == bare_metal
    looped = bytearray(_pci_config(None))
    looped[0x61] = 0x60  # a capability list that loops ends
    device(second, bytes(looped))
    assert features.host_facts(str(sys_root), inventory).vgpu == bare_metal
