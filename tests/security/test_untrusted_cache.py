"""Untrusted caches: the inventory cache and the compiled settings decide where mounts come from,
so the hook uses them only when they are regular files of its own uid (settings.CACHE_UID, for a
hook running as root) that no one else may write (settings.read_trusted, checked on the
descriptor it reads). Anything else at their path (a file of another user, or of root's, which a
uid 0 without capabilities may have written; one writable by group or world, a symlink, a FIFO,
a directory) counts as stale: ignored and rebuilt, never followed or waited on.

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
        os.chown(target, settings.CACHE_UID, -1)
        os.symlink(target, path)
    elif kind == "fifo":
        os.mkfifo(path, 0o644)
    elif kind == "directory":
        os.mkdir(path, 0o755)
    else:
        with open(path, "wb") as f:
            f.write(forged)
        os.chmod(path, {"group-writable": 0o664, "world-writable": 0o646}.get(kind, 0o644))
        # The hook's own uid, as the hook leaves it; root's own is what a uid 0 without
        # capabilities can make (test_*_by_a_uid_0_without_capabilities_*).
        owner = {"other-owner": NOBODY, "root-owned": 0}.get(kind, settings.CACHE_UID)
        os.chown(path, owner, -1)


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
    """The control: planted as the hook's own 0644 file (CACHE_UID's), the forgery does reach the
    plan."""
    require("root")
    loaded = settings.load(config)
    plant("trusted", loaded.inventory_cache, forged_cache(loaded), tmp_path)
    doc = plan(config, bundle)
    assert FORGED in sources(doc)


UNTRUSTED = ["other-owner", "root-owned", "group-writable", "world-writable", "symlink", "fifo", "directory"]


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
    assert stat.S_ISREG(st.st_mode) and st.st_uid == settings.CACHE_UID and stat.S_IMODE(st.st_mode) == 0o644
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
    """The control for the case above: the same forgery as the hook's own 0644 file is read."""
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


# --- a uid 0 without capabilities (issue 46, item 2) ---------------------------------------------
#
# A process of uid 0 in the host's user namespace with every capability dropped (the DaemonSet's
# labels container; any root pod given a hostPath of / "read-only", whose /run stays writable) is
# still the owner of every file of root's: it may rewrite them, chmod them, and make new ones in
# root's directories. It must not be able to make the hook use what it wrote.

AS_A_STRANGER = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--"]

# argv: the file to forge, its forged text; then the files (path, text) it makes beside, as its own.
# The copy is rewritten where it stands (owner, mode and name kept) where the stranger may write
# it; else replaced by a file of its own (root's, 0644) renamed over it.
STRANGER = r"""
import os, sys
with open("/proc/self/status") as f:
    assert os.geteuid() == 0 and "CapEff:\t0000000000000000" in f.read(), "not a uid 0 without capabilities"
path, forged, made = sys.argv[1], sys.argv[2].encode(), sys.argv[3:]
for name, text in zip(made[::2], made[1::2]):
    os.makedirs(os.path.dirname(name), exist_ok=True)
    with open(name, "w") as f:
        f.write(text)
try:
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
except PermissionError:
    with open(path + ".new", "wb") as f:
        f.write(forged)
    os.chmod(path + ".new", 0o644)
    os.rename(path + ".new", path)
    print("replaced")
else:
    os.write(fd, forged)
    os.close(fd)
    print("rewritten")
"""


def as_a_stranger(path: str, forged: bytes, made: dict | None = None) -> str:
    """How a uid 0 without capabilities forged path: "rewritten" or "replaced"."""
    import sys

    argv = [*AS_A_STRANGER, sys.executable, "-I", "-c", STRANGER, path, forged.decode()]
    for name, text in (made or {}).items():
        argv += [name, text]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    st = os.lstat(path)
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o644  # what an owner check sees: root's own
    return done.stdout.strip()


def test_an_inventory_cache_forged_by_a_uid_0_without_capabilities_is_not_used(config, bundle, host, tmp_path,
                                                                                 require):  # fmt: skip
    """The hook's cache, its libraries pointed at a library the stranger made in the run directory
    (a file of root's, which the mount-source walk takes): `plan` (the hook's own decision) mounts
    what the host has."""
    require("root", "setpriv")
    loaded = settings.load(config)
    inventory_cache.refresh(loaded)  # the hook's own, as a start or `inventory refresh` keeps it
    evil = os.path.join(os.path.dirname(loaded.inventory_cache), "evil", "libcuda.so.1")
    doc = json.loads(open(loaded.inventory_cache).read())
    doc["inventory"]["driver_root"] = "/"  # the libraries' paths are the host's own
    for entry in doc["inventory"]["files"]:
        if entry["kind"] == "library":
            entry["path"] = evil
    assert inventory_cache.fingerprint(loaded) == doc["fingerprint"]  # fresh: it would be used
    # The hook's own file is not the stranger's to write (before the fix, root's was rewritten).
    assert as_a_stranger(loaded.inventory_cache, json.dumps(doc).encode(), {evil: "not NVIDIA's"}) == "replaced"
    found = sources(plan(config, bundle))
    assert found and evil not in found
    outside = [s for s in found if not s.startswith(host["root"] + "/")]
    assert not outside, f"sources outside the simulated host: {outside[:3]}"


def test_compiled_settings_forged_by_a_uid_0_without_capabilities_are_not_used(tmp_path, require):
    """In process, as the hook loads them (the run directory is the test's: conftest.py)."""
    require("root", "setpriv")
    path = tmp_path / "config.yaml"
    path.write_text("driver_root: /real\naccept_envvar_when_unprivileged: false\n")
    settings.load(str(path), environ={}, cache=True)
    compiled = settings.compiled_path(str(path))
    doc = json.load(open(compiled))
    doc["settings"].update(driver_root=str(tmp_path / "evil"), accept_envvar_when_unprivileged=True)
    assert as_a_stranger(compiled, json.dumps(doc).encode()) == "replaced"
    loaded = settings.load(str(path), environ={}, cache=True)
    assert (loaded.driver_root, loaded.accept_envvar_when_unprivileged) == ("/real", False)
    assert os.stat(compiled).st_uid == settings.CACHE_UID  # the hook's own again, from the source


# In a private mount namespace with a tmpfs of its own on /run: the hook started as a runtime
# starts it, twice; between the starts, the stranger forges the compiled copy the first kept.
FORGED_BETWEEN_STARTS = r"""
import json, os, subprocess, sys

from oci_gpu_hook.start import settings
from oci_gpu_hook.toolkit.containers import hook_command

config, stranger, first, second = sys.argv[1:]
subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "oci-gpu-hook-test-run", "/run"], check=True)
hook = [*hook_command(config), "prestart"]
env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
report = {"first": subprocess.run(hook, input=first, capture_output=True, text=True, env=env).returncode}
compiled = settings.compiled_path(config)
doc = json.load(open(compiled))
doc["settings"]["accept_envvar_when_unprivileged"] = True
done = subprocess.run([*json.loads(stranger), compiled, json.dumps(doc)], capture_output=True, text=True)
report["stranger"] = [done.returncode, done.stdout.strip(), done.stderr[-2000:]]
st = os.lstat(compiled)
report["forged"] = [st.st_uid, st.st_mode & 0o7777]
report["second"] = subprocess.run(hook, input=second, capture_output=True, text=True, env=env).returncode
report["after"] = os.lstat(compiled).st_uid
json.dump(report, sys.stdout)
"""


def test_a_strict_configuration_holds_against_a_forged_compiled_copy(live_container, tmp_path, require):
    """The attack as it was found: under a configuration that takes NVIDIA_VISIBLE_DEVICES from
    privileged containers only, the stranger rewrote the compiled copy the hook kept (same key,
    root's, 0644) to take it from every container, and the next unprivileged container asking for
    GPU 0 got /dev/nvidia0. Now the second start parses the source, as the first did."""
    import sys

    import yaml

    require("root", "unshare", "setpriv")
    first, first_bundle, first_pid, _, host = live_container({"NVIDIA_VISIBLE_DEVICES": "0"})
    second, second_bundle, second_pid, _, _ = live_container({"NVIDIA_VISIBLE_DEVICES": "0"})
    with open(f"{host['root']}/config.yaml") as f:
        doc = yaml.safe_load(f)
    doc.update(accept_envvar_when_unprivileged=False, inventory_cache=str(tmp_path / "inventory.json"),
               records_directory=str(tmp_path / "records"))  # fmt: skip
    doc["logging"]["file"] = str(tmp_path / "hook.log")
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(doc))
    stranger = [*AS_A_STRANGER, sys.executable, "-I", "-c", STRANGER]
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-I", "-c",
                           FORGED_BETWEEN_STARTS, str(config), json.dumps(stranger), first, second],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["first"] == 0 and report["second"] == 0, report
    assert report["stranger"][:2] == [0, "replaced"] and report["forged"] == [0, 0o644], report
    assert report["after"] == settings.CACHE_UID  # the second start kept the source's copy again
    # In each container's mount namespace (hookcheck.hold_namespace), its rootfs as the hook left it.
    assert not os.path.exists(f"/proc/{first_pid}/root{first_bundle}/rootfs/dev/nvidia0")  # strict
    given = os.path.exists(f"/proc/{second_pid}/root{second_bundle}/rootfs/dev/nvidia0")
    assert not given, f"the forged copy was used: {report}"
    log = tmp_path / "hook.log"
    assert not log.exists() or "GPU devices configured" not in log.read_text()
