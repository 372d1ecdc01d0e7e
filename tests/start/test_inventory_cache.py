"""The inventory cache: used while it matches the host, rebuilt when the host changes."""

import json
import os

from oci_gpu_hook.start import inventory_cache, settings
from oci_gpu_hook.toolkit.simulate import simulate


def host_settings(tmp_path, require, **options):
    require("root", "gcc", "pynvml")
    host = simulate(str(tmp_path / "s"), **options)
    return host, settings.load(f"{host['root']}/config.yaml")


def test_refresh_then_load_uses_the_cache(tmp_path, require):
    host, s = host_settings(tmp_path, require, gpus=2)
    fresh = inventory_cache.refresh(s)
    assert os.path.exists(s.inventory_cache)
    assert inventory_cache.read(s) == fresh
    doc = json.load(open(s.inventory_cache))
    assert doc["inventory"]["gpus"][0]["uuid"] == host["gpus"][0]["uuid"]


def test_stale_when_a_device_node_or_the_driver_changes(tmp_path, require):
    host, s = host_settings(tmp_path, require, gpus=2)
    inventory_cache.refresh(s)
    os.unlink(f"{host['root']}/dev/nvidia1")
    assert inventory_cache.read(s) is None
    rebuilt = inventory_cache.load(s)
    assert rebuilt.gpus[1].node.problem == "missing"
    assert inventory_cache.read(s) == rebuilt  # load() wrote the new one
    version = f"{host['root']}/proc/driver/nvidia/version"
    text = open(version).read()
    os.chmod(version, 0o644)
    open(version, "w").write(text.replace("550.54.15", "550.54.16"))
    assert inventory_cache.read(s) is None


def test_stale_when_nvidia_drm_comes_or_goes(tmp_path, require):
    """The DRM nodes are in the inventory: loading or unloading nvidia-drm makes the cache stale."""
    import shutil

    host, s = host_settings(tmp_path, require, gpus=1)
    assert inventory_cache.refresh(s).gpus[0].dri
    shutil.rmtree(f"{host['root']}/dev/dri/by-path")
    assert inventory_cache.read(s) is None
    assert inventory_cache.load(s).gpus[0].dri == ()


def test_torn_or_foreign_cache_is_ignored(tmp_path, require):
    host, s = host_settings(tmp_path, require, gpus=1)
    inventory_cache.refresh(s)
    data = open(s.inventory_cache).read()
    open(s.inventory_cache, "w").write(data[: len(data) // 2])
    assert inventory_cache.read(s) is None
    open(s.inventory_cache, "w").write(json.dumps({"format": 99}))
    assert inventory_cache.read(s) is None
    assert inventory_cache.load(s).gpus[0].uuid == host["gpus"][0]["uuid"]


def test_refresh_command(tmp_path, require, hook_cli):
    host, s = host_settings(tmp_path, require, gpus=2)
    out = hook_cli("--config", f"{host['root']}/config.yaml", "inventory", "refresh")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{s.inventory_cache}: driver 550.54.15, 2 GPU(s)")
    leftovers = [n for n in os.listdir(os.path.dirname(s.inventory_cache)) if n.endswith(".tmp")]
    assert leftovers == []
