"""Tell systemd that a container's scope may use the GPU nodes the hook gave it (issue 38, item 3).

Under a systemd cgroup driver (podman --cgroup-manager systemd, CRI-O and the kubelet with
cgroupDriver systemd) the container's cgroup is a transient scope of systemd's, and systemd
re-applies the scope's device list (its DeviceAllow=) whenever it reloads: `systemctl
daemon-reload` attaches a fresh device program beside the hook's extended one (cgroup v2) or
rewrites devices.allow (v1), and the GPU nodes, which systemd did not know of, give EPERM. So the
hook adds them to systemd's own view of the scope: SetUnitProperties(scope, runtime=true,
DeviceAllow=[("/dev/char/MAJOR:MINOR", "rw"), ...]) over systemd's private socket. systemd parses
/dev/char/MAJOR:MINOR without looking the node up, so the host's /dev need not have it.

Whether to tell it is asked of systemd too (Properties.Get of the scope's DevicePolicy and
DeviceAllow), not read from its files: the runtimes set those properties in different calls
(StartTransientUnit, then SetUnitProperties for runc's systemd driver, under podman and CRI-O
alike), systemd keeps them in different files by version, and an administrator's drop-ins
(crio-.scope.d/) add more; systemd alone knows the result.

Only the hook's start path uses it, so standard library only: the few bytes of D-Bus it needs are
written here (AUTH EXTERNAL, a few method calls on one connection, their replies). systemd's
private socket (/run/systemd/private, root's) rather than the system bus: no dbus-daemon in
between, nothing to ask of polkit, and it is there as long as systemd is. When systemd is not (no
socket), or the cgroup is not a systemd scope, or systemd applies no device list of its own to
the scope (DevicePolicy auto and no DeviceAllow: adding one would *restrict* it), nothing is done
and nothing is said.
"""

from __future__ import annotations

import _socket  # the C core of socket: the same calls, without its enum wrappers (the start path's rule)
import os
import struct

PRIVATE_SOCKET = "/run/systemd/private"
SCOPE_INTERFACE = "org.freedesktop.systemd1.Scope"  # where a scope's DevicePolicy and DeviceAllow are
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
    """(type, reply serial, error name, first string of the body, body signature, body) of one
    message, and its length; None while data holds less than one whole message."""
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
    return (kind, reply_serial, error_name, text, signature, bytes(data[body_at:total])), total


# --- the exchange -----------------------------------------------------------------------------


def _call(sock, message: bytes, serial: int):
    """Send one call and wait for its reply: (body signature, body); raise SystemdError on an
    error reply. Messages that are not the reply (a bus's signals) are skipped."""
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
        (kind, reply_serial, error_name, text, signature, body), length = parsed
        data = data[length:]
        if reply_serial == serial and kind == _ERROR:
            raise SystemdError(f"{error_name}: {text}" if text else error_name)
        if reply_serial == serial and kind == _METHOD_RETURN:
            return signature, body


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


class _Connection:
    """One authenticated connection to systemd (or, for a test, to a bus with a stand-in), for a
    few calls in a row. Connecting raises FileNotFoundError/ConnectionRefusedError when nothing
    listens at address."""

    def __init__(self, address: str, bus: bool):
        self.sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
        self.serial = 0
        try:
            self.sock.settimeout(TIMEOUT)
            self.sock.connect(address)
            _authenticate(self.sock)
            if bus:  # a message bus (dbus-daemon) wants Hello first; systemd's private socket does not
                self.call("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "Hello", "",
                          lambda w: None)  # fmt: skip
        except BaseException:
            self.sock.close()
            raise

    def call(self, destination: str, path: str, interface: str, member: str, signature: str, write_body):
        """(signature, body) of the reply; SystemdError on an error reply."""
        self.serial += 1
        message = method_call(self.serial, destination, path, interface, member, signature, write_body)
        return _call(self.sock, message, self.serial)

    def close(self) -> None:
        self.sock.close()


# --- which scope, and whether systemd filters its devices -------------------------------------


def unit_path(unit: str) -> str:
    """systemd's D-Bus object path of a unit: every byte but [A-Za-z0-9] as _XX (sd-bus's
    bus_label_escape), so a unit need not be looked up (GetUnit) first."""
    escaped = "".join(chr(b) if chr(b).isascii() and chr(b).isalnum() else f"_{b:02x}" for b in unit.encode())
    return "/org/freedesktop/systemd1/unit/" + (escaped or "_")


def read_variant(signature: str, body: bytes, expected: str):
    """The value of a reply whose body is one variant (Properties.Get) of type expected: a str
    for "s", for an array the byte length of its elements (all the hook asks of DeviceAllow:
    empty or not)."""
    if signature != "v":
        raise SystemdError(f"systemd answered a property with signature {signature!r}, not a variant")
    try:
        size = body[0]
        kind = body[1 : 1 + size].decode("ascii")
        at = 2 + size
        at += -at % 4  # both a string's and an array's length are 4-aligned (the body is 8-aligned)
        (length,) = struct.unpack_from("<I", body, at)
    except (IndexError, UnicodeDecodeError, struct.error):
        raise SystemdError("systemd sent a truncated property value") from None
    if kind != expected:
        raise SystemdError(f"systemd sent a property of type {kind!r}, not {expected!r}")
    if kind == "s":
        if at + 4 + length > len(body):
            raise SystemdError("systemd sent a truncated property value")
        return body[at + 4 : at + 4 + length].decode("utf-8", "replace")
    if kind.startswith("a"):
        return length
    raise SystemdError(f"a property of type {kind!r} is not read here")


def _get_property(conn: _Connection, unit: str, name: str, kind: str):
    def write(w: _Writer) -> None:
        w.string(SCOPE_INTERFACE)
        w.string(name)

    return read_variant(*conn.call("org.freedesktop.systemd1", unit_path(unit), "org.freedesktop.DBus.Properties",
                                   "Get", "ss", write), kind)  # fmt: skip


def filters_devices(conn: _Connection, unit: str) -> bool:
    """Whether systemd applies a device list of its own to the unit, and so re-applies it on a
    reload: asked of systemd itself, which knows every place a setting can come from (the
    runtime's StartTransientUnit, its later SetUnitProperties, an administrator's drop-ins, a
    name-prefix drop-in such as crio-.scope.d) whatever its version keeps where. DevicePolicy
    strict or closed; or auto with a DeviceAllow= list (systemd then allows that list alone).
    auto with none: systemd filters nothing, and a first DeviceAllow would turn its filtering
    on."""
    if _get_property(conn, unit, "DevicePolicy", "s") in ("strict", "closed"):
        return True
    return _get_property(conn, unit, "DeviceAllow", "a(ss)") > 0


def _set_device_allow(conn: _Connection, unit: str, devices) -> None:
    """Add devices [(major, minor, access)] to unit's DeviceAllow=, at runtime."""
    conn.call("org.freedesktop.systemd1", "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager",
              "SetUnitProperties", "sba(sv)", device_allow_body(unit, devices))  # fmt: skip


def scope_of(cgroup_dir: str) -> str | None:
    """The systemd scope a container's cgroup directory is, or None: only the cgroup itself, never
    an ancestor (a container under a user's session scope must not change the session's devices)."""
    name = os.path.basename(cgroup_dir.rstrip("/"))
    return name if name.endswith(".scope") and "/" not in name and len(name) <= 255 else None


def keep_devices(cgroup_dir: str, devices, address: str = PRIVATE_SOCKET, bus: bool = False):
    """After the hook allowed devices in cgroup_dir: tell systemd, when it owns the cgroup and
    filters its devices. Returns a note for the start's log record, or None when done or when
    there is nothing to do (no systemd, not its scope, no device list of its own). address: a
    test's bus instead of systemd's private socket; bus: it is a message bus (dbus-daemon), which
    wants Hello first."""
    unit = scope_of(cgroup_dir)
    if unit is None or not devices:
        return None
    try:
        conn = _Connection(address, bus)
    except (FileNotFoundError, ConnectionRefusedError):
        return None  # no systemd listening (not a systemd host, or a stale /run): nothing to tell
    except (OSError, SystemdError) as e:
        return _not_told(unit, e)
    try:
        if not filters_devices(conn, unit):
            return None  # systemd re-applies no device list to it: nothing to lose on a reload
        _set_device_allow(conn, unit, devices)
    except (OSError, SystemdError) as e:  # socket.timeout is an OSError
        return _not_told(unit, e)
    finally:
        conn.close()
    return None


def _not_told(unit: str, e: Exception) -> str:
    if isinstance(e, _socket.timeout):
        why = f"systemd did not answer within {TIMEOUT:.0f} s"
    else:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return f"systemd not told of the GPU nodes of {unit} (a daemon-reload will take them away): {why}"
