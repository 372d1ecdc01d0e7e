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
import sys
import textwrap
import time

import dbuspeer
import pytest

from oci_gpu_hook.start.linux import systemd
from oci_gpu_hook.toolkit import systemd_manager

SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's, which has dbus-python and GLib (python3-dbus, python3-gi)
DEVICES = [(195, 255, "rw"), (195, 0, "rw"), (508, 1, "rw")]

SERVICE = textwrap.dedent(
    """
    import json, sys, time
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

    def record(member, *words):  # a job call as the manager's log has it; its (made-up) job
        with open(sys.argv[2], "a") as f:
            f.write(json.dumps({"manager": [member, *map(str, words)]}) + "\\n")
        return dbus.ObjectPath("/org/freedesktop/systemd1/job/8")

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

        @dbus.service.method("org.freedesktop.systemd1.Manager", in_signature="", out_signature="")
        def Reload(self):
            with open(sys.argv[3]) as f:  # a systemd busy before it reloads: its answer comes that late
                time.sleep(json.load(f).get("reload seconds", 0))
            record("Reload")

        @dbus.service.method("org.freedesktop.systemd1.Manager", in_signature="ss", out_signature="o")
        def StartUnit(self, unit, mode):
            return record("StartUnit", unit, mode)

        @dbus.service.method("org.freedesktop.systemd1.Manager", in_signature="ss", out_signature="o")
        def StopUnit(self, unit, mode):
            if unit == "missing.service":
                raise NoSuchUnit("Unit missing.service not loaded.")
            return record("StopUnit", unit, mode)

        @dbus.service.method("org.freedesktop.systemd1.Manager", in_signature="ss", out_signature="o")
        def TryRestartUnit(self, unit, mode):
            return record("TryRestartUnit", unit, mode)

        @dbus.service.method("org.freedesktop.systemd1.Manager", in_signature="ss", out_signature="o")
        def RestartUnit(self, unit, mode):
            if unit == "missing.service":
                raise NoSuchUnit("Unit missing.service not found.")
            with open(sys.argv[2], "a") as f:
                f.write(json.dumps({"restart": [str(unit), str(mode)]}) + "\\n")
            return dbus.ObjectPath("/org/freedesktop/systemd1/job/7")

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
    require("dbus-daemon", "busctl")
    _require_system_python(require)
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
    """The recorded SetUnitProperties calls (kind "unit"), Properties.Get calls ("get") or
    RestartUnit calls ("restart")."""
    lines = calls.read_text().splitlines() if calls.exists() else []
    return [record if kind == "unit" else record[kind] for record in map(json.loads, lines) if kind in record]


def test_install_starts_its_units_as_systemctl_daemon_reload_and_start(fake_systemd, tmp_path):
    """install --start-units (toolkit/install.py's start_units): Reload, then StartUnit(unit,
    "replace") for each unit, in order, on one connection; a line saying so."""
    from oci_gpu_hook.toolkit import install

    socket_path, calls, _ = fake_systemd
    units = install.units_to_start(str(tmp_path), node_services=True)
    assert units == [install.PATH_UNIT, install.SERVICE, install.EXPORTER_SERVICE, install.LABELS_SERVICE,
                     install.WATCHDOG_SERVICE]  # fmt: skip
    lines = install.start_units(units, socket_path, bus=True)
    assert lines == [f"started {' '.join(units)} (systemd reloaded)"]
    assert _recorded(calls, "manager") == [["Reload"]] + [["StartUnit", unit, "replace"] for unit in units]
    # An upgrade that changed the start server's launcher restarts the server where it runs.
    calls.unlink()
    lines = install.start_units(units[:1], socket_path, bus=True, restart=[install.START_SERVICE])
    assert lines == [f"restarted {install.START_SERVICE} where it ran", f"started {units[0]} (systemd reloaded)"]
    assert _recorded(calls, "manager") == [["Reload"], ["TryRestartUnit", install.START_SERVICE, "replace"],
                                           ["StartUnit", units[0], "replace"]]  # fmt: skip


def test_uninstall_stops_the_units_it_removes_and_reloads_after(fake_systemd, tmp_path, monkeypatch):
    """uninstall --stop-units: StopUnit for each unit install wrote (not its wants links), then
    the removal, then Reload, so systemd is left running nothing of ours. --stop-units acts only
    on /, so here its three steps run one by one on a tree, against the stand-in manager. The
    toolkit's e2e test runs the whole of it on a host without systemd."""
    from oci_gpu_hook.toolkit import install

    socket_path, calls, _ = fake_systemd
    root = str(tmp_path / "root")
    os.makedirs(root)
    install.install(root, ("podman",), ["/usr/bin/oci-gpu-hook"], node_services=True)
    with open(root + install.MANIFEST) as f:
        units = install._units_written(json.load(f))
    assert units == sorted([install.SERVICE, install.PATH_UNIT, install.EXPORTER_SERVICE, install.LABELS_SERVICE,
                            install.WATCHDOG_SERVICE])  # fmt: skip
    with pytest.raises(install.InstallError, match="--stop-units: only when uninstalling from /"):
        install.uninstall(root, stop_units=True, address=socket_path, bus=True)
    lines = install._manage_units([("StopUnit", u) for u in units], "stopped", socket_path, True)
    lines += install.uninstall(root)
    lines += install._manage_units([("Reload", None)], "systemd reloaded", socket_path, True)
    assert lines[0] == "stopped" and lines[-1] == "systemd reloaded"
    assert _recorded(calls, "manager") == [["StopUnit", u, "replace"] for u in units] + [["Reload"]]
    assert not os.path.lexists(root + install.MANIFEST)


def test_stopping_a_unit_systemd_does_not_know_is_stopping_nothing(fake_systemd):
    """uninstall --stop-units on a host where a unit install wrote is not loaded (its file gone,
    or systemd never read it): systemd's NoSuchUnit to StopUnit means there is nothing to stop,
    and the calls after it are made; to any other call it is still an error."""
    socket_path, calls, _ = fake_systemd
    systemd_manager.manage([("StopUnit", "missing.service"), ("StopUnit", "there.service"), ("Reload", None)],
                           socket_path, bus=True)  # fmt: skip
    assert _recorded(calls, "manager") == [["StopUnit", "there.service", "replace"], ["Reload"]]
    with pytest.raises(systemd.SystemdError, match=r"NoSuchUnit"):
        systemd_manager.manage([("RestartUnit", "missing.service")], socket_path, bus=True)


def test_a_reload_is_given_systemctls_time_and_the_other_calls_less(fake_systemd, monkeypatch):
    """A connection with a Reload on it waits RELOAD_TIMEOUT for systemd's answers, as
    `systemctl daemon-reload` does; one without, TIMEOUT. Both bounds shrunk to seconds here; the
    stand-in answers the reload 1.5 s late, as a busy systemd does."""
    socket_path, calls, units = fake_systemd
    units.write_text(json.dumps({"reload seconds": 1.5}))
    monkeypatch.setattr(systemd_manager, "TIMEOUT", 0.5)
    monkeypatch.setattr(systemd_manager, "RELOAD_TIMEOUT", 10.0)
    systemd_manager.manage([("StopUnit", "there.service"), ("Reload", None)], socket_path, bus=True)
    assert _recorded(calls, "manager") == [["StopUnit", "there.service", "replace"], ["Reload"]]
    monkeypatch.setattr(systemd_manager, "RELOAD_TIMEOUT", 0.5)
    with pytest.raises(systemd.SystemdError, match=r"^systemd did not answer within 0\.5 s$"):
        systemd_manager.manage([("Reload", None)], socket_path, bus=True)


def test_restart_unit_is_systemctl_restarts_call(fake_systemd):
    """RestartUnit(unit, "replace"), as `systemctl restart` asks it (toolkit/restart.py), and the
    same call made by busctl; an error reply is one line."""
    socket_path, calls, _ = fake_systemd
    systemd_manager.restart_unit("containerd.service", socket_path, bus=True)
    done = subprocess.run(["busctl", f"--address=unix:path={socket_path}", "call", "org.freedesktop.systemd1",
                           "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager", "RestartUnit", "ss",
                           "containerd.service", "replace"], capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert _recorded(calls, "restart") == [["containerd.service", "replace"]] * 2
    with pytest.raises(systemd.SystemdError, match=r"^org\.freedesktop\.systemd1\.NoSuchUnit: Unit missing"):
        systemd_manager.restart_unit("missing.service", socket_path, bus=True)


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


# Properties.Get replies as GLib's GDBus marshals them (D-Bus written by neither the client nor
# dbuspeer), each the answer to a connection's first call (serial 1): for each [type, value] a
# variant of that type, for [None, text] a body that is a bare string.
GDBUS_REPLIES = """
import json, sys
from gi.repository import Gio, GLib
for kind, value in json.loads(sys.argv[1]):
    call = Gio.DBusMessage.new_method_call("org.freedesktop.systemd1", "/org/freedesktop/systemd1/unit/x",
                                           "org.freedesktop.DBus.Properties", "Get")
    call.set_serial(1)
    reply = Gio.DBusMessage.new_method_reply(call)
    reply.set_serial(7)
    if kind is None:
        reply.set_body(GLib.Variant("(s)", (value,)))
    else:
        value = [tuple(entry) for entry in value] if kind == "a(ss)" else value
        reply.set_body(GLib.Variant("(v)", (GLib.Variant(kind, value),)))
    print(reply.to_blob(Gio.DBusCapabilityFlags.NONE).hex())
"""


def _require_system_python(require):
    require(SYSTEM_PYTHON)
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import dbus.mainloop.glib, gi.repository.GLib"], capture_output=True)
    if probe.returncode != 0:
        require("python3-dbus and python3-gi for " + SYSTEM_PYTHON)  # skips, or fails under REQUIRE_ALL


def _gdbus_replies(values) -> list:
    done = subprocess.run([SYSTEM_PYTHON, "-c", GDBUS_REPLIES, json.dumps(values)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [bytes.fromhex(line) for line in done.stdout.split()]


def _with_body(message: bytes, body: bytes) -> bytes:
    """message with its body replaced by body, its header's body length saying so."""
    _, _, fields_length = struct.unpack_from("<III", message, 4)
    body_at = 16 + fields_length + (-(16 + fields_length) % 8)
    return message[:4] + struct.pack("<I", len(body)) + message[8:body_at] + body


def test_a_property_reply_is_read_as_d_bus_marshals_it(tmp_path, require):
    """Properties.Get replies as GDBus marshals them, read by the client's own call over a socket
    (_get_property: parse_reply for the message, read_variant for its body): a DevicePolicy, and a
    DeviceAllow empty and not. Then the same messages broken: each body cut short (its header
    saying so, every length), a string or array longer than the body holds, another type than
    asked, a body that is no variant: SystemdError (keep_devices makes it the log record's one
    line), never another exception, never a value."""
    _require_system_python(require)
    policy, empty, allowed, bare = _gdbus_replies([["s", "strict"], ["a(ss)", []],
                                                   ["a(ss)", [["/dev/null", "rw"], ["char-pts", "rwm"]]],
                                                   [None, "strict"]])  # fmt: skip
    path = str(tmp_path / "private")
    current = {}

    def get(reply: bytes, kind: str):
        current["replies"] = [reply]
        conn = systemd._Connection(path, bus=False)
        try:
            return systemd._get_property(conn, "libpod-0a.scope", "DeviceAllow", kind)
        finally:
            conn.close()

    with dbuspeer.Peer(path, lambda: (current["replies"], 0.0)):
        assert get(policy, "s") == "strict"
        assert get(empty, "a(ss)") == 0
        assert get(allowed, "a(ss)") > 0
        broken = []
        for reply, kind in ((policy, "s"), (empty, "a(ss)"), (allowed, "a(ss)")):
            body = systemd.parse_reply(reply)[0][5]
            broken += [(_with_body(reply, body[:cut]), kind, "truncated") for cut in range(len(body))]
        longer = bytearray(systemd.parse_reply(policy)[0][5])
        struct.pack_into("<I", longer, 4, 7)  # "strict" and its nul, said to be 7 long
        broken.append((_with_body(policy, bytes(longer)), "s", "truncated"))
        longer = bytearray(systemd.parse_reply(allowed)[0][5])
        struct.pack_into("<I", longer, 8, struct.unpack_from("<I", longer, 8)[0] + 1)  # one byte past the body
        broken.append((_with_body(allowed, bytes(longer)), "a(ss)", "truncated"))
        broken += [(policy, "a(ss)", "of type 's', not 'a\\(ss\\)'"), (allowed, "s", "of type 'a\\(ss\\)', not 's'"),
                   (bare, "s", "not a variant")]  # fmt: skip
        for reply, kind, why in broken:
            with pytest.raises(systemd.SystemdError, match=why):
                get(reply, kind)


# --- what a hostile peer can do (issue 46, item 5) -----------------------------------------------
#
# The client runs after the apply committed: whatever its socket sends, SystemdError is all that
# reading it raises, keep_devices never raises (a note for the log), and the whole exchange ends
# within one deadline. The peer is tests/dbuspeer.py, on a socket of the test's own.

SCOPE = "/sys/fs/cgroup/machine.slice/libpod-0123abcd.scope"


def _allow_list_reply(serial: int) -> bytes:
    """Properties.Get's answer for DeviceAllow: a variant a(ss) of one entry."""
    entry = struct.pack("<I", 9) + b"/dev/null\0\0\0" + struct.pack("<I", 2) + b"rw\0"
    body = b"\x05a(ss)\0\0" + struct.pack("<I", len(entry)) + b"\0" * 4 + entry  # the elements 8-aligned
    return dbuspeer.reply(dbuspeer.METHOD_RETURN, 9, [(dbuspeer.REPLY_SERIAL, "u", serial),
                                                      (dbuspeer.SIGNATURE, "g", "v")], body)  # fmt: skip


def _done(serial: int) -> bytes:
    return dbuspeer.reply(dbuspeer.METHOD_RETURN, 10, [(dbuspeer.REPLY_SERIAL, "u", serial)])


SIGNAL = dbuspeer.reply(dbuspeer.SIGNAL, 11, [(dbuspeer.PATH, "o", "/org/freedesktop/systemd1"),
                                              (dbuspeer.INTERFACE, "s", "org.freedesktop.systemd1.Manager"),
                                              (dbuspeer.MEMBER, "s", "Reloading"), (dbuspeer.SIGNATURE, "g", "b")],
                        b"\x01\0\0\0")  # fmt: skip
# Whole exchanges as systemd answers them (strict; auto with a list; refused), each a list of the
# replies to the client's calls in turn. The fuzz mutates the last reply of a prefix of one: a
# peer that answered a call wrongly and then waited for the next would hold the client until its
# deadline, for nothing the test looks at.
EXCHANGES = [
    [SIGNAL + dbuspeer.property_reply(1, "strict"), _done(2)],
    [dbuspeer.property_reply(1, "auto"), _allow_list_reply(2), _done(3)],
    [dbuspeer.property_reply(1, "closed"),
     dbuspeer.error_reply(2, "org.freedesktop.systemd1.NoSuchUnit", "Unit libpod-0123abcd.scope not loaded.")],
]  # fmt: skip


def _mutations(rng, seed: bytes):
    """Mutations of seed as a fuzzer makes them: bytes flipped or set, runs cut, inserted or
    repeated, a length or count field set to a large or small value, the whole cut short."""
    data = bytearray(seed)
    for _ in range(rng.randrange(1, 4)):
        how = rng.randrange(6)
        at = rng.randrange(len(data)) if data else 0
        if how == 0 and data:
            data[at] ^= 1 << rng.randrange(8)
        elif how == 1 and data:
            data[at] = rng.choice((0x00, 0x7F, 0x80, 0xFF, ord("s"), ord("g"), ord("u"), ord("v"), ord("a")))
        elif how == 2:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif how == 3:
            del data[at : at + rng.randrange(1, 9)]
        elif how == 4 and len(data) >= 4:
            at = rng.randrange(len(data) - 3) & ~3
            data[at : at + 4] = struct.pack("<I", rng.choice((0, 1, 3, 255, 4096, 1 << 19, 0xFFFFFFFF)))
        else:
            data = data[: rng.randrange(len(data) + 1)]
    return bytes(data)


def test_parse_reply_raises_systemd_error_alone_whatever_the_bytes():
    """20,000 mutations of real replies (and random bytes): a parse, None (more to come) or
    SystemdError, never another exception (once: UnicodeDecodeError and AttributeError). The body
    of each parse read as a property of either type the client asks (read_variant): a value
    within the body, or SystemdError (once: an array's length past the body, taken as a count)."""
    import random

    rng = random.Random(46)
    seeds = [reply for exchange in EXCHANGES for reply in exchange] + [dbuspeer.GARBAGE]
    outcomes = {"parsed": 0, "incomplete": 0, "refused": 0, "value": 0, "value refused": 0}
    for case in range(20000):
        data = _mutations(rng, rng.choice(seeds)) if case % 10 else bytes(rng.randrange(256) for _ in range(64))
        try:
            parsed = systemd.parse_reply(data)
        except systemd.SystemdError:
            outcomes["refused"] += 1
            continue
        outcomes["incomplete" if parsed is None else "parsed"] += 1
        if parsed is not None:
            (kind, reply_serial, error_name, text, signature, body), length = parsed
            assert isinstance(error_name, str) and isinstance(text, str) and isinstance(signature, str)
            assert reply_serial is None or isinstance(reply_serial, int)
            assert length <= len(data) and isinstance(body, bytes)
            for kind in ("s", "a(ss)"):
                try:
                    value = systemd.read_variant(signature, body, kind)
                except systemd.SystemdError:
                    outcomes["value refused"] += 1
                    continue
                outcomes["value"] += 1
                assert isinstance(value, str) if kind == "s" else 0 <= value <= len(body), (kind, value, body)
    assert all(outcomes.values()), outcomes  # the mutations reach every outcome


def test_keep_devices_never_raises_whatever_its_peer_answers(tmp_path):
    """5,000 exchanges with a peer whose last reply is mutated: keep_devices answers None or
    one line that says systemd was not told; nothing is raised, and none of them waits for its
    deadline (the peer ends each connection after its last reply)."""
    import random

    rng = random.Random(5)
    current = {}
    notes = set()
    started = time.monotonic()
    with dbuspeer.Peer(str(tmp_path / "private"), lambda: (current["replies"], 0.0)) as peer:
        for _ in range(5000):
            exchange = rng.choice(EXCHANGES)
            cut = rng.randrange(1, len(exchange) + 1)
            current["replies"] = exchange[: cut - 1] + [_mutations(rng, exchange[cut - 1])]
            note = systemd.keep_devices(SCOPE, DEVICES, str(tmp_path / "private"))
            assert note is None or (note.startswith("systemd not told of the GPU nodes of libpod-0123abcd.scope")
                                    and "\n" not in note and len(note) < 1500), note  # fmt: skip
            notes.add(note if note is None else note.split(": ", 1)[1][:40])
    assert peer.connections == 5000
    assert None in notes and len(notes) > 5, notes  # both outcomes, and many reasons
    assert time.monotonic() - started < 60


def _dribbling_peer(tmp_path, interval=0.5):
    """A peer that answers the first call with a whole, valid reply, a byte every interval."""
    return dbuspeer.Peer(str(tmp_path / "private"), lambda: ([dbuspeer.property_reply(1, "strict")], interval))


@pytest.mark.parametrize("timeout", [None, 0.5], ids=["its-own-deadline", "the-budgets-deadline"])
def test_a_dribbling_peer_is_left_at_the_exchanges_one_deadline(tmp_path, timeout):
    """A reply dribbled a byte every half second keeps each recv under any per-recv timeout (the
    whole reply would take about 30 s): the exchange ends at its one deadline, TIMEOUT or the
    shorter one the caller's budget leaves, and says so."""
    limit = systemd.TIMEOUT if timeout is None else timeout
    with _dribbling_peer(tmp_path) as peer:
        started = time.monotonic()
        if timeout is None:
            note = systemd.keep_devices(SCOPE, DEVICES, str(tmp_path / "private"))
        else:
            note = systemd.keep_devices(SCOPE, DEVICES, str(tmp_path / "private"), timeout=timeout)
        took = time.monotonic() - started
    assert peer.connections == 1
    assert limit - 0.1 <= took < limit + 0.5, took
    assert note == ("systemd not told of the GPU nodes of libpod-0123abcd.scope (a daemon-reload will take them "
                    f"away): systemd did not answer within {limit:.1f} s")  # fmt: skip


def test_after_the_apply_systemd_gets_what_is_left_of_the_budget(tmp_path, monkeypatch):
    """apply's call after the commit: the exchange is bounded by the hook's budget as well
    (here 0.4 s left), and with nothing left it is not begun; either way a note in the report,
    and the report goes on (the container record is written after it)."""
    from oci_gpu_hook.start import apply
    from oci_gpu_hook.start.budget import Budget

    monkeypatch.setattr(systemd, "PRIVATE_SOCKET", str(tmp_path / "private"))  # systemd's, on a real host

    def report():
        return {"cgroup": (SCOPE, DEVICES), "skipped": [], "timings": {}}

    with _dribbling_peer(tmp_path) as peer:
        started, left = time.monotonic(), report()
        apply._tell_systemd(left, Budget(0.4, age=0.0))
        took = time.monotonic() - started
        spent = report()
        apply._tell_systemd(spent, Budget(0.0, age=0.0))
    assert took < 0.9, took
    assert left["skipped"] == [systemd._not_told("libpod-0123abcd.scope", systemd.SystemdError(
        "systemd did not answer within 0.4 s"))]  # fmt: skip
    assert spent["skipped"] == [systemd._not_told("libpod-0123abcd.scope", systemd.SystemdError(
        "the hook's deadline had passed"))]  # fmt: skip
    assert peer.connections == 1 and "systemd" in left["timings"]


def test_a_cgroup_name_systemd_could_not_have_given_is_no_scope():
    """scope_of: names read from mountinfo hold any bytes; only systemd's characters make a unit
    name that is sent (unit_path and the marshalling encode it)."""
    assert systemd.scope_of("/sys/fs/cgroup/machine.slice/libpod-0a.scope") == "libpod-0a.scope"
    assert systemd.scope_of("/sys/fs/cgroup/app.slice/app-x@1\\x2d2:a_b.scope/") == "app-x@1\\x2d2:a_b.scope"
    for odd in ("libpod-\udcff.scope", "a b.scope", "caf\u00e9.scope", "x\n.scope"):
        assert systemd.scope_of(f"/sys/fs/cgroup/machine.slice/{odd}") is None, odd


def test_garbage_from_systemds_socket_after_the_apply_is_a_note_and_the_start_succeeds(live_container, tmp_path,
                                                                                       require):  # fmt: skip
    """End to end (case D3): the real hook starts a GPU container whose device cgroup is a scope,
    and what listens on systemd's private socket (in a mount namespace of the test's own, where
    /run/systemd is a fresh tmpfs) answers its first call with garbage that once raised
    UnicodeDecodeError out of the client. The apply had committed: the start succeeds (rc 0,
    nothing on stderr), the container has its GPU and its device rule, its record is written, and
    the log record of the start says that systemd was not told, and why."""
    require("root", "unshare")
    import hookcheck
    import privatehost

    from oci_gpu_hook.start import container_record

    state, bundle, pid, cgroup, host = live_container({"NVIDIA_VISIBLE_DEVICES": "0"})
    scope = cgroup + ".scope"  # what systemd names a container's cgroup: the hook then tells it
    os.mkdir(scope)
    container_id = f"systemd-peer-{os.getpid()}-{time.monotonic_ns()}"
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps({**json.loads(state), "id": container_id}))
    work = tmp_path / "private-host"
    work.mkdir()
    socket_path = "/run/systemd/private"
    try:
        with open(os.path.join(scope, "devices.deny"), "w") as f:
            f.write("a")
        with open(os.path.join(scope, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        peer, hook = privatehost.run(
            str(work), (), tmpfs=["/run/systemd" if os.path.isdir("/run/systemd") else "/run"],
            steps=[{"daemon": [sys.executable, "-I", dbuspeer.__file__, socket_path, "garbage"],
                    "ready": ["test", "-S", socket_path]},
                   {"run": ["sh", "-c", 'exec "$@" < "$0"', str(state_file),
                            *hookcheck.hook_command(f"{host['root']}/config.yaml"), "prestart"],
                    "env": hookcheck.HOOK_ENV}],
        )  # fmt: skip
        rules = hookcheck.device_rules(scope)
    finally:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(pid))  # back where the fixture removes it from
        hookcheck.remove_cgroup(scope)
    assert peer["rc"] == 0, peer["stderr"]
    assert (hook["rc"], hook["stderr"]) == (0, ""), hook["stderr"]
    minor = host["gpus"][0]["minor"]
    assert f"c 195:{minor} rw" in rules.splitlines(), rules
    with open(f"/proc/{pid}/mountinfo") as f:
        assert any(line.split()[4].endswith(f"/dev/nvidia{minor}") for line in f)
    with open(os.path.join(host["root"], "containers", container_record.file_name(container_id)), "rb") as f:
        record = container_record.parse(f.read())
    assert record is not None and (record["outcome"], record["pid"]) == ("started", pid), record
    assert [d["gpu_uuid"] for d in record["devices"]] == [host["gpus"][0]["uuid"]], record
    with open(f"{host['root']}/hook.log") as f:
        starts = [entry for entry in map(json.loads, f) if entry["container"] == container_id]
    assert [entry["message"] for entry in starts] == ["GPU devices configured"], starts
    unit = os.path.basename(scope)
    note = (f"systemd not told of the GPU nodes of {unit} (a daemon-reload will take them away): "
            "systemd sent a header field of type '\ufffd', not expected")  # fmt: skip
    assert note in starts[0]["skipped"], starts[0]["skipped"]
