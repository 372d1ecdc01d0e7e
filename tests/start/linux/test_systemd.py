"""The hook's D-Bus call to systemd (start/linux/systemd.py), against real D-Bus peers.

A private dbus-daemon (its own socket and configuration, stopped by pid) and, on it, a service
written with dbus-python (libdbus parses every byte we send) standing in for systemd's Manager
object: it records what SetUnitProperties received, and answers one unit with systemd's NoSuchUnit
error. The same call made by busctl (sd-bus, systemd's own library) is recorded beside ours, and
the two must be the same. systemd itself, over its private socket, is the node VM's scenario
(tests/vm/scenarios/systemd_daemon_reload.sh).
"""

import json
import os
import signal
import struct
import subprocess
import textwrap
import time

import pytest

from oci_gpu_hook.start.linux import systemd

SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's, which has dbus-python and GLib (python3-dbus, python3-gi)
DEVICES = [(195, 255, "rw"), (195, 0, "rw"), (508, 1, "rw")]

SERVICE = textwrap.dedent(
    """
    import json, sys
    import dbus, dbus.service, dbus.mainloop.glib
    from gi.repository import GLib

    class NoSuchUnit(dbus.DBusException):
        _dbus_error_name = "org.freedesktop.systemd1.NoSuchUnit"

    class AccessDenied(dbus.DBusException):
        _dbus_error_name = "org.freedesktop.DBus.Error.AccessDenied"

    def unescape(label):  # sd-bus's bus_label_unescape: _XX is the byte XX
        out, i = bytearray(), 0
        while i < len(label):
            if label[i] == "_":
                out.append(int(label[i + 1 : i + 3], 16))
                i += 3
            else:
                out += label[i].encode()
                i += 1
        return out.decode()

    class Units(dbus.service.FallbackObject):
        # the units' objects (/org/freedesktop/systemd1/unit/NAME): a scope's DevicePolicy and
        # DeviceAllow, as sys.argv[3] (JSON) says; a unit it does not name has systemd's defaults

        @dbus.service.method("org.freedesktop.DBus.Properties", in_signature="ss", out_signature="v",
                             rel_path_keyword="rel")
        def Get(self, interface, name, rel):
            unit = unescape(rel.lstrip("/"))
            with open(sys.argv[2], "a") as f:
                f.write(json.dumps({"get": [unit, str(interface), str(name)]}) + "\\n")
            with open(sys.argv[3]) as f:
                config = json.load(f).get(unit, {})
            if config.get("denied"):
                raise AccessDenied("SELinux policy denies access.")
            if name == "DevicePolicy":
                return dbus.String(config.get("policy", "auto"), variant_level=1)
            if name == "DeviceAllow":
                return dbus.Array([dbus.Struct(e, signature="ss") for e in config.get("allow", [])],
                                  signature="(ss)", variant_level=1)
            raise dbus.DBusException("org.freedesktop.DBus.Error.UnknownProperty")

    class Manager(dbus.service.Object):
        @dbus.service.method("org.freedesktop.systemd1.Manager", in_signature="sba(sv)", out_signature="")
        def SetUnitProperties(self, unit, runtime, properties):
            if unit == "missing.scope":
                raise NoSuchUnit("Unit missing.scope not loaded.")
            record = {"unit": str(unit), "runtime": bool(runtime), "properties": [
                [str(name), value.signature, [[str(path), str(access)] for path, access in value]]
                for name, value in properties]}
            with open(sys.argv[2], "a") as f:
                f.write(json.dumps(record) + "\\n")

    dbus.mainloop.glib.DBusGMainLoop(set_as_default=True)
    bus = dbus.bus.BusConnection(sys.argv[1])
    name = dbus.service.BusName("org.freedesktop.systemd1", bus)
    Manager(bus, "/org/freedesktop/systemd1")
    Units(bus, "/org/freedesktop/systemd1/unit")
    print("ready", flush=True)
    GLib.MainLoop().run()
    """
)

BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>custom</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>
</busconfig>
"""


def _stop(proc):
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def fake_systemd(tmp_path, require):
    """(bus socket, the file of recorded calls, the units' settings (JSON) the stand-in answers
    with): a private bus with the stand-in Manager and unit objects on it."""
    require("dbus-daemon", "busctl", SYSTEM_PYTHON)
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import dbus.mainloop.glib, gi.repository.GLib"], capture_output=True)
    if probe.returncode != 0:
        require("python3-dbus and python3-gi for " + SYSTEM_PYTHON)  # skips, or fails under REQUIRE_ALL
    socket_path = str(tmp_path / "bus")
    config = tmp_path / "bus.conf"
    config.write_text(BUS_CONFIG.format(socket=socket_path))
    daemon = subprocess.Popen(["dbus-daemon", f"--config-file={config}", "--nofork", "--nopidfile"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    service = None
    try:
        for _ in range(200):
            if os.path.exists(socket_path):
                break
            time.sleep(0.05)
        assert os.path.exists(socket_path), daemon.stderr.read1().decode() if daemon.poll() is not None else "no socket"
        calls = tmp_path / "calls.jsonl"
        script = tmp_path / "manager.py"
        script.write_text(SERVICE)
        units = tmp_path / "units.json"
        units.write_text("{}")
        service = subprocess.Popen([SYSTEM_PYTHON, str(script), f"unix:path={socket_path}", str(calls), str(units)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        assert service.stdout.readline().strip() == "ready", service.stderr.read()
        yield socket_path, calls, units
    finally:
        if service is not None:
            _stop(service)
        _stop(daemon)


def _recorded(calls, kind="unit"):
    """The recorded SetUnitProperties calls (kind "unit") or Properties.Get calls ("get")."""
    lines = calls.read_text().splitlines() if calls.exists() else []
    return [record if kind == "unit" else record["get"] for record in map(json.loads, lines) if kind in record]


def test_the_call_is_what_libdbus_reads_and_what_sd_bus_sends(fake_systemd):
    socket_path, calls, units = fake_systemd
    units.write_text(json.dumps({"libpod-0123abcd.scope": {"policy": "strict"}}))
    assert (
        systemd.keep_devices("/sys/fs/cgroup/machine.slice/libpod-0123abcd.scope", DEVICES, socket_path, bus=True)
        is None
    )
    # the same call, made by systemd's own library
    args = ["libpod-0123abcd.scope", "true", "1", "DeviceAllow", "a(ss)", str(len(DEVICES))]
    for major, minor, access in DEVICES:
        args += [f"/dev/char/{major}:{minor}", access]
    done = subprocess.run(
        ["busctl", f"--address=unix:path={socket_path}", "call", "org.freedesktop.systemd1",
         "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager", "SetUnitProperties", "sba(sv)", *args],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    ours, sd_bus = _recorded(calls)
    assert ours == sd_bus
    assert ours == {
        "unit": "libpod-0123abcd.scope",
        "runtime": True,
        "properties": [["DeviceAllow", "(ss)", [["/dev/char/195:255", "rw"], ["/dev/char/195:0", "rw"],
                                                 ["/dev/char/508:1", "rw"]]]],
    }  # fmt: skip


def test_an_error_reply_is_said_in_one_line(fake_systemd):
    socket_path, calls, units = fake_systemd
    units.write_text(json.dumps({"missing.scope": {"policy": "strict"}}))
    note = systemd.keep_devices("/sys/fs/cgroup/machine.slice/missing.scope", DEVICES, socket_path, bus=True)
    assert note == ("systemd not told of the GPU nodes of missing.scope (a daemon-reload will take them away): "
                    "org.freedesktop.systemd1.NoSuchUnit: Unit missing.scope not loaded.")  # fmt: skip
    assert _recorded(calls) == []


def test_keep_devices_tells_a_scope_whose_devices_systemd_filters_as_systemd_says(fake_systemd):
    """Whether to tell is asked of systemd (Properties.Get on the scope's object), never read from
    files: a policy from any source counts (here none of systemd's files exist). Only the cgroup's
    own scope; DevicePolicy strict or closed, or auto with a DeviceAllow list (with auto and none,
    a first DeviceAllow would turn systemd's filtering on); no systemd: nothing, quietly; systemd
    refusing a question or the call: one line."""
    socket_path, calls, units = fake_systemd
    units.write_text(json.dumps({
        "libpod-aa.scope": {"policy": "strict"},
        "libpod-bb.scope": {"policy": "auto"},
        # CRI-O's scope under the kubelet (runc's systemd driver: the policy set after the start)
        "crio-0f1e.scope": {"policy": "strict", "allow": [["char-pts", "rwm"]]},
        # an administrator's drop-in, e.g. /etc/systemd/system/app-.scope.d/: auto with a list
        "app-x@1.scope": {"policy": "auto", "allow": [["/dev/null", "rw"]]},
        "session-3.scope": {"policy": "closed"},
        "missing.scope": {"policy": "closed"},
        "denied.scope": {"denied": True},
    }))  # fmt: skip

    def keep(cgroup, address=socket_path):
        # over the bus: the stand-in needs Hello, systemd's private socket does not
        return systemd.keep_devices(cgroup, DEVICES, address, bus=True)

    slice_dir = "/sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice"
    assert keep("/sys/fs/cgroup/machine.slice/libpod-aa.scope") is None
    assert keep("/sys/fs/cgroup/machine.slice/libpod-bb.scope") is None  # auto, no list: left alone
    assert keep(f"{slice_dir}/crio-0f1e.scope") is None
    assert keep("/sys/fs/cgroup/app.slice/app-x@1.scope/") is None
    assert keep("/sys/fs/cgroup/user.slice/session-3.scope/podman/c1") is None  # not the cgroup's own
    assert keep("/sys/fs/cgroup/machine/libpod-cc") is None  # cgroupfs driver: no scope
    assert keep("/sys/fs/cgroup/machine.slice/libpod-aa.scope", socket_path + ".none") is None  # no systemd
    note = keep("/sys/fs/cgroup/machine.slice/missing.scope")
    assert "systemd not told of the GPU nodes of missing.scope" in note and "NoSuchUnit" in note
    note = keep("/sys/fs/cgroup/machine.slice/denied.scope")
    assert note.startswith("systemd not told of the GPU nodes of denied.scope") and "AccessDenied" in note
    assert [call["unit"] for call in _recorded(calls)] == ["libpod-aa.scope", "crio-0f1e.scope", "app-x@1.scope"]
    # the unit's object path is escaped as sd-bus does (the stand-in unescapes it), the question
    # is on the scope's interface, and DeviceAllow is asked only where the policy is auto
    scope = "org.freedesktop.systemd1.Scope"
    assert _recorded(calls, "get") == [
        ["libpod-aa.scope", scope, "DevicePolicy"],
        ["libpod-bb.scope", scope, "DevicePolicy"], ["libpod-bb.scope", scope, "DeviceAllow"],
        ["crio-0f1e.scope", scope, "DevicePolicy"],
        ["app-x@1.scope", scope, "DevicePolicy"], ["app-x@1.scope", scope, "DeviceAllow"],
        ["missing.scope", scope, "DevicePolicy"],
        ["denied.scope", scope, "DevicePolicy"],
    ]  # fmt: skip


def test_a_property_reply_is_read_as_d_bus_marshals_it():
    """read_variant against the bytes of Properties.Get replies as D-Bus marshals them (a
    variant "s", a variant "a(ss)" empty and not), and truncated or mistyped ones: SystemdError
    (keep_devices makes it the log record's one line), never another exception."""
    policy = b"\x01s\x00\x00" + struct.pack("<I", 6) + b"strict\x00"
    assert systemd.read_variant("v", policy, "s") == "strict"
    empty = b"\x05a(ss)\x00\x00" + struct.pack("<I", 0)
    assert systemd.read_variant("v", empty, "a(ss)") == 0
    assert systemd.read_variant("v", b"\x05a(ss)\x00\x00" + struct.pack("<I", 24) + b"\0" * 24, "a(ss)") == 24
    for truncated in (b"\x01s\x00", policy[:-3], b"\x05a(ss)"):
        with pytest.raises(systemd.SystemdError, match="truncated"):
            systemd.read_variant("v", truncated, "s")
    with pytest.raises(systemd.SystemdError, match="of type 's', not 'a\\(ss\\)'"):
        systemd.read_variant("v", policy, "a(ss)")
    with pytest.raises(systemd.SystemdError, match="not a variant"):
        systemd.read_variant("s", policy, "s")
