"""doctor on a simulated host: healthy gives no FAIL; each broken variant gives exactly its FAIL."""

import json
import os
import re
import sys

import pytest

from oci_gpu_hook.errors import HookError
from oci_gpu_hook.start import inventory_cache, settings
from oci_gpu_hook.start.linux import labels
from oci_gpu_hook.toolkit import doctor, install, runtime_config

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


def test_inventory_cache_the_hook_would_ignore(setup):
    """Fresh but writable by others: the hook rediscovers every time, so doctor says so."""
    host, config, root, mountinfo = setup
    os.chmod(config.inventory_cache, 0o666)
    found = failures(run(config, root, mountinfo))
    assert [f[0] for f in found] == ["inventory-cache"] and "unusable" in found[0][1], found


def test_an_inventory_cache_of_roots_is_one_the_hook_ignores(setup, require):
    """Root's own file, as the cache was before issue 46 (and as a uid 0 without capabilities can
    write it): the hook takes only settings.CACHE_UID's, so doctor says FAIL with the refresh
    that makes it so; after it, PASS."""
    require("root")
    host, config, root, mountinfo = setup
    os.chown(config.inventory_cache, 0, -1)
    found = [c for c in run(config, root, mountinfo) if c.id == "inventory-cache"]
    assert [c.status for c in found] == [doctor.FAIL], found
    assert f"owned by uid 0 with mode 0644: only a file of uid {settings.CACHE_UID}" in found[0].summary
    assert found[0].fix == "oci-gpu-hook inventory refresh"
    inventory_cache.refresh(config)  # the fix, as root runs it
    assert [c.status for c in run(config, root, mountinfo) if c.id == "inventory-cache"] == [doctor.PASS]


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


# --- the runtimes' TOML files, read with a TOML parser ------------------------------------------


def _regex_answer(text):
    """What doctor made of a TOML file before it had a parser (regular expressions, any table),
    kept here to show that each case below is one they got wrong."""
    text = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    matches = re.findall(r"(?m)^\s*hooks_dir\s*=\s*\[(.*?)\]", text, re.S)
    return re.findall(r"""["']([^"']*)["']""", matches[-1]) if matches else None


@pytest.fixture
def installed_root(tmp_path):
    """A root with the hooks.d file in /etc/containers/oci/hooks.d and CRI-O's drop-in naming it."""
    root = tmp_path / "root"
    root.mkdir()
    install.install(str(root), ("podman", "crio"))
    return str(root)


def _write(root, path, text):
    path = os.path.join(root, path.lstrip("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


OURS = install.HOOKS_D_DIR
# A drop-in podman reads after install's, whose hooks_dir list (when it sets one) is the one podman uses.
LOCAL_PODMAN_DROPIN = "/etc/containers/containers.conf.d/99-local.conf"
# (what the regex got wrong, containers.conf, the hooks_dir podman reads: None for its default)
CONTAINERS_CONF = [
    ("'#' inside a string", '[engine]\nhooks_dir = ["/opt/hooks#gpu"]\n', ["/opt/hooks#gpu"]),
    ("quoted key, single-quoted strings, multi-line array with comments",
     '# podman\n[engine]\n"hooks_dir" = [\n'
     "  '/usr/share/containers/oci/hooks.d',  # the package's \"default\"\n"
     "  '/opt/gpu-hooks',                     # ours\n]\n",
     ["/usr/share/containers/oci/hooks.d", "/opt/gpu-hooks"]),
    ("inline table", 'engine = { hooks_dir = ["/opt/gpu-hooks"], env = ["A=1"] }\n', ["/opt/gpu-hooks"]),
    ("dotted key", 'engine.hooks_dir = ["/opt/gpu-hooks"]\n', ["/opt/gpu-hooks"]),
    ("hooks_dir in a table podman does not read it from",
     '[containers]\nhooks_dir = ["/opt/gpu-hooks"]  # belongs in [engine]\n\n[engine]\nenv = ["A=1"]\n', None),
]  # fmt: skip


@pytest.mark.parametrize("name, text, dirs", CONTAINERS_CONF, ids=[c[0] for c in CONTAINERS_CONF])
def test_containers_conf_is_read_as_podman_reads_it(installed_root, name, text, dirs):
    _write(installed_root, LOCAL_PODMAN_DROPIN, text)
    assert _regex_answer(text) != dirs  # the case the regular expressions got wrong
    doc = doctor.Doctor(settings.Settings(), installed_root)
    # Not set there: install's drop-in's list (the default and ours) holds.
    expected = dirs if dirs is not None else list(runtime_config.PODMAN_DEFAULT_HOOKS_DIRS) + [OURS]
    assert doc.hooks_d_file()[2] == expected
    status, summary, _ = doc.check_hooks_d()
    assert status == (doctor.PASS if OURS in expected else doctor.FAIL), summary


# (what the regex got wrong, a CRI-O drop-in read after install's, whether CRI-O then reads ours)
CRIO_DROPINS = [
    ("quoted key, single-quoted string, comments",
     "[crio.runtime]\n\"hooks_dir\" = [  # \"ours\" left out\n  '/usr/share/containers/oci/hooks.d',\n]\n", False),
    ("dotted key", '[crio]\nruntime.hooks_dir = ["/usr/share/containers/oci/hooks.d"]\n', False),
    ("hooks_dir outside [crio.runtime]", '[crio.api]\nhooks_dir = ["/usr/share/containers/oci/hooks.d"]\n', True),
]  # fmt: skip


@pytest.mark.parametrize("name, text, reaches", CRIO_DROPINS, ids=[c[0] for c in CRIO_DROPINS])
def test_crio_drop_ins_are_read_as_crio_reads_them(installed_root, name, text, reaches):
    _write(installed_root, "/etc/crio/crio.conf.d/99-local.conf", text)
    regex_reaches = OURS in (_regex_answer(text) or [OURS])  # install's drop-in lists ours
    assert regex_reaches != reaches  # the case the regular expressions got wrong
    status, summary, _ = doctor.Doctor(settings.Settings(), installed_root).check_crio()
    assert status == (doctor.PASS if reaches else doctor.FAIL), summary


def test_a_malformed_toml_file_is_a_fail_naming_the_file(installed_root, hook_cli):
    doc = doctor.Doctor(settings.Settings(), installed_root)
    conf = _write(installed_root, "/etc/containers/containers.conf", '[engine]\nhooks_dir = ["/a",\nenv = []\n')
    status, summary, fix = doc.check_hooks_d()
    assert status == doctor.FAIL and summary.startswith(f"{conf}: not valid TOML (") and "line 3" in summary
    out = hook_cli("doctor", "--root", installed_root)
    lines = [line for line in out.stdout.splitlines() if line.startswith("FAIL  hooks-d")]
    assert len(lines) == 1 and conf in lines[0] and "Traceback" not in out.stderr, out.stdout + out.stderr

    _write(installed_root, "/etc/containers/containers.conf", '[engine]\nhooks_dir = "/etc/containers/oci/hooks.d"\n')
    status, summary, _ = doc.check_hooks_d()
    assert status == doctor.FAIL and summary.startswith(f"{conf}: engine.hooks_dir is not an array of strings")

    dropin = _write(installed_root, "/etc/crio/crio.conf.d/99-local.conf", "[crio.runtime\nhooks_dir = []\n")
    status, summary, _ = doc.check_crio()
    assert status == doctor.FAIL and summary.startswith(f"{dropin}: not valid TOML (") and "CRI-O" in summary


def test_before_python_3_11_tomli_parses(installed_root, monkeypatch, require):
    """Without tomllib, the tomli distribution (the same parser and API); without either, the
    checks that read TOML say they were not run."""
    _write(installed_root, LOCAL_PODMAN_DROPIN, '[engine]\nhooks_dir = ["/opt/gpu-hooks"]\n')
    doc = doctor.Doctor(settings.Settings(), installed_root)
    parser_name = "tomllib" if sys.version_info >= (3, 11) else "tomli"
    require(parser_name)  # the standard library's from 3.11; before, the package the RPM recommends
    parser = __import__(parser_name)
    monkeypatch.setitem(sys.modules, "tomllib", None)  # import tomllib: ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "tomli", parser)
    assert doc.hooks_d_file()[2] == ["/opt/gpu-hooks"]
    monkeypatch.setitem(sys.modules, "tomli", None)
    checks = {c.id: c for c in doc.run()}
    assert checks["hooks-d"].status == doctor.WARN and "tomli" in checks["hooks-d"].summary


def _executable(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)


NVIDIAS_HOOK = "#!/bin/sh\n# stands in for NVIDIA's nvidia-container-runtime-hook\nexit 0\n"


@pytest.mark.parametrize(
    "state, status, words",
    [
        ("no docker", doctor.PASS, "not installed"),
        ("docker, no program", doctor.WARN, "no nvidia-container-runtime-hook"),
        ("docker, NVIDIA's program", doctor.WARN, "not oci-gpu-hook's"),
        ("docker, ours not executable", doctor.FAIL, "not executable"),
        ("docker, ours", doctor.PASS, "runs oci-gpu-hook"),
        ("docker, ours, the pre-filter", doctor.PASS, f"(the pre-filter, then {install.DOCKER_LAUNCHER};"),
        ("docker, ours, the pre-filter without its launcher", doctor.FAIL, f"{install.DOCKER_LAUNCHER}, which it runs"),
        ("docker, ours, the pre-filter in front of another", doctor.FAIL, "not the launcher install writes"),
        ("docker, NVIDIA's first on the PATH", doctor.WARN, "/usr/local/bin/nvidia-container-runtime-hook"),
    ],
)
def test_docker_check(setup, state, status, words, require):
    host, config, root, mountinfo = setup
    if state != "no docker":
        _executable(root + "/usr/bin/dockerd", "#!/bin/sh\n")
    if state.endswith("NVIDIA's program"):
        _executable(root + install.DOCKER_HOOK, NVIDIAS_HOOK)
    if "ours" in state or "first on the PATH" in state:
        # Docker's program: the pre-filter (install puts it there with the start server), or the launcher
        with_prefilter = "pre-filter" in state
        if with_prefilter:
            require("gcc")
        install.install(root, ("docker",), ["/usr/bin/oci-gpu-hook"], prefilter=with_prefilter,
                        start_server=with_prefilter)  # fmt: skip
    if state.endswith("without its launcher"):
        os.unlink(root + install.DOCKER_LAUNCHER)
    if state.endswith("in front of another"):
        os.unlink(root + install.DOCKER_LAUNCHER)
        _executable(root + install.DOCKER_LAUNCHER, NVIDIAS_HOOK)
    if state.endswith("not executable"):
        os.chmod(root + install.DOCKER_HOOK, 0o644)
    if state.endswith("first on the PATH"):
        _executable(root + "/usr/local/bin/nvidia-container-runtime-hook", NVIDIAS_HOOK)
    (check,) = [c for c in run(config, root, mountinfo) if c.id == "docker"]
    assert (check.status, words in check.summary) == (status, True), check
    assert (check.fix is None) == (status == doctor.PASS)


def _by_id(checks):
    return {c.id: c for c in checks}


def test_node_services_not_installed_are_not_checked(setup):
    host, config, root, mountinfo = setup
    checks = _by_id(run(config, root, mountinfo))
    assert checks["exporter"].status == checks["labels"].status == doctor.PASS
    assert "not installed" in checks["exporter"].summary and "not installed" in checks["labels"].summary


def test_node_services_installed_but_not_running_fail(setup, tmp_path):
    host, config, root, mountinfo = setup
    install.install(root, ("podman",), ["/usr/bin/oci-gpu-hook"], node_services=True)
    from servicecheck import free_port

    port = free_port()  # nothing listens there
    config = config.replace(node=config.node.replace(exporter_listen=f"127.0.0.1:{port}",
                                                      features_file=str(tmp_path / "features.d/gpu")))  # fmt: skip
    checks = _by_id(run(config, root, mountinfo))
    assert checks["exporter"].status == doctor.FAIL and f"127.0.0.1:{port}" in checks["exporter"].summary
    assert checks["labels"].status == doctor.FAIL and "No such file" in checks["labels"].summary
    assert "oci-gpu-hook-labels.service" in checks["labels"].fix


def test_node_services_running_pass(setup, tmp_path):
    host, config, root, mountinfo = setup
    install.install(root, ("podman",), ["/usr/bin/oci-gpu-hook"], node_services=True)
    from servicecheck import Exporter

    features_file = tmp_path / "features.d/gpu"
    features_file.parent.mkdir()
    exporter = Exporter(os.path.join(host["root"], "config.yaml"), tmp_path)
    try:
        config = config.replace(node=config.node.replace(exporter_listen=f"127.0.0.1:{exporter.port}",
                                                          features_file=str(features_file)))  # fmt: skip
        from oci_gpu_hook.node import features

        features.refresh(config, str(features_file))
        checks = _by_id(run(config, root, mountinfo))
        assert checks["exporter"].status == doctor.PASS, checks["exporter"].summary
        assert checks["labels"].status == doctor.PASS, checks["labels"].summary
        features_file.write_text(features_file.read_text().replace("gpu.count=", "gpu.count=9"))
        assert _by_id(run(config, root, mountinfo))["labels"].status == doctor.WARN
    finally:
        exporter.stop()
