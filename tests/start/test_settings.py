import json
import os

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
    assert settings.load(path, environ={}).driver_root == "/first"
    parse = mocker.patch.object(settings, "parse_mapping", side_effect=AssertionError("parsed again"))
    assert settings.load(path, environ={}).driver_root == "/first"
    assert parse.call_count == 0


def test_compiled_settings_are_stale_once_the_file_changes(tmp_path):
    path = write(tmp_path, "driver_root: /first\n")
    settings.load(path, environ={})
    os.utime(path, ns=(1, 1))  # another mtime, as an edit gives
    with open(path, "w") as f:
        f.write("driver_root: /second\n")
    assert settings.load(path, environ={}).driver_root == "/second"


def test_compiled_settings_writable_by_others_are_ignored(tmp_path):
    path = write(tmp_path, "driver_root: /first\n")
    settings.load(path, environ={})
    compiled = settings.compiled_path(path)
    doc = json.load(open(compiled))
    doc["settings"]["driver_root"] = "/forged"
    json.dump(doc, open(compiled, "w"))
    os.chmod(compiled, 0o666)
    assert settings.load(path, environ={}).driver_root == "/first"
