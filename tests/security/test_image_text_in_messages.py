"""Image text in messages: values and names from the image's env end up in the error line the
runtime shows, in the log file, in syslog, in notes and in `plan`'s output. None of them may carry
a control character there (an ESC sequence that rewrites the terminal, BEL, a CR that overwrites
the line, a C1 CSI, U+202E reversing what follows, a line separator): they are shown escaped
(errors.printable), whichever module built the message.
"""

from __future__ import annotations

import json
import os
import subprocess

import hookcheck
import pytest

from oci_gpu_hook import errors, hook
from oci_gpu_hook.start import report
from oci_gpu_hook.start.settings import LoggingSettings, Settings
from oci_gpu_hook.toolkit.containers import hook_command

pytestmark = pytest.mark.host(gpus=2, mig=[1])

REQUEST_ERROR = 5
# Terminal and log attacks: set the title and ring, clear the screen, overwrite the line, a C1
# CSI, reverse the text after it, a line separator, a lone surrogate (valid in JSON's \u escapes).
NASTY = "\x1b]0;owned\x07\x1b[2J\rX\x7f\x9b31m\u202eA\u2028B\ud800"
# What the hook must show instead of the first of them.
ESCAPED_ESC = "\\x1b"


def _config(tmp_path, host) -> str:
    """The simulated host's configuration with a log file of this test's own."""
    text = open(f"{host['root']}/config.yaml").read().replace(f"{host['root']}/hook.log", str(tmp_path / "hook.log"))
    assert str(tmp_path / "hook.log") in text
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def _bundle(tmp_path, env: dict) -> str:
    from oci_gpu_hook.toolkit import containers

    path = tmp_path / "bundle"
    path.mkdir()
    containers.write_config(str(path), args=["true"], env=env, config_file=None)
    return str(path)


def _state(bundle: str, pid: int | None = None) -> str:
    return json.dumps({"ociVersion": "1.0.2", "id": "image-text", "status": "creating",
                       "pid": pid or os.getpid(), "bundle": bundle})  # fmt: skip


def assert_shown_safely(text: str, what: str) -> None:
    """No character a terminal or a log reader would act on."""
    bad = sorted({f"U+{ord(c):04X}" for c in text if not c.isprintable()})
    assert not bad, f"{what} carries {', '.join(bad)}: {text[:300]!r}"


def assert_clean_bytes(data: bytes, what: str) -> None:
    """Raw bytes: no C0 control but the line ends, no DEL, valid UTF-8 without C1 controls."""
    raw = [b for b in data if (b < 0x20 and b != 0x0A) or b == 0x7F]
    assert not raw, f"{what} has raw control bytes {sorted(set(raw))}: {data[:300]!r}"
    assert_shown_safely(data.decode("utf-8").replace("\n", ""), what)  # strict: C1 and U+202E are chars here


def log_records(tmp_path) -> list[dict]:
    data = (tmp_path / "hook.log").read_bytes()
    # JSON lines: the text itself is ASCII (every control character \u-escaped) ...
    assert all(0x20 <= b < 0x7F or b == 0x0A for b in data), f"raw bytes in the log: {data[:300]!r}"
    return [json.loads(line) for line in data.decode().splitlines()]


# Each case: the container's env (beside NVIDIA_VISIBLE_DEVICES=0) and words of the error line.
CASES = {
    "visible-devices": ({"NVIDIA_VISIBLE_DEVICES": "0," + NASTY}, "unknown device"),
    "visible-devices-only-nasty": ({"NVIDIA_VISIBLE_DEVICES": NASTY}, "unknown device"),
    # Read up to "all", so 7 is checked against the host, and the line quotes the whole value.
    "visible-devices-after-all": ({"NVIDIA_VISIBLE_DEVICES": "7,all," + NASTY}, ": no GPU 7 (this host has"),
    "mig-config-devices": ({"NVIDIA_MIG_CONFIG_DEVICES": NASTY}, "NVIDIA_MIG_CONFIG_DEVICES="),
    "mig-monitor-devices": ({"NVIDIA_MIG_MONITOR_DEVICES": NASTY}, "NVIDIA_MIG_MONITOR_DEVICES="),
    "driver-capabilities": ({"NVIDIA_DRIVER_CAPABILITIES": "compute," + NASTY}, "unknown capability"),
    "require-value": ({"NVIDIA_REQUIRE_CUDA": "cuda>=" + NASTY}, "not a version"),
    "require-name": ({"NVIDIA_REQUIRE_" + NASTY: "cuda>>12"}, "unknown operator"),
    "cuda-version": ({"CUDA_VERSION": NASTY}, "not a CUDA version"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_error_line_and_log_record_escape_image_text(name, host, tmp_path):
    extra, words = CASES[name]
    env = {"NVIDIA_VISIBLE_DEVICES": "0", **extra}
    config = _config(tmp_path, host)
    result = hookcheck.run_hook(config, _state(_bundle(tmp_path, env)), timeout=30)
    assert result.returncode == REQUEST_ERROR, result.stderr
    assert result.stderr.endswith(b"\n") and result.stderr.count(b"\n") == 1, result.stderr
    assert_clean_bytes(result.stderr, "the error line")
    line = hookcheck.one_clear_line(result.stderr)
    assert words in line and ESCAPED_ESC in line, line  # shown, escaped, not dropped
    records = log_records(tmp_path)
    assert [r["level"] for r in records] == ["error"]
    # ... and so is the decoded message: the escaped form, as on stderr.
    assert_shown_safely(records[0]["message"], "the log record's message")
    assert "oci-gpu-hook: " + records[0]["message"] == line


@pytest.mark.parametrize("where", ["annotation", "volume mount"])
def test_the_line_naming_the_annotation_or_mount_that_asked_escapes_it(where, host, tmp_path):
    """A device id the host lacks is refused with what named it: the pod's annotation (its key
    and value) or the volume mount (its name under /var/run/nvidia-container-devices)."""
    from hookcheck import config_with

    config = config_with(host, tmp_path, f"accept_cdi_annotations: true\naccept_volume_mounts: true\n"
                         f"logging: {{level: info, file: {tmp_path}/hook.log}}\n")  # fmt: skip
    bundle = _bundle(tmp_path, {"NVIDIA_VISIBLE_DEVICES": "0"})
    with open(f"{bundle}/config.json") as f:
        doc = json.load(f)
    if where == "annotation":
        doc["annotations"] = {"cdi.k8s.io/" + NASTY: "nvidia.com/gpu=7"}
        words = ": no GPU 7 (this host has"
    else:
        doc["mounts"].append({"destination": "/var/run/nvidia-container-devices/7" + NASTY, "source": "/dev/null",
                              "type": "bind", "options": ["ro", "bind"]})  # fmt: skip
        words = "volume mount /var/run/nvidia-container-devices/7"
    with open(f"{bundle}/config.json", "w") as f:
        json.dump(doc, f)
    result = hookcheck.run_hook(config, _state(bundle), timeout=30)
    assert result.returncode == REQUEST_ERROR, result.stderr
    assert_clean_bytes(result.stderr, "the error line")
    line = hookcheck.one_clear_line(result.stderr)
    assert line.startswith(f"oci-gpu-hook: {where} ") and words in line and ESCAPED_ESC in line, line
    (record,) = log_records(tmp_path)
    assert "oci-gpu-hook: " + record["message"] == line


def test_note_in_the_log_of_a_configured_container(host, tmp_path, live_container):
    """The MPS note (the image's CUDA_MPS_PIPE_DIRECTORY) on the success path: no HookError."""
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/" + NASTY}
    state, *_ = live_container(env)
    result = hookcheck.run_hook(_config(tmp_path, host), state, timeout=60)
    assert result.returncode == 0, result.stderr
    (record,) = log_records(tmp_path)
    assert record["message"] == "GPU devices configured"
    (note,) = record["notes"]
    assert note.startswith("CUDA_MPS_PIPE_DIRECTORY=/tmp/" + ESCAPED_ESC), note
    assert_shown_safely(note, "the note")


def test_plan_output_escapes_image_text(host, tmp_path, hook_cli):
    """`plan` shows the request (with the image's NVIDIA_REQUIRE_* names) and the notes."""
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/" + NASTY,
           "NVIDIA_REQUIRE_" + NASTY: "cuda>=1.0"}  # fmt: skip
    bundle = _bundle(tmp_path, env)
    out = subprocess.run([*hook_command(_config(tmp_path, host)), "plan", "--bundle", bundle], capture_output=True,
                         env=hookcheck.HOOK_ENV, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert_clean_bytes(out.stdout, "plan's output")
    text = out.stdout.decode()
    assert "note: CUDA_MPS_PIPE_DIRECTORY=/tmp/" + ESCAPED_ESC in text
    assert "requirements: NVIDIA_REQUIRE_" + ESCAPED_ESC in text
    as_json = subprocess.run([*hook_command(_config(tmp_path, host)), "plan", "--bundle", bundle, "--json"],
                             capture_output=True, env=hookcheck.HOOK_ENV, timeout=60)  # fmt: skip
    assert as_json.returncode == 0, as_json.stderr
    assert all(0x20 <= b < 0x7F or b == 0x0A for b in as_json.stdout), as_json.stdout[:300]
    assert_shown_safely(" ".join(json.loads(as_json.stdout)["notes"]), "plan --json's notes")


def test_internal_error_line_escapes_the_exception_text(monkeypatch, capsys):
    """A bug's exception text can quote anything: it gets the same escaping as a HookError."""

    def broken(argv, as_program=False):
        raise RuntimeError(NASTY)

    monkeypatch.setattr(hook, "run", broken)
    assert hook.main(["prestart"]) == hook.INTERNAL_ERROR_EXIT
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, repr(err)
    assert err.startswith("oci-gpu-hook: internal error: RuntimeError: ") and ESCAPED_ESC in err, repr(err)
    assert_shown_safely(err[:-1], "the internal error line")


def test_log_file_and_syslog_records(tmp_path, monkeypatch):
    """report.log whatever it is given: JSON in the file, an escaped line for syslog."""
    import syslog

    sent = []
    monkeypatch.setattr(syslog, "openlog", lambda *a: None)
    monkeypatch.setattr(syslog, "syslog", lambda priority, message: sent.append(message))
    log = tmp_path / "hook.log"
    settings = Settings(logging=LoggingSettings(level="info", file=str(log), syslog=True))
    report.log(settings, "id" + NASTY, "error", "raw " + NASTY, notes=[NASTY], bundle="/b" + NASTY)
    (message,) = sent
    assert_shown_safely(message, "the syslog message")
    assert message.startswith("container id" + ESCAPED_ESC)
    data = log.read_bytes()
    assert all(0x20 <= b < 0x7F or b == 0x0A for b in data), data[:300]
    assert json.loads(data)["notes"] == [NASTY]  # the file keeps the value exactly, JSON-escaped


# --- errors.printable itself -------------------------------------------------------------------

UNSAFE = (
    [chr(c) for c in range(0x20)] + ["\x7f"] + [chr(c) for c in range(0x80, 0xA0)]
    + ["\u2028", "\u2029", "\u061c", "\u200e", "\u200f", "\u200b", "\ufeff"]
    + [chr(c) for c in range(0x202A, 0x202F)] + [chr(c) for c in range(0x2066, 0x206A)]
    + ["\ud800", "\udfff", "\U000e0001"]
)  # fmt: skip


@pytest.mark.parametrize("char", UNSAFE, ids=lambda c: f"U+{ord(c):04X}")
def test_every_unsafe_character_is_escaped(char):
    for shown in (errors.printable(f"a{char}b"), errors.HookError(f"a{char}b").message):
        assert_shown_safely(shown, "printable()")
        folded = char.isspace() and shown == "a b"  # HookError folds whitespace into one line
        assert folded or (shown.startswith("a") and shown.endswith("b") and len(shown) > 3), shown
        assert errors.printable(shown) == shown  # twice is once


def test_ordinary_text_is_kept():
    text = "/usr/lib64/libcuda.so.1: naïve Ünïcode 中文 \\x1b stays, as do 'quotes' and \"these\""
    assert errors.printable(text) == text
    assert errors.HookError(text).message == text
