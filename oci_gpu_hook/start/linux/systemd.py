"""Tell systemd that a container's scope may use the GPU nodes the hook gave it (issue 38, item 3).

Under a systemd cgroup driver (podman --cgroup-manager systemd, CRI-O and the kubelet with
cgroupDriver systemd) the container's cgroup is a transient scope of systemd's, and systemd
re-applies the scope's device list (its DeviceAllow=) whenever it reloads: `systemctl
daemon-reload` attaches a fresh device program beside the hook's extended one (cgroup v2) or
rewrites devices.allow (v1), and the GPU nodes, which systemd did not know of, give EPERM. So the
hook adds them to systemd's own view of the scope: SetUnitProperties(scope, runtime=true,
DeviceAllow=[("/dev/char/MAJOR:MINOR", "rw"), ...]) over systemd's private socket. systemd parses
/dev/char/MAJOR:MINOR without looking the node up, so the host's /dev need not have it.

Only the hook's start path uses it, so standard library only: the few bytes of D-Bus it needs are
written here (AUTH EXTERNAL, one method call, its reply). systemd's private socket
(/run/systemd/private, root's) rather than the system bus: no dbus-daemon in between, nothing to
ask of polkit, and it is there as long as systemd is. When systemd is not (no socket, none of
its files for the unit), or the cgroup is not a systemd scope, or the scope has no device policy
of systemd's (DevicePolicy auto: adding a DeviceAllow would *restrict* it), nothing is done and
nothing is said.
"""

from __future__ import annotations

import _socket  # the C core of socket: the same calls, without its enum wrappers (the start path's rule)
import os
import struct

PRIVATE_SOCKET = "/run/systemd/private"
RUN_DIR = "/run/systemd"  # transient/UNIT and system.control/UNIT.d: what systemd keeps of a scope
ETC_DIR = "/etc/systemd"
TIMEOUT = 2.0  # seconds for the whole exchange: systemd answers in milliseconds
MAX_MESSAGE = 1 << 20

_METHOD_CALL, _METHOD_RETURN, _ERROR = 1, 2, 3
_PATH, _INTERFACE, _MEMBER, _ERROR_NAME, _REPLY_SERIAL, _DESTINATION, _SIGNATURE = 1, 2, 3, 4, 5, 6, 8


class SystemdError(Exception):
    """systemd was there and said no, or the exchange broke: the message says which."""


# --- the wire format (little endian), as much of it as one call needs ----------------------------


class _Writer:
    """Marshals D-Bus values; alignment counts from the start of the message."""

    def __init__(self, offset: int = 0):
        self.data = bytearray()
        self.offset = offset  # where self.data starts in the message (the body follows the header)

    def pad(self, alignment: int) -> None:
        self.data += b"\0" * (-(self.offset + len(self.data)) % alignment)

    def byte(self, value: int) -> None:
        self.data.append(value)

    def uint32(self, value: int) -> None:
        self.pad(4)
        self.data += struct.pack("<I", value)

    def string(self, value: str) -> None:
        raw = value.encode()
        self.uint32(len(raw))
        self.data += raw + b"\0"

    def signature(self, value: str) -> None:
        raw = value.encode()
        self.data.append(len(raw))
        self.data += raw + b"\0"

    def array(self, alignment: int, items, write_item) -> None:
        """An array of items whose elements align to alignment; write_item(self, item) each."""
        self.uint32(0)
        at = len(self.data) - 4
        self.pad(alignment)
        start = len(self.data)
        for item in items:
            write_item(self, item)
        struct.pack_into("<I", self.data, at, len(self.data) - start)


def method_call(serial: int, destination: str, path: str, interface: str, member: str, signature: str,
                write_body) -> bytes:  # fmt: skip
    """One METHOD_CALL message; write_body(writer) writes the arguments."""
    body = _Writer()
    write_body(body)
    fields = [(_PATH, "o", path), (_INTERFACE, "s", interface), (_MEMBER, "s", member),
              (_DESTINATION, "s", destination)] + ([(_SIGNATURE, "g", signature)] if signature else [])  # fmt: skip
    header = _Writer()
    header.data += b"l" + bytes([_METHOD_CALL, 0, 1])
    header.uint32(len(body.data))
    header.uint32(serial)

    def field(w, entry):
        code, kind, value = entry
        w.pad(8)
        w.byte(code)
        w.signature(kind)
        w.signature(value) if kind == "g" else w.string(value)

    header.array(8, fields, field)
    header.pad(8)
    return bytes(header.data + body.data)


def device_allow_body(unit: str, devices) -> object:
    """The arguments of SetUnitProperties (signature "sba(sv)"): the unit, runtime=true, and one
    property, DeviceAllow, of signature a(ss): ("/dev/char/MAJOR:MINOR", access) per device."""

    def write(w: _Writer) -> None:
        w.string(unit)
        w.uint32(1)  # runtime: gone with the scope, never written to /etc

        def prop(w, _):
            w.pad(8)
            w.string("DeviceAllow")
            w.signature("a(ss)")

            def entry(w, device):
                major, minor, access = device
                w.pad(8)
                w.string(f"/dev/char/{major}:{minor}")
                w.string(access)

            w.array(8, devices, entry)

        w.array(8, [None], prop)

    return write


def parse_reply(data: bytes):
    """(type, reply serial, error name, first string of the body) of one message, and its length;
    None while data holds less than one whole message."""
    if len(data) < 16:
        return None
    if data[:1] != b"l":
        raise SystemdError("systemd answered in big-endian D-Bus, which this hook does not read")
    kind = data[1]
    body_length, _serial, fields_length = struct.unpack_from("<III", data, 4)
    end_of_fields = 16 + fields_length
    body_at = end_of_fields + (-end_of_fields % 8)
    total = body_at + body_length
    if total > MAX_MESSAGE:
        raise SystemdError("systemd sent an oversized message")
    if len(data) < total:
        return None
    reply_serial, error_name, signature = None, "", ""
    at = 16
    while at < end_of_fields:
        at += -at % 8
        code, size = data[at], data[at + 1]
        kind_sig = data[at + 2 : at + 2 + size].decode()
        at += 3 + size
        if kind_sig in ("s", "o"):
            at += -at % 4
            (length,) = struct.unpack_from("<I", data, at)
            value = data[at + 4 : at + 4 + length].decode("utf-8", "replace")
            at += 5 + length
        elif kind_sig == "g":
            length = data[at]
            value = data[at + 1 : at + 1 + length].decode()
            at += 2 + length
        elif kind_sig == "u":
            at += -at % 4
            (value,) = struct.unpack_from("<I", data, at)
            at += 4
        else:
            raise SystemdError(f"systemd sent a header field of type {kind_sig!r}, not expected")
        if code == _REPLY_SERIAL:
            reply_serial = value
        elif code == _ERROR_NAME:
            error_name = value
        elif code == _SIGNATURE:
            signature = value
    text = ""
    if signature.startswith("s") and body_length >= 4:
        (length,) = struct.unpack_from("<I", data, body_at)
        text = data[body_at + 4 : body_at + 4 + min(length, 1024)].decode("utf-8", "replace")
    return (kind, reply_serial, error_name, text), total


# --- the exchange -----------------------------------------------------------------------------


def _call(sock, message: bytes, serial: int) -> None:
    """Send one call and wait for its reply; raise SystemdError on an error reply. Messages that
    are not the reply (a bus's signals) are skipped."""
    sock.sendall(message)
    data = b""
    while True:
        parsed = parse_reply(data)
        if parsed is None:
            chunk = sock.recv(65536)
            if not chunk:
                raise SystemdError("systemd closed the connection without answering")
            data += chunk
            continue
        (kind, reply_serial, error_name, text), length = parsed
        data = data[length:]
        if reply_serial == serial and kind == _ERROR:
            raise SystemdError(f"{error_name}: {text}" if text else error_name)
        if reply_serial == serial and kind == _METHOD_RETURN:
            return


def _authenticate(sock) -> None:
    """SASL EXTERNAL with our uid (the peer checks it against the socket's credentials)."""
    sock.sendall(b"\0AUTH EXTERNAL " + str(os.geteuid()).encode().hex().encode() + b"\r\n")
    answer = b""
    while not answer.endswith(b"\r\n"):
        chunk = sock.recv(512)
        if not chunk or len(answer) > 4096:
            raise SystemdError("systemd's socket did not finish the authentication")
        answer += chunk
    if not answer.startswith(b"OK "):
        raise SystemdError(f"systemd refused the authentication: {answer.strip().decode('ascii', 'replace')}")
    sock.sendall(b"BEGIN\r\n")


def set_device_allow(unit: str, devices, address: str = PRIVATE_SOCKET, bus: bool = False) -> None:
    """Add devices [(major, minor, access)] to unit's DeviceAllow=, at runtime. bus: address is a
    message bus (dbus-daemon), which wants Hello first; systemd's private socket does not.
    Raises FileNotFoundError/ConnectionRefusedError when nothing listens there, SystemdError
    when systemd says no."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(TIMEOUT)
        sock.connect(address)
        _authenticate(sock)
        serial = 1
        if bus:
            hello = method_call(serial, "org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus",
                                "Hello", "", lambda w: None)  # fmt: skip
            _call(sock, hello, serial)
            serial += 1
        call = method_call(serial, "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
                           "org.freedesktop.systemd1.Manager", "SetUnitProperties", "sba(sv)",
                           device_allow_body(unit, devices))  # fmt: skip
        _call(sock, call, serial)
    except _socket.timeout:
        raise SystemdError(f"systemd did not answer within {TIMEOUT:.0f} s") from None
    finally:
        sock.close()


# --- which scope, and whether systemd filters its devices -------------------------------------


def scope_of(cgroup_dir: str) -> str | None:
    """The systemd scope a container's cgroup directory is, or None: only the cgroup itself, never
    an ancestor (a container under a user's session scope must not change the session's devices)."""
    name = os.path.basename(cgroup_dir.rstrip("/"))
    return name if name.endswith(".scope") and "/" not in name and len(name) <= 255 else None


def device_policy(unit: str, run_dir: str = RUN_DIR, etc_dir: str = ETC_DIR) -> str | None:
    """The DevicePolicy= systemd keeps for a transient unit, or None when it keeps no such unit
    (not a systemd scope, or no systemd). Read from its files, no D-Bus: the transient unit file
    (what StartTransientUnit set) and its drop-ins (what SetUnitProperties set after), in
    systemd's order: by file name, the last DevicePolicy= wins."""
    files = []
    transient = os.path.join(run_dir, "transient", unit)
    if os.path.isfile(transient):
        files.append(("", transient))
    # A transient unit's later settings are drop-ins beside its file (transient/UNIT.d), as runc's
    # systemd driver sets the device rules; an administrator's set-property goes to system.control.
    bases = (os.path.join(run_dir, "transient"), os.path.join(etc_dir, "system.control"),
             os.path.join(run_dir, "system.control"))  # fmt: skip
    for base in bases:
        directory = os.path.join(base, unit + ".d")
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        files += [(name, os.path.join(directory, name)) for name in names if name.endswith(".conf")]
    if not files:
        return None
    policy = "auto"
    for _, path in sorted(files):
        try:
            with open(path, "rb") as f:
                text = f.read(1 << 20).decode("utf-8", "replace")
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("DevicePolicy="):
                policy = line.partition("=")[2].strip() or "auto"
    return policy


def keep_devices(cgroup_dir: str, devices, address: str = PRIVATE_SOCKET, run_dir: str = RUN_DIR,
                 etc_dir: str = ETC_DIR, bus: bool = False):  # fmt: skip
    """After the hook allowed devices in cgroup_dir: tell systemd, when it owns the cgroup and
    filters its devices. Returns a note for the start's log record, or None when done or when
    there is nothing to do (no systemd, not its scope, no device policy of its own). address and
    bus: as set_device_allow's; run_dir and etc_dir: systemd's (a test's stand-ins)."""
    unit = scope_of(cgroup_dir)
    if unit is None or not devices:
        return None
    if device_policy(unit, run_dir, etc_dir) not in ("strict", "closed"):
        return None  # systemd re-applies no device list to it: nothing to lose on a reload
    try:
        set_device_allow(unit, devices, address, bus)
    except (FileNotFoundError, ConnectionRefusedError):
        return None  # a transient file but no systemd listening: a stale /run, nothing to tell
    except (OSError, SystemdError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return f"systemd not told of the GPU nodes of {unit} (a daemon-reload will take them away): {why}"
    return None
