"""Untrusted caches: the inventory cache and the compiled settings decide where mounts come from,
so the hook uses them only when they are regular files of its own user that no one else may
write (settings.read_trusted, checked on the descriptor it reads). Anything else at their path (a
file of another user, one writable by group or world, a symlink, a FIFO, a directory) counts as
stale: ignored and rebuilt, never followed or waited on.

Each forged file here keeps the real fingerprint, so it would be used were it trusted
(test_a_trusted_forgery_is_used shows it is), and points the driver's libraries at /etc/shadow.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading

import hookcheck
import pytest

from oci_gpu_hook.start import inventory_cache, settings
from oci_gpu_hook.toolkit.containers import hook_command

pytestmark = pytest.mark.host(gpus=2, mig=[1])

NOBODY = 65534
FORGED = "/etc/shadow"


@pytest.fixture
def config(host, tmp_path):
    """The simulated host's configuration with an inventory cache of this test's own, in a
    directory like /run/oci-gpu-hook (root's, 0755)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    text = open(f"{host['root']}/config.yaml").read()
    text = text.replace(f"{host['root']}/inventory-cache.json", str(run / "inventory.json"))
    text = text.replace(f"{host['root']}/hook.log", str(tmp_path / "hook.log"))
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


@pytest.fixture
def bundle(tmp_path):
    from oci_gpu_hook.toolkit import containers

    path = tmp_path / "bundle"
    path.mkdir()
    containers.write_config(str(path), args=["true"], env={"NVIDIA_VISIBLE_DEVICES": "0"}, config_file=None)
    return str(path)


def forged_cache(loaded) -> bytes:
    """A cache that matches the host's fingerprint but says the driver lives at / and its
    libraries are /etc/shadow."""
    real = inventory_cache.refresh(loaded)
    doc = {"format": inventory_cache.FORMAT, "fingerprint": inventory_cache.fingerprint(loaded),
           "inventory": real.to_json()}  # fmt: skip
    doc["inventory"]["driver_root"] = "/"
    for entry in doc["inventory"]["files"]:
        if entry["kind"] == "library":
            entry["path"] = FORGED
    os.unlink(loaded.inventory_cache)
    return json.dumps(doc).encode()


def plant(kind: str, path: str, forged: bytes, tmp_path) -> None:
    if kind == "symlink":
        # The link's target is a file the hook would trust; the link itself it must not follow.
        target = tmp_path / "trusted-elsewhere.json"
        target.write_bytes(forged)
        os.chmod(target, 0o644)
        os.symlink(target, path)
    elif kind == "fifo":
        os.mkfifo(path, 0o644)
    elif kind == "directory":
        os.mkdir(path, 0o755)
    else:
        with open(path, "wb") as f:
            f.write(forged)
        os.chmod(path, {"group-writable": 0o664, "world-writable": 0o646}.get(kind, 0o644))
        if kind == "other-owner":
            os.chown(path, NOBODY, NOBODY)


def plan(config: str, bundle: str, planted: str = "trusted"):
    """The plan JSON of `oci-gpu-hook plan --bundle --json`, as root runs it. A run still going
    after 60 s (a generous bound: a blocked open of a FIFO never returns) fails the test."""
    argv = [*hook_command(config), "plan", "--bundle", bundle, "--json"]
    try:
        out = subprocess.run(argv, capture_output=True, env=hookcheck.HOOK_ENV, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`plan` was still running after 60 s: the hook waited on the {planted} cache")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def sources(doc) -> list[str]:
    return [op["source"] for op in doc["operations"] if "source" in op]


def test_a_trusted_forgery_is_used(config, bundle, tmp_path, require):
    """The control: planted as root's own 0644 file, the forgery does reach the plan."""
    require("root")
    loaded = settings.load(config)
    plant("trusted", loaded.inventory_cache, forged_cache(loaded), tmp_path)
    doc = plan(config, bundle)
    assert FORGED in sources(doc)


UNTRUSTED = ["other-owner", "group-writable", "world-writable", "symlink", "fifo", "directory"]


@pytest.mark.parametrize("kind", UNTRUSTED)
def test_untrusted_inventory_cache_is_rediscovered(kind, config, bundle, host, tmp_path, require):
    require("root")
    loaded = settings.load(config)
    path = loaded.inventory_cache
    plant(kind, path, forged_cache(loaded), tmp_path)
    doc = plan(config, bundle, kind)  # a hook that waited on a FIFO would never finish
    found = sources(doc)
    assert found and FORGED not in found
    outside = [s for s in found if not s.startswith(host["root"] + "/")]
    assert not outside, f"sources outside the simulated host: {outside[:3]}"
    if kind == "directory":
        assert os.path.isdir(path)  # nothing renames over a directory: rediscovered every time
        return
    # The rewrite replaced whatever was there (not what a link pointed to) with the hook's own.
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o644
    assert inventory_cache.read(loaded).driver_root == host["root"]
    if kind == "symlink":
        assert FORGED in (tmp_path / "trusted-elsewhere.json").read_text()


@pytest.mark.parametrize("kind", UNTRUSTED)
def test_untrusted_inventory_cache_in_process(kind, config, host, tmp_path, require):
    """The hook's own path (inventory_cache.load), as prestart calls it."""
    require("root")
    loaded = settings.load(config)
    plant(kind, loaded.inventory_cache, forged_cache(loaded), tmp_path)
    assert call_bounded(lambda: inventory_cache.read(loaded), loaded.inventory_cache) is None
    inventory = call_bounded(lambda: inventory_cache.load(loaded), loaded.inventory_cache)
    assert inventory.driver_root == host["root"]
    assert FORGED not in [f.path for f in inventory.files]


def call_bounded(function, fifo_path: str, seconds: float = 60):
    """function() in a thread; a FIFO open that blocks past `seconds` (a generous bound: such an
    open never returns by itself) is unblocked and fails the test."""
    result = []
    worker = threading.Thread(target=lambda: result.append(function()), daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        try:  # a writer lets the blocked open return, so the thread ends
            os.close(os.open(fifo_path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        pytest.fail(f"blocked for {seconds} s opening {fifo_path}")
    return result[0]


# --- the compiled settings: the same check -------------------------------------------------------


@pytest.mark.parametrize("kind", UNTRUSTED)
def test_untrusted_compiled_settings_are_ignored(kind, tmp_path, require):
    require("root")
    path = tmp_path / "config.yaml"
    path.write_text("driver_root: /real\n")
    assert settings.load(str(path), environ={}, cache=True).driver_root == "/real"
    compiled = settings.compiled_path(str(path))
    doc = json.load(open(compiled))
    doc["settings"]["driver_root"] = "/forged"
    os.unlink(compiled)
    plant(kind, compiled, json.dumps(doc).encode(), tmp_path)
    loaded = call_bounded(lambda: settings.load(str(path), environ={}, cache=True), compiled)
    assert loaded.driver_root == "/real"


def test_trusted_compiled_settings_are_used(tmp_path, require):
    """The control for the case above: the same forgery as root's own 0644 file is read."""
    require("root")
    path = tmp_path / "config.yaml"
    path.write_text("driver_root: /real\n")
    settings.load(str(path), environ={}, cache=True)
    compiled = settings.compiled_path(str(path))
    doc = json.load(open(compiled))
    doc["settings"]["driver_root"] = "/forged"
    os.unlink(compiled)
    plant("trusted", compiled, json.dumps(doc).encode(), tmp_path)
    assert settings.load(str(path), environ={}, cache=True).driver_root == "/forged"
