import json
import os
import re

import hookcheck
import pytest

from oci_gpu_hook.errors import ConfigError
from oci_gpu_hook.start import settings


def write(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_when_no_file_anywhere(monkeypatch):
    monkeypatch.setattr(settings, "DEFAULT_PATH", "/nonexistent/config.yaml")
    s = settings.load(None, environ={})
    assert (s.driver_root, s.dev_root, s.proc_root, s.source) == ("/", "/", "/", None)
    assert s.logging.level == "info"


def test_explicit_file_wins_over_environment(tmp_path):
    explicit = write(tmp_path, "driver_root: /a\n")
    other = tmp_path / "other.yaml"
    other.write_text("driver_root: /b\n")
    s = settings.load(explicit, environ={settings.ENV_VAR: str(other)})
    assert s.driver_root == "/a" and s.source == explicit


def test_environment_variable_names_the_file(tmp_path):
    path = write(tmp_path, "proc_root: /sim\nlogging:\n  level: debug\n  syslog: true\n")
    s = settings.load(None, environ={settings.ENV_VAR: path})
    assert s.proc_root == "/sim" and s.logging.level == "debug" and s.logging.syslog is True


def test_empty_file_means_defaults(tmp_path):
    assert settings.load(write(tmp_path, ""), environ={}).driver_root == "/"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("drivr_root: /x\n", "drivr_root: unknown key (accepted keys here: accept_cdi_annotations"),
        ("logging:\n  colour: red\n", "logging.colour: unknown key (accepted keys here: file, level, syslog)"),
        ("driver_root: relative/path\n", 'driver_root: "relative/path" is not accepted (expected an absolute path'),
        (
            "logging:\n  level: loud\n",
            'logging.level: "loud" is not accepted (expected one of debug, info, warning, error)',
        ),
        ("logging:\n  syslog: maybe\n", 'logging.syslog: "maybe" is not accepted (expected true or false'),
        ("- a\n- b\n", "the configuration must be a mapping"),
        (
            "supported_capabilities: [compute, gpus]\n",
            'supported_capabilities[1]: "gpus" is not accepted (expected a list',
        ),
        ("cdi_kind: gpu\n", 'cdi_kind: "gpu" is not accepted (expected a CDI device kind vendor/class'),
        ("driver_root: [unclosed\n", "not valid YAML at line 2"),
    ],
)
def test_errors_name_file_key_and_what_is_accepted(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        settings.load(path, environ={})
    assert str(e.value).startswith(path + ": ")
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the configuration file: No such file"):
        settings.load(str(tmp_path / "nope.yaml"), environ={})


def test_binary_file_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\xff\xfe\x00driver_root")
    with pytest.raises(ConfigError, match="not UTF-8"):
        settings.load(str(path), environ={})


def test_request_policy_keys(tmp_path):
    path = write(
        tmp_path,
        "supported_capabilities: [utility, compute]\naccept_volume_mounts: true\nmps_pipe_directories: [/run/mps]\n",
    )
    s = settings.load(path, environ={})
    assert s.supported_capabilities == ("utility", "compute")
    assert s.accept_volume_mounts is True and s.accept_envvar_when_unprivileged is True
    assert s.mps_pipe_directories == ("/run/mps",)
    assert settings.load(write(tmp_path, "supported_capabilities: [all]\n"), environ={}).supported_capabilities == (
        "compute",
        "compat32",
        "graphics",
        "utility",
        "video",
        "display",
        "ngx",
    )


def test_unquoted_off_means_off(tmp_path):
    assert settings.load(write(tmp_path, "cgroups: off\n"), environ={}).cgroups == "off"


def test_compiled_settings_serve_later_loads_without_yaml(tmp_path, mocker):
    path = write(tmp_path, "driver_root: /first\n")
    assert settings.load(path, environ={}, cache=True).driver_root == "/first"
    parse = mocker.patch.object(settings, "parse_mapping", side_effect=AssertionError("parsed again"))
    assert settings.load(path, environ={}, cache=True).driver_root == "/first"
    assert parse.call_count == 0


def test_compiled_settings_are_stale_once_the_file_changes(tmp_path):
    path = write(tmp_path, "driver_root: /first\n")
    settings.load(path, environ={}, cache=True)
    os.utime(path, ns=(1, 1))  # another mtime, as an edit gives
    with open(path, "w") as f:
        f.write("driver_root: /second\n")
    assert settings.load(path, environ={}, cache=True).driver_root == "/second"


def test_compiled_settings_writable_by_others_are_ignored(tmp_path):
    path = write(tmp_path, "driver_root: /first\n")
    settings.load(path, environ={}, cache=True)
    compiled = settings.compiled_path(path)
    doc = json.load(open(compiled))
    doc["settings"]["driver_root"] = "/forged"
    json.dump(doc, open(compiled, "w"))
    os.chmod(compiled, 0o666)
    assert settings.load(path, environ={}, cache=True).driver_root == "/first"


# --- who keeps the compiled copy: the hook alone -------------------------------------------------

# Run in a private mount namespace with a tmpfs of its own on /run, so that the host's
# /run/oci-gpu-hook (and other test runs') is neither read nor changed: the commands as a person
# types them, each followed by a look at /run; then the hook, twice, as a runtime runs it.
IN_A_PRIVATE_RUN = r"""
import hashlib, json, os, shutil, subprocess, sys

from oci_gpu_hook.toolkit.containers import hook_command

config, plan_bundle, work, first, second, forged_log = sys.argv[1:]
subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "oci-gpu-hook-test-run", "/run"], check=True)
RUN = "/run/oci-gpu-hook"
COMMANDS = [["info", "--json"], ["plan", "--bundle", plan_bundle, "--json"], ["inventory", "refresh"],
            ["cdi", "generate", "--output", os.path.join(work, "cdi.yaml")], ["labels", "--output", "-"],
            ["doctor"]]


def snapshot():
    found = {}
    for directory, dirs, names in os.walk("/run"):
        for name in dirs + names:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            digest = hashlib.sha256(open(path, "rb").read()).hexdigest() if os.path.isfile(path) else None
            found[path] = [st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, digest]
    return found


def cli(args, stdin=None):
    return subprocess.run([*hook_command(config), *args], stdin=stdin, capture_output=True, text=True, timeout=300)


report = {"changed": [], "failed": []}
for setup in ("no run directory", "a run directory with another run's file"):
    shutil.rmtree(RUN, ignore_errors=True)  # each setup from its own start
    if setup != "no run directory":
        os.mkdir(RUN, 0o755)
        with open(os.path.join(RUN, "settings_another_run_config.yaml.json"), "w") as f:
            f.write('{"path": "/another/run/config.yaml"}')
    for args in COMMANDS:
        before = snapshot()
        done = cli(args)
        if done.returncode != 0 and args != ["doctor"]:  # doctor fails on what a simulated host lacks
            report["failed"].append([args, done.stderr[-2000:]])
        after = snapshot()
        changed = sorted(path for path in set(before) | set(after) if before.get(path) != after.get(path))
        if changed:
            report["changed"].append([setup, args, changed])

hook = [*hook_command(config), "prestart"]
before = set(os.listdir(RUN))
report["first_start"] = subprocess.run(hook, input=first, capture_output=True, text=True).returncode
report["kept"] = sorted(set(os.listdir(RUN)) - before)
# The kept copy, forged as the hook's own 0644 file (settings.CACHE_UID's): a start that reads it
# logs where it says.
from oci_gpu_hook.start.settings import CACHE_UID
for name in report["kept"][:1]:
    doc = json.load(open(os.path.join(RUN, name)))
    doc["settings"]["logging"]["file"] = forged_log
    with open(os.path.join(RUN, name + ".new"), "w") as f:
        json.dump(doc, f)
    os.chown(os.path.join(RUN, name + ".new"), CACHE_UID, -1)
    os.rename(os.path.join(RUN, name + ".new"), os.path.join(RUN, name))
    report["second_start"] = subprocess.run(hook, input=second, capture_output=True, text=True).returncode
json.dump(report, sys.stdout)
"""


def test_only_the_hook_keeps_compiled_settings_in_the_run_directory(live_container, tmp_path, require):
    """Every command people run (info, plan, inventory refresh, cdi generate, labels, doctor)
    reads its --config without leaving a compiled copy in /run/oci-gpu-hook, whether the directory
    exists or not (the hook may not even be installed); the hook keeps one, and uses it."""
    import subprocess
    import sys

    import yaml

    require("root", "unshare")
    first, bundle, _, _, host = live_container({"NVIDIA_VISIBLE_DEVICES": "0"})
    second = live_container({"NVIDIA_VISIBLE_DEVICES": "0"})[0]
    with open(f"{host['root']}/config.yaml") as f:
        doc = yaml.safe_load(f)
    # The test's own caches, records and log: the shared simulated host stays as it was.
    doc.update(inventory_cache=str(tmp_path / "inventory.json"), records_directory=str(tmp_path / "records"))
    doc["logging"]["file"] = str(tmp_path / "hook.log")
    doc["node"]["features_file"] = str(tmp_path / "features")
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(doc))
    forged = tmp_path / "forged.log"
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-I", "-c",
                           IN_A_PRIVATE_RUN, str(config), bundle, str(tmp_path), first, second, str(forged)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["failed"] == []
    assert report["changed"] == []
    assert report["first_start"] == 0 and report["kept"] == [os.path.basename(settings.compiled_path(str(config)))]
    assert report["second_start"] == 0, report
    assert "GPU devices configured" in forged.read_text()  # the second start read the kept copy
    assert (tmp_path / "hook.log").read_text().count("GPU devices configured") == 1


# --- YAML: bounded while it is parsed, each key once (docs/security.md, attack round 4, 7 and 8a) ---


@pytest.fixture(params=[True, False], ids=["libyaml", "pyyaml"])
def libyaml(request, require):
    """Each parser in turn; libyaml's must be there (PyYAML falls back to its own without it)."""
    if request.param:
        require("yaml._yaml")
    return request.param


ITEMS = ",".join(["x"] * 1000)


@pytest.mark.parametrize("text, words", [
    ("[" + "0," * 1024 + "0]", settings.TOO_LONG),
    ("{" + ",".join(f"k{i}" for i in range(1025)) + "}", settings.TOO_WIDE),
    ("[" * 34 + "]" * 34, settings.TOO_DEEP),
    ("[" * 5000 + "]" * 5000, settings.TOO_DEEP),  # past libyaml's own bound (1000) too
    # An alias counts as the nodes it stands for, there where it is used: 1 + 100 * 1001.
    ("[&a [" + ITEMS + "]" + ", *a" * 99 + "]", settings.TOO_MANY_VALUES),
    ("a: &a " + "[" * 20 + "]" * 20 + "\nb: " + "[" * 13 + "*a" + "]" * 13 + "\n", settings.TOO_DEEP),
    ("&a [*a]", settings.TOO_MANY_VALUES),  # a list that holds itself: endless
    ("a:\n  b: " + "{c: " * 40 + "}" * 40 + "\n", settings.TOO_DEEP),
], ids=["1025-items", "1025-keys", "33-deep", "5000-deep", "aliases", "deep-alias", "recursive",
        "deep-mapping"])  # fmt: skip
def test_a_document_past_a_bound_is_refused_while_it_is_parsed(text, words, libyaml):
    with pytest.raises(ConfigError) as e:
        settings.load_yaml(text, "where.yaml", libyaml=libyaml)
    assert str(e.value) == f"where.yaml: {words}; this is not a configuration"


@pytest.mark.parametrize("text", [
    "[" + "0," * 1023 + "0]",
    "{" + ",".join(f"k{i}" for i in range(1024)) + "}",
    "[" * 33 + "]" * 33,
    "[&a [" + ITEMS + "]" + ", *a" * 98 + "]",
    "a: &a " + "[" * 20 + "]" * 20 + "\nb: " + "[" * 12 + "*a" + "]" * 12 + "\n",
], ids=["1024-items", "1024-keys", "32-deep", "aliases", "deep-alias"])  # fmt: skip
def test_a_document_at_the_bounds_is_what_yaml_reads(text, libyaml):
    """The same bounds as check_document_size's on what was built: nothing it accepts is refused."""
    import yaml

    doc = settings.load_yaml(text, "where.yaml", libyaml=libyaml)
    assert doc == yaml.safe_load(text)
    settings.check_document_size(doc, "where.yaml")


@pytest.mark.parametrize("kind", list(hookcheck.one_mib_documents("x")))
def test_a_one_mib_document_stops_at_its_bound(kind, libyaml):
    """Either parser: PyYAML's own (on a host without libyaml) reads until a bound, not the file."""
    import time

    text, words = hookcheck.one_mib_documents("x")[kind]
    started = time.process_time()
    with pytest.raises(ConfigError, match=re.escape(f"where.yaml: {words}; this is not a configuration")):
        settings.load_yaml(text, "where.yaml", libyaml=libyaml)
    assert time.process_time() - started < 10  # a hang guard: building it took PyYAML 5 to 38 s


GOOD = """\
driver_root: /sim
supported_capabilities: &caps [compute, utility]
deadline_seconds: 2.5
logging: {level: debug, file: null, syslog: no}
node:
  replicas: 0x10
  stamp: 2001-12-14
  caps: *caps
  nested: [{a: 1}, {a: 2}, {"1": x, 1: y}]
"""


def test_a_good_document_reads_as_json_types(libyaml):
    doc = settings.load_yaml(GOOD, "where.yaml", libyaml=libyaml)
    assert doc == {"driver_root": "/sim", "supported_capabilities": ["compute", "utility"], "deadline_seconds": 2.5,
                   "logging": {"level": "debug", "file": None, "syslog": False},
                   "node": {"replicas": 16, "stamp": "2001-12-14", "caps": ["compute", "utility"],
                            "nested": [{"a": 1}, {"a": 2}, {"1": "x", 1: "y"}]}}  # fmt: skip


@pytest.mark.parametrize("text, message", [
    ("node:\n  replicas: 2\nnode:\n  replicas: 4\n", "key 'node' appears twice (lines 1 and 3)"),
    ("node:\n  replicas: 2\n  mig_strategy: none\n  replicas: 4\n",
     "key 'node.replicas' appears twice (lines 2 and 4)"),
    ("a:\n- b: 1\n  b: 2\n", "key 'a[0].b' appears twice (lines 2 and 3)"),
    ("{a: {1: x, 1.0: y}}", "key 'a.1.0' appears twice (both on line 1)"),  # one key to the mapping
    ("{a: {true: x, yes: y}}", "key 'a.yes' appears twice (both on line 1)"),
    ("x: &m {k: 1}\ny: [*m, {k: 1, 'k': 2}]\n", "key 'y[1].k' appears twice (both on line 2)"),
    ("k" * 200 + ": 1\n" + "k" * 200 + ": 2\n", f"key '{'k' * 80}...' appears twice (lines 1 and 2)"),
], ids=["top-level", "nested", "in-a-list-item", "equal-numbers", "equal-booleans", "beside-an-alias",
        "long"])  # fmt: skip
def test_a_key_written_twice_is_refused_naming_it_and_both_lines(text, message, libyaml):
    with pytest.raises(ConfigError) as e:
        settings.load_yaml(text, "where.yaml", libyaml=libyaml)
    assert str(e.value) == f"where.yaml: {message}"
