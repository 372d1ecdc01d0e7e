"""doctor on a simulated host: healthy gives no FAIL; each broken variant gives exactly its FAIL."""

import json
import os
import re
import sys

import privatehost
import pytest
import startservercheck

from oci_gpu_hook.errors import Exit, HookError
from oci_gpu_hook.start import inventory_cache, prefilter_rule, server, settings
from oci_gpu_hook.start.linux import labels
from oci_gpu_hook.toolkit import containers, doctor, install, launcher, prefilter, runtime_config

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


# --- the start server, as doctor meets it ---------------------------------------------------------

START_SOCKET = prefilter_rule.START_SERVER_SOCKET
# Where install writes and the server listens, each private to the namespace (tests/privatehost.py):
# no GPU start elsewhere on this machine reaches a server of these tests, and nothing of theirs
# reaches the host.
START_OVERLAYS = ["/etc", "/usr/share/containers", "/usr/local", "/var/lib"]
START_TMPFS = ["/run"]
RUN_DIRECTORY = f"mkdir -m 0755 {os.path.dirname(START_SOCKET)}"
# startservercheck's helpers, run inside the namespace (its socket is not reachable from outside).
IN_NAMESPACE = "import json, sys; sys.path[:0] = sys.argv[1:3]; import startservercheck; "
LATE_OFFER = IN_NAMESPACE + "print(startservercheck.offer(sys.argv[3], bytes.fromhex(sys.argv[4])).decode())"
COUNTED = IN_NAMESPACE + "print(json.dumps(startservercheck.counted(sys.argv[3], served=1, late=1)))"
STATE_IN = 'exec "$0" --config "$1" prestart < "$2"'  # as a runtime runs the hook, the state on stdin


def _start_server_check(result: dict) -> dict:
    (check,) = [c for c in json.loads(result["stdout"])["checks"] if c["id"] == "start-server"]
    return check


def _in_namespace(tmp_path, steps) -> list:
    """privatehost.run's results of steps (after `install --runtime podman --start-server` as a user
    types it, and the socket's directory made), in their order."""
    work = tmp_path / "namespace"
    work.mkdir(exist_ok=True)
    results = privatehost.run(str(work), START_OVERLAYS, steps, tmpfs=START_TMPFS)
    for result in results[:2]:
        assert result["rc"] == 0, result
    return results[2:]


def _install(cli) -> list:
    return [{"run": [*cli, "install", "--runtime", "podman", "--start-server"]}, {"run": ["sh", "-c", RUN_DIRECTORY]}]


def _listening(tmp_path) -> list:
    """A daemon step's "ready": the first daemon's log (privatehost's daemon0.log) says it listens."""
    return ["grep", "-q", startservercheck.LISTENING, str(tmp_path / "namespace" / "daemon0.log")]


@pytest.fixture(scope="module")
def no_server_then_another(host, tmp_path_factory, require):
    """doctor with nothing answering on the socket, then with a server of a copy of the package
    whose one source differs (a server that kept running through an upgrade): (the two checks,
    the copy's code identity)."""
    require("root", "gcc", "unshare")
    tmp_path = tmp_path_factory.mktemp("doctor-start")
    config = startservercheck.config(host, tmp_path)
    cli = containers.hook_command(config)
    copy = startservercheck.package_copy(tmp_path / "older")
    with open(os.path.join(copy, "start", "report.py"), "a") as f:
        f.write("# the version before an upgrade\n")
    steps = [*_install(cli),
             {"run": [*cli, "doctor", "--json"]},
             {"daemon": startservercheck.package_command(copy), "ready": _listening(tmp_path)},
             {"run": [*cli, "doctor", "--json"]}]  # fmt: skip
    alone, _, older = _in_namespace(tmp_path, steps)
    return _start_server_check(alone), _start_server_check(older), server.code_identity(copy)


def test_doctor_warns_when_no_start_server_answers(no_server_then_another):
    check = no_server_then_another[0]
    assert check["status"] == doctor.WARN, check
    assert check["summary"].startswith(f"the start server does not answer on {START_SOCKET} ("), check
    assert check["summary"].endswith("every GPU start runs in Python"), check


def test_doctor_fails_a_start_server_of_other_code(no_server_then_another):
    _, check, older = no_server_then_another
    installed = server.code_identity()
    assert older != installed
    assert check["status"] == doctor.FAIL, check
    assert check["summary"].startswith(f"the start server runs code {older}, not the installed {installed} "), check
    assert check["fix"] == f"systemctl restart {install.START_SERVICE}"


@pytest.fixture(scope="module")
def fallen_back(host, tmp_path_factory, require):
    """A server of the installed code that served one start (install's pre-filter's) and said
    "taken" to one peer that had given up (it closed instead of saying "go"): its counts, doctor's
    check then, and doctor's check with Docker's program a pre-filter built for other code."""
    require("root", "gcc", "unshare")
    tmp_path = tmp_path_factory.mktemp("doctor-start")
    config = startservercheck.config(host, tmp_path)
    cli = containers.hook_command(config)
    state = tmp_path / "state"
    state.write_bytes(startservercheck.gpu_error_state(tmp_path))
    with pytest.MonkeyPatch.context() as patch:  # a pre-filter built before an upgrade
        patch.setattr(server, "code_identity", lambda package=None: "0123456789abcdef")
        older = prefilter.build(str(tmp_path / "older-prefilter"), "/nonexistent", start_server=START_SOCKET)
    docker = os.path.join("/usr/local/bin", os.path.basename(install.DOCKER_HOOK))  # before /usr/bin on its PATH
    as_dockers = 'printf "#!/bin/sh\\n" > /usr/local/bin/dockerd && chmod 0755 /usr/local/bin/dockerd && cp "$0" "$1"'
    helpers = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), launcher.package_parent()]
    offer = startservercheck.payload("--config", config, "prestart").hex()
    steps = [*_install(cli),
             {"daemon": [install.START_LAUNCHER, "--config", config, prefilter_rule.START_SERVER],
              "ready": _listening(tmp_path)},
             {"run": ["sh", "-c", STATE_IN, launcher.LAUNCHER, config, str(state)]},
             {"run": [sys.executable, "-I", "-c", LATE_OFFER, *helpers, START_SOCKET, offer]},
             {"run": [sys.executable, "-I", "-c", COUNTED, *helpers, START_SOCKET]},
             {"run": [*cli, "doctor", "--json"]},
             {"run": ["sh", "-c", as_dockers, older, docker]},
             {"run": [*cli, "doctor", "--json"]}]  # fmt: skip
    ready, served, late, counts, fell_back, as_dockers, docker_check = _in_namespace(tmp_path, steps)
    for result in (ready, late, counts, as_dockers):
        assert result["rc"] == 0, result
    return {"served": served, "late": late, "counts": json.loads(counts["stdout"]),
            "check": _start_server_check(fell_back), "docker": _start_server_check(docker_check)}  # fmt: skip


def test_doctor_warns_of_starts_that_fell_back_to_python(fallen_back):
    """The server's counts: the start install's pre-filter offered was served (its exit status is
    the refused GPU's, the Python hook's own), the peer that gave up was counted late. doctor
    says the install is right (no FAIL) and warns of the fallback, with where to read why."""
    assert fallen_back["served"]["rc"] == Exit.REQUEST, fallen_back["served"]
    assert fallen_back["late"]["stdout"] == "a\n", fallen_back["late"]
    counts = fallen_back["counts"]
    assert (counts["served"], counts["late"], counts["identity"]) == (1, 1, server.code_identity()), counts
    check = fallen_back["check"]
    assert check["status"] == doctor.WARN, check
    said = re.fullmatch(
        rf"the start server serves the installed code \({server.code_identity()}\); 1 start\(s\) fell "
        r"back to Python since the server started (\d+) s ago \(1 taken too late\)",
        check["summary"],
    )
    assert said and int(said.group(1)) >= counts["up"], check
    assert check["fix"].startswith(f"journalctl -u {install.START_SERVICE} says why"), check


def test_doctor_checks_dockers_program_like_the_hooks_d_one(fallen_back):
    """Docker's program, first on dockerd's PATH, a pre-filter built for other code than the
    server serves: each `docker run --gpus` start runs in Python, a FAIL with install's fix."""
    check = fallen_back["docker"]
    assert check["status"] == doctor.FAIL, check
    wanted = server.version_line(server.code_identity())
    assert check["summary"] == (f"/usr/local/bin/nvidia-container-runtime-hook (Docker's program) offers starts as "
                                f"{server.version_line('0123456789abcdef')!r}, the server takes {wanted!r}: each "
                                "start runs in Python"), check  # fmt: skip
    assert check["fix"] == doctor.OFFER_FIX


UNIT = {"LoadState": "loaded", "ActiveState": "active", "SubState": "listening", "Result": "success", "NRestarts": ""}
SERVICE = {**UNIT, "SubState": "running", "NRestarts": "0"}
SOCKET_FIX = f"systemctl reset-failed {install.START_SOCKET} {install.START_SERVICE} && systemctl start " \
             f"{install.START_SOCKET}"  # fmt: skip
JOURNAL = f"journalctl -u {install.START_SERVICE} says why"


@pytest.mark.parametrize(
    "socket, service, said",
    [(None, None, []),
     (UNIT, SERVICE, []),
     ({**UNIT, "ActiveState": "inactive", "SubState": "dead"}, None,
      [("systemd has oci-gpu-hook-start.socket inactive (dead, result success): nothing listens for offers, and "
        "every GPU start runs in Python", SOCKET_FIX)]),
     ({**UNIT, "ActiveState": "failed", "SubState": "failed", "Result": "trigger-limit-hit"}, SERVICE,
      [("systemd has oci-gpu-hook-start.socket failed (failed, result trigger-limit-hit): nothing listens for "
        "offers, and every GPU start runs in Python", SOCKET_FIX)]),
     ({**UNIT, "LoadState": "not-found"}, None,
      [("systemd has oci-gpu-hook-start.socket not-found",
        "systemctl daemon-reload && systemctl enable --now oci-gpu-hook-start.socket")]),
     (UNIT, {**SERVICE, "Result": "watchdog", "NRestarts": "2"},
      [("its last run was ended by systemd's watchdog (it stopped looping) (oci-gpu-hook-start.service: result "
        "watchdog)", JOURNAL),
       ("systemd restarted it 2 time(s) (oci-gpu-hook-start.service: NRestarts=2)", JOURNAL)]),
     (UNIT, {**SERVICE, "Result": "oom-kill", "ActiveState": "failed"},
      [("its last run was ended by the OOM killer (oci-gpu-hook-start.service: result oom-kill)", JOURNAL)]),
     (UNIT, {**SERVICE, "Result": "exit-code", "NRestarts": "\u0663"}, [])],
    ids=["no systemd", "healthy", "socket stopped", "socket failed", "socket not loaded", "watchdog, restarts",
         "oom-kill", "other result, restarts not ASCII"],
)  # fmt: skip
def test_systemds_state_of_the_start_servers_units(socket, service, said):
    """What doctor makes of `systemctl show`'s properties of the two units (there is no systemd as
    PID 1 here to ask)."""
    assert doctor.start_units_say(socket, service) == said


@pytest.mark.parametrize(
    "status, said",
    [({"identity": "0123456789abcdef"}, None),
     ({"identity": "x", "up": 9, "served": 5, "late": 0, "no_worker": 0, "too_many": 0, "stranger": 3}, None),
     ({"identity": "x", "up": 9, "served": 5, "late": 1, "no_worker": 2, "too_many": 3},
      "6 start(s) fell back to Python since the server started 9 s ago (1 taken too late, 2 without a worker, 3 with "
      "too many connections waiting)")],
    ids=["a server before the counts", "strangers are no fallback", "each fallback"],
)  # fmt: skip
def test_fallbacks_are_the_servers_own(status, said):
    assert doctor.fallbacks(status) == said


def test_gates_say_the_first_failed_gate_and_its_fix(setup):
    """doctor repeats the validation gates' verdicts (node/gates.py): nothing to check without a
    rollout's file; pending gates are a warning; the first failed gate's line and fix are the
    FAIL; a file not to be trusted fails too."""
    from oci_gpu_hook.node import gates

    host, config, root, mountinfo = setup
    path = gates.gates_path(config.records_path)

    def check():
        return _by_id(run(config, root, mountinfo))["gates"]

    assert check().status == doctor.PASS and check().summary.startswith("no validation gates on this node")
    gates.write(path, {"toolkit": gates.verdict("passed")})
    assert (check().status, check().summary) == (doctor.WARN, "gates pending: plugin (the device plugin offers GPUs "
                                                              "once toolkit passed)")  # fmt: skip
    plugin = gates.verdict("failed", "the validation pod saw 0 GPUs, not 1", "see its events")
    gates.write(path, {"toolkit": gates.verdict("passed"), "plugin": plugin})
    failed = check()
    assert (failed.status, failed.summary, failed.fix) == (
        doctor.FAIL, "gate plugin failed: the validation pod saw 0 GPUs, not 1", "see its events")  # fmt: skip
    gates.write(path, {"plugin": plugin})  # toolkit pending again: the failure still decides
    assert (check().status, check().summary) == (doctor.FAIL, "gate plugin failed: the validation pod saw 0 GPUs, "
                                                              "not 1")  # fmt: skip
    gates.write(path, {"toolkit": gates.verdict("passed"), "plugin": gates.verdict("passed")})
    assert (check().status, check().summary) == (doctor.PASS, "gates passed: toolkit, plugin")
    os.chmod(path, 0o666)
    assert check().status == doctor.FAIL and "cannot be trusted" in check().summary
