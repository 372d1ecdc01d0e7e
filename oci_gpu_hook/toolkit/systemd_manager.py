"""systemd's manager, asked by the toolkit (install --start-units, --stop-units, --restart
systemd): a few Manager calls over systemd's private socket, through the hook's own D-Bus client
(start/linux/systemd.py). Kept out of that module: the hook's start path never manages units."""

from __future__ import annotations

from oci_gpu_hook.start.linux.systemd import PRIVATE_SOCKET, SystemdError, _Connection, _Writer

__all__ = ["SystemdError", "manage", "restart_unit"]

# Seconds for one exchange with the manager. Not the hook's 2 s (start/linux/systemd.py), which is
# a container start's budget: a daemon-reload answers once systemd has reloaded every unit, and
# right after a policy load (install loads the SELinux module first) systemd re-reads its labels;
# in the node VM under qemu's TCG that took over 2 s (and up to 27 s). Hang guards, under the
# toolkit's own bound on a host step (toolkit/host.py). (Calls answered exactly at these bounds in
# the node VM were the client's: BEGIN sent after the OK, start/linux/systemd.py's _authenticate.)
TIMEOUT = 120.0
# A connection that asks for a reload: systemctl's own bound for daemon-reload (twice systemd's
# default 90 s, since a reload reruns the generators, each bounded by that default).
RELOAD_TIMEOUT = 180.0
NO_SUCH_UNIT = "org.freedesktop.systemd1.NoSuchUnit"  # the error systemd answers for a unit it does not know


def restart_unit(unit: str, address: str | None = None, bus: bool = False, timeout: float = TIMEOUT) -> None:
    """Ask systemd to restart unit (Manager.RestartUnit, mode "replace"), as `systemctl restart`
    does without waiting for the job: the caller sees the restart done in the unit's own effect.
    Raises SystemdError, or OSError when nothing listens at address (default: PRIVATE_SOCKET;
    bus: it is a message bus, as keep_devices's)."""
    manage([("RestartUnit", unit)], address, bus, timeout)


def manage(calls, address: str | None = None, bus: bool = False, timeout: float | None = None) -> None:
    """Manager calls on one connection, in order: ("Reload", None) as `systemctl daemon-reload`
    (which returns once systemd has reloaded), ("StartUnit", "StopUnit" or "RestartUnit", unit)
    with mode "replace", as systemctl does without waiting for the job. A unit systemd does not
    know (NoSuchUnit) is already stopped: StopUnit on it is done. timeout: for all the calls
    (default: RELOAD_TIMEOUT where one is a reload, else TIMEOUT). Raises as restart_unit."""
    if timeout is None:
        timeout = RELOAD_TIMEOUT if any(member == "Reload" for member, _ in calls) else TIMEOUT
    conn = _Connection(address or PRIVATE_SOCKET, bus, timeout)
    try:
        for member, unit in calls:
            if unit is None:
                signature, write = "", lambda w: None
            else:

                def write(w: _Writer, unit=unit) -> None:
                    w.string(unit)
                    w.string("replace")

                signature = "ss"
            try:
                conn.call("org.freedesktop.systemd1", "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager",
                          member, signature, write)  # fmt: skip
            except SystemdError as e:
                if member != "StopUnit" or not str(e).startswith(NO_SUCH_UNIT):
                    raise
    finally:
        conn.close()
