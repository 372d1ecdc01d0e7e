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
    """(bus socket, the file of recorded calls): a private bus with the stand-in Manager on it."""
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
        service = subprocess.Popen([SYSTEM_PYTHON, str(script), f"unix:path={socket_path}", str(calls)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        assert service.stdout.readline().strip() == "ready", service.stderr.read()
        yield socket_path, calls
    finally:
        if service is not None:
            _stop(service)
        _stop(daemon)


def _recorded(calls):
    return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def test_the_call_is_what_libdbus_reads_and_what_sd_bus_sends(fake_systemd):
    socket_path, calls = fake_systemd
    systemd.set_device_allow("libpod-0123abcd.scope", DEVICES, socket_path, bus=True)
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
    socket_path, calls = fake_systemd
    with pytest.raises(systemd.SystemdError, match=r"^org\.freedesktop\.systemd1\.NoSuchUnit: Unit missing\.scope"):
        systemd.set_device_allow("missing.scope", DEVICES, socket_path, bus=True)
    assert _recorded(calls) == []


def test_keep_devices_tells_only_a_scope_whose_devices_systemd_filters(tmp_path, fake_systemd):
    """Only the cgroup's own scope, only with DevicePolicy strict or closed (with auto, a first
    DeviceAllow would turn systemd's filtering on); no systemd: nothing, quietly."""
    socket_path, calls = fake_systemd
    run = tmp_path / "run"
    transient = run / "transient"
    transient.mkdir(parents=True)
    (transient / "libpod-aa.scope").write_text("[Scope]\nDelegate=no\n[Scope]\nDevicePolicy=strict\n")
    (transient / "libpod-bb.scope").write_text("[Scope]\nDevicePolicy=auto\n")
    (transient / "session-3.scope").write_text("[Scope]\nDevicePolicy=strict\n")
    (transient / "missing.scope").write_text("DevicePolicy=closed\n")
    # runc's systemd driver: the unit started bare, its device rules set after (the transient
    # unit's drop-ins, as systemd 252 writes them)
    (transient / "libpod-dd.scope").write_text("[Scope]\nDelegate=yes\n")
    control = transient / "libpod-dd.scope.d"
    control.mkdir(parents=True)
    (control / "50-DevicePolicy.conf").write_text("[Scope]\nDevicePolicy=strict\n")
    (control / "50-DeviceAllow.conf").write_text("[Scope]\nDeviceAllow=\nDeviceAllow=char-pts rwm\n")

    def keep(cgroup, address=socket_path):
        # over the bus: the stand-in needs Hello, systemd's private socket does not
        return systemd.keep_devices(cgroup, DEVICES, address, str(run), str(tmp_path / "etc"), bus=True)

    assert keep("/sys/fs/cgroup/machine.slice/libpod-aa.scope") is None
    assert keep("/sys/fs/cgroup/machine.slice/libpod-bb.scope") is None  # auto: left alone
    assert keep("/sys/fs/cgroup/user.slice/session-3.scope/podman/c1") is None  # not the cgroup's own
    assert keep("/sys/fs/cgroup/machine/libpod-cc") is None  # cgroupfs driver: no scope
    assert keep("/sys/fs/cgroup/machine.slice/libpod-aa.scope", str(tmp_path / "no-socket")) is None
    note = keep("/sys/fs/cgroup/machine.slice/missing.scope")
    assert "systemd not told of the GPU nodes of missing.scope" in note and "NoSuchUnit" in note
    assert keep("/sys/fs/cgroup/machine.slice/libpod-dd.scope") is None
    # an administrator's `systemctl set-property --runtime` on a bare transient scope
    (transient / "libpod-ee.scope").write_text("[Scope]\n")
    (run / "system.control" / "libpod-ee.scope.d").mkdir(parents=True)
    (run / "system.control" / "libpod-ee.scope.d" / "50-DevicePolicy.conf").write_text("DevicePolicy=closed\n")
    assert keep("/sys/fs/cgroup/machine.slice/libpod-ee.scope") is None
    assert [call["unit"] for call in _recorded(calls)] == ["libpod-aa.scope", "libpod-dd.scope", "libpod-ee.scope"]
