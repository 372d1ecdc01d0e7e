"""doctor on a simulated host: healthy gives no FAIL; each broken variant gives exactly its FAIL."""

import json
import os

import pytest

from oci_gpu_hook import doctor, install, inventory_cache, labels, settings
from oci_gpu_hook.errors import HookError

V1_MOUNTINFO = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "40 31 0:37 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices\n"
)
HOOKS_FILE = "/etc/containers/oci/hooks.d/oci-gpu-hook.json"
CRIO_CONF = '[crio.runtime]\nhooks_dir = ["/usr/share/containers/oci/hooks.d"]\n'
V2_MOUNTINFO = "31 23 0:28 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n"


@pytest.fixture
def setup(fresh_host, tmp_path, monkeypatch):
    """(host summary, settings, root tree with the hook installed, mountinfo path); SELinux off."""
    monkeypatch.setattr(labels, "selinux_enabled", lambda: False)
    host = fresh_host()
    root = tmp_path / "root"
    root.mkdir()
    install.install(str(root), ("podman",))
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(V1_MOUNTINFO)
    config = settings.load(os.path.join(host["root"], "config.yaml"))
    inventory_cache.refresh(config)
    return host, config, str(root), str(mountinfo)


def run(config, root, mountinfo, **options):
    return doctor.run(config, root, mountinfo=mountinfo, **options)


def failures(checks):
    return [(c.id, c.summary) for c in checks if c.status == doctor.FAIL]


def test_a_healthy_simulated_host_passes(setup):
    host, config, root, mountinfo = setup
    checks = run(config, root, mountinfo)
    assert failures(checks) == []
    assert doctor.worst(checks) == doctor.PASS, [(c.id, c.status, c.summary) for c in checks]
    assert len(checks) >= 12 and all(c.summary and "\n" not in c.summary for c in checks)


def _unlink(path):
    os.unlink(path)


def _wrong_major(path):
    os.unlink(path)
    os.mknod(path, 0o666 | 0o020000, os.makedev(1, 3))


def _rewrite(path, old, new):
    with open(path) as f:
        text = f.read()
    assert old in text
    with open(path, "w") as f:
        f.write(text.replace(old, new))


def _drop_lines(path, word):
    with open(path) as f:
        lines = f.readlines()
    with open(path, "w") as f:
        f.writelines(line for line in lines if word not in line)


def _gpu_node(host, index):
    return os.path.join(host["root"], "dev", f"nvidia{host['gpus'][index]['minor']}")


# (name, break(host, root, tmp), the check that must FAIL, words its summary must hold)
VARIANTS = [
    ("missing node", lambda h, r, t: _unlink(_gpu_node(h, 1)), "device-nodes", "missing"),
    ("wrong major", lambda h, r, t: _wrong_major(_gpu_node(h, 0)), "device-nodes", "expected 195:"),
    ("missing MIG cap node",
     lambda h, r, t: _unlink(f"{h['root']}/dev/nvidia-caps/nvidia-cap{h['gpus'][1]['mig'][0]['ci_cap_minor']}"),
     "device-nodes", "nvidia-cap"),
    ("library version mismatch",
     lambda h, r, t: _rewrite(h["root"] + "/proc/driver/nvidia/version", h["driver_version"], "550.54.16"),
     "libraries", "version mismatch"),
    ("driver not loaded", lambda h, r, t: _unlink(h["root"] + "/proc/driver/nvidia/version"), "driver", "not loaded"),
    ("nvidia-uvm not loaded", lambda h, r, t: _drop_lines(h["root"] + "/proc/devices", "nvidia-uvm"), "uvm",
     "not loaded"),
    ("no ld.so.cache", lambda h, r, t: _unlink(h["root"] + "/etc/ld.so.cache"), "ldcache", "missing"),
    ("no hooks.d file", lambda h, r, t: install.uninstall(r), "hooks-d", "no hooks.d file"),
    ("hooks.d file without a hook",
     lambda h, r, t: _rewrite(r + HOOKS_FILE, '"path": "', '"path": "/nonexistent'),
     "hooks-d", "not an executable"),
    ("CRI-O without our hooks_dir",
     lambda h, r, t: (os.makedirs(r + "/etc/crio"), open(r + "/etc/crio/crio.conf", "w").write(CRIO_CONF)),
     "crio", "hooks_dir"),
]  # fmt: skip


@pytest.mark.parametrize("name, breaker, check_id, words", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_each_broken_variant_gives_exactly_its_fail(setup, tmp_path, name, breaker, check_id, words):
    host, config, root, mountinfo = setup
    breaker(host, root, tmp_path)
    # The inventory cache is a check of its own: keep it in step with the broken host.
    try:
        inventory_cache.refresh(config)
    except HookError:
        os.unlink(config.inventory_cache)
    found = failures(run(config, root, mountinfo))
    assert [f[0] for f in found] == [check_id], found
    assert words in found[0][1]


def test_stale_inventory_cache(setup):
    host, config, root, mountinfo = setup
    cache = os.path.join(host["root"], "etc/ld.so.cache")
    st = os.stat(cache)
    os.utime(cache, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as after an ldconfig run
    found = failures(run(config, root, mountinfo))
    assert [f[0] for f in found] == ["inventory-cache"] and "stale" in found[0][1]


def test_cgroup_setting_that_does_not_match_the_host(setup, tmp_path):
    host, config, root, _ = setup
    v2 = tmp_path / "mountinfo-v2"
    v2.write_text(V2_MOUNTINFO)
    assert failures(run(config, root, str(v2))) == []  # auto follows the host
    found = failures(run(config.replace(cgroups="v1"), root, str(v2)))
    assert [f[0] for f in found] == ["cgroups"] and "cgroups: v1" in found[0][1]


def test_invalid_configuration_fails_once_and_skips_host_checks(setup):
    _, _, root, mountinfo = setup
    checks = run(settings.Settings(), root, mountinfo, config_error='config.yaml: cgroups: "x" is not accepted')
    assert [f[0] for f in failures(checks)] == ["config"]


@pytest.fixture
def selinuxfs(setup, monkeypatch):
    host, config, root, mountinfo = setup
    monkeypatch.setattr(labels, "selinux_enabled", lambda: True)  # the one kernel query tests stand in for
    fs = os.path.join(root, "sys/fs/selinux")
    os.makedirs(os.path.join(fs, "booleans"))
    for name in doctor.SELINUX_BOOLEANS:
        with open(os.path.join(fs, "booleans", name), "w") as f:
            f.write("0 0")
    with open(os.path.join(fs, "enforce"), "w") as f:
        f.write("1")
    return fs


def test_selinux_enforcing_without_module_or_boolean(setup, selinuxfs):
    _, config, root, mountinfo = setup
    found = failures(run(config, root, mountinfo))
    assert [f[0] for f in found] == ["selinux-policy"] and "cannot open /dev/nvidia" in found[0][1]


def test_selinux_boolean_or_module_is_enough(setup, selinuxfs):
    _, config, root, mountinfo = setup
    with open(os.path.join(selinuxfs, "booleans", "container_use_xserver_devices"), "w") as f:
        f.write("1 1")
    assert failures(run(config, root, mountinfo)) == []
    with open(os.path.join(selinuxfs, "booleans", "container_use_xserver_devices"), "w") as f:
        f.write("0 0")
    os.makedirs(os.path.join(root, "var/lib/selinux/targeted/active/modules/400/oci_gpu_hook"))
    checks = run(config, root, mountinfo)
    assert failures(checks) == []
    with open(os.path.join(selinuxfs, "enforce"), "w") as f:
        f.write("0")
    assert [c.status for c in run(config, root, mountinfo) if c.id == "selinux"] == [doctor.WARN]


def test_cli_json_and_exit_status(setup, hook_cli):
    host, config, root, _ = setup
    out = hook_cli("--config", os.path.join(host["root"], "config.yaml"), "doctor", "--json", "--root", root)
    doc = json.loads(out.stdout)
    assert out.returncode == doctor.EXIT_STATUS[doc["worst"]], out.stderr
    assert {c["id"] for c in doc["checks"]} >= {"driver", "device-nodes", "hooks-d", "inventory-cache"}
    assert all(set(c) == {"id", "status", "summary", "fix"} for c in doc["checks"])
    os.unlink(_gpu_node(host, 1))
    text = hook_cli("--config", os.path.join(host["root"], "config.yaml"), "doctor", "--root", root)
    assert text.returncode == 2
    assert any(line.startswith("FAIL  device-nodes") for line in text.stdout.splitlines())
    assert "fix: " in text.stdout
