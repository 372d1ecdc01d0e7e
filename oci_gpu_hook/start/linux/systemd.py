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

import _socket  # the C core of socket, without its enum wrappers: 6.7 ms less per cold start (docs/performance.md)
import os
import struct
import time

from oci_gpu_hook.errors import printable

PRIVATE_SOCKET = "/run/systemd/private"
SCOPE_INTERFACE = "org.freedesktop.systemd1.Scope"  # where a scope's DevicePolicy and DeviceAllow are
# Seconds for the whole exchange (connecting, authenticating, every call and reply), one deadline
# and never one per recv: a peer that dribbles a byte now and then would hold each recv's own
# timeout off for ever. systemd answers in milliseconds; the hook's budget may leave less.
TIMEOUT = 2.0
MAX_MESSAGE = 1 << 20
MAX_NAME = 255  # D-Bus's longest error (interface) name: a longer one is cut, not carried into the log
# What systemd allows in a unit name (unit_name_is_valid: letters, digits and ":-_.\\@"): a cgroup
# directory named otherwise is no unit of systemd's, and its name is never sent.
_UNIT_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:-_.\\@")

_METHOD_CALL, _METHOD_RETURN, _ERROR = 1, 2, 3
# The alignment of a value of each D-Bus type that is not 4-aligned, by its signature's first
# character (8: a struct, a dict entry, 64-bit numbers).
_ALIGNMENT = {"y": 1, "g": 1, "v": 1, "n": 2, "q": 2, "x": 8, "t": 8, "d": 8, "(": 8, "{": 8}
_PATH, _INTERFACE, _MEMBER, _ERROR_NAME, _REPLY_SERIAL, _DESTINATION, _SIGNATURE = 1, 2, 3, 4, 5, 6, 8


class SystemdError(Exception):
    """systemd was there and said no, or the exchange broke: the message says which. The one
    exception the reading of what the socket sent raises, whatever bytes came (issue 46)."""


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
    message, and its length; None while data holds less than one whole message. Whatever the
    bytes, SystemdError is all it raises: every read is bounded by the message's own fields, and
    a field of the wrong type, a length past its end or a name that is not text is malformed."""
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
    fields = _header_fields(data, end_of_fields)
    reply_serial = _field(fields, _REPLY_SERIAL, "u", None)
    error_name = _field(fields, _ERROR_NAME, "s", "")[:MAX_NAME]
    signature = _field(fields, _SIGNATURE, "g", "")
    text = ""
    if signature.startswith("s"):
        if body_length < 4:
            raise SystemdError("systemd sent a malformed message (a string body without its length)")
        (length,) = struct.unpack_from("<I", data, body_at)
        text = data[body_at + 4 : min(total, body_at + 4 + min(length, 1024))].decode("utf-8", "replace")
    return (kind, reply_serial, error_name, text, signature, bytes(data[body_at:total])), total


def _header_fields(data: bytes, end: int) -> dict:
    """{code: (type, value)} of the header fields in data[16:end], each 8-aligned: a byte code,
    a one-type signature, the value (a string or object path, a signature, or a uint32)."""

    def need(at: int, size: int) -> None:
        if at + size > end:
            raise SystemdError("systemd sent a malformed message (a header field runs past the header)")

    fields, at = {}, 16
    while True:
        at += -at % 8
        if at >= end:
            return fields
        need(at, 2)
        code, size = data[at], data[at + 1]
        need(at + 2, size + 1)
        kind = data[at + 2 : at + 2 + size].decode("ascii", "replace")
        at += 3 + size
        if kind in ("s", "o", "u"):
            at += -at % 4
            need(at, 4)
            (value,) = struct.unpack_from("<I", data, at)
            at += 4
            if kind != "u":
                need(at, value + 1)
                value, at = data[at : at + value].decode("utf-8", "replace"), at + value + 1
        elif kind == "g":
            need(at, 1)
            length = data[at]
            need(at + 1, length + 1)
            value, at = data[at + 1 : at + 1 + length].decode("ascii", "replace"), at + 2 + length
        else:
            raise SystemdError(f"systemd sent a header field of type {kind!r}, not expected")
        fields[code] = (kind, value)


def _field(fields: dict, code: int, kind: str, default):
    """The value of header field code, which must be of type kind when it is there."""
    if code not in fields:
        return default
    got, value = fields[code]
    if got != kind:
        raise SystemdError(f"systemd sent a malformed message (header field {code} of type {got!r}, not {kind!r})")
    return value


# --- the exchange -----------------------------------------------------------------------------


class _Connection:
    """One authenticated connection to systemd (or, for a test, to a bus with a stand-in), for a
    few calls in a row, all within one deadline (timeout seconds from connecting): every send and
    recv waits only for what is left of it. Connecting raises FileNotFoundError or
    ConnectionRefusedError when nothing listens at address; anything else that goes wrong,
    SystemdError."""

    def __init__(self, address: str, bus: bool, timeout: float = TIMEOUT):
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
        self.serial = 0
        try:
            self._left()
            try:
                self.sock.connect(address)
            except _socket.timeout:
                raise self._late() from None
            self._authenticate()
            if bus:  # a message bus (dbus-daemon) wants Hello first; systemd's private socket does not
                self.call("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "Hello", "",
                          lambda w: None)  # fmt: skip
        except BaseException:
            self.sock.close()
            raise

    def _late(self) -> SystemdError:
        return SystemdError(f"systemd did not answer within {self.timeout:.1f} s")

    def _left(self) -> None:
        """Let the socket's next call wait only for what is left of the deadline."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self._late()
        self.sock.settimeout(left)

    def _send(self, data: bytes) -> None:
        self._left()
        try:
            self.sock.sendall(data)  # its timeout is for all of it (Python 3.5 and later)
        except _socket.timeout:
            raise self._late() from None

    def _recv(self, size: int) -> bytes:
        self._left()
        try:
            return self.sock.recv(size)
        except _socket.timeout:
            raise self._late() from None

    def _authenticate(self) -> None:
        """SASL EXTERNAL with our uid (the peer checks it against the socket's credentials), BEGIN
        sent with it, as systemd's own clients send it, and the first message only once the OK is
        read. Sent after the OK, BEGIN could reach systemd in one read with the message behind it,
        which systemd 252 then left unread until more came or the connection closed: in the node
        VM three calls were answered only at the client's timeout (60 s, 180 s), when it closed."""
        self._send(b"\0AUTH EXTERNAL " + str(os.geteuid()).encode().hex().encode() + b"\r\nBEGIN\r\n")
        answer = b""
        while not answer.endswith(b"\r\n"):
            chunk = self._recv(512)
            if not chunk or len(answer) > 4096:
                raise SystemdError("systemd's socket did not finish the authentication")
            answer += chunk
        if not answer.startswith(b"OK "):
            refused = answer.strip()[:200].decode("ascii", "replace")
            raise SystemdError(f"systemd refused the authentication: {refused}")

    def call(self, destination: str, path: str, interface: str, member: str, signature: str, write_body):
        """(body signature, body) of the reply; SystemdError on an error reply. Messages that are
        not the reply (a bus's signals) are skipped, within the deadline."""
        self.serial += 1
        self._send(method_call(self.serial, destination, path, interface, member, signature, write_body))
        data = b""
        while True:
            parsed = parse_reply(data)
            if parsed is None:
                chunk = self._recv(65536)
                if not chunk:
                    raise SystemdError("systemd closed the connection without answering")
                data += chunk
                continue
            (kind, reply_serial, error_name, text, signature, body), length = parsed
            data = data[length:]
            if reply_serial == self.serial and kind == _ERROR:
                raise SystemdError(f"{error_name}: {text}" if text else error_name or "an error without a name")
            if reply_serial == self.serial and kind == _METHOD_RETURN:
                return signature, body

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
    empty or not). A value that does not fit in the body, or is of another type: SystemdError."""
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
        end = at + 4 + length  # where its nul is
        if end >= len(body):
            raise SystemdError("systemd sent a truncated property value")
        if body[end] != 0:
            raise SystemdError("systemd sent a malformed property value (a string without its nul)")
        return body[at + 4 : end].decode("utf-8", "replace")
    if kind.startswith("a"):
        # The elements start at their own alignment, even when there are none (the D-Bus
        # specification's marshalling), and must all be in the body: a length past it is no count.
        elements = at + 4 + (-(at + 4) % _ALIGNMENT.get(kind[1:2], 4))
        if elements + length > len(body):
            raise SystemdError("systemd sent a truncated property value")
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
    an ancestor (a container under a user's session scope must not change the session's devices),
    and only a name systemd could have given (its characters: a name read from mountinfo holds
    any bytes)."""
    name = os.path.basename(cgroup_dir.rstrip("/"))
    if name.endswith(".scope") and len(name) <= 255 and set(name) <= _UNIT_CHARACTERS:
        return name
    return None


def keep_devices(cgroup_dir: str, devices, address: str | None = None, bus: bool = False,
                 timeout: float = TIMEOUT):  # fmt: skip
    """After the hook allowed devices in cgroup_dir: tell systemd, when it owns the cgroup and
    filters its devices. Returns a note for the start's log record, or None when done or when
    there is nothing to do (no systemd, not its scope, no device list of its own). Never raises:
    it runs after the apply committed (the container has its devices, and its record must still
    be written), so whatever breaks here, whatever the socket sent, is a note. address: a test's
    bus instead of systemd's private socket (PRIVATE_SOCKET, read at the call); bus: it is a
    message bus (dbus-daemon), which wants Hello first; timeout: seconds for the whole exchange
    (the caller's budget may leave less)."""
    unit = scope_of(cgroup_dir)
    if unit is None or not devices:
        return None
    if timeout <= 0:
        return _not_told(unit, SystemdError("the hook's deadline had passed"))
    try:
        conn = _Connection(address or PRIVATE_SOCKET, bus, timeout)
    except (FileNotFoundError, ConnectionRefusedError):
        return None  # no systemd listening (not a systemd host, or a stale /run): nothing to tell
    except Exception as e:
        return _not_told(unit, e)
    try:
        if filters_devices(conn, unit):  # else systemd re-applies no device list: nothing to lose
            _set_device_allow(conn, unit, devices)
    except Exception as e:
        return _not_told(unit, e)
    finally:
        conn.close()
    return None


def _not_told(unit: str, e: Exception) -> str:
    if isinstance(e, SystemdError):
        why = str(e)
    elif isinstance(e, OSError):
        why = e.strerror or str(e)
    else:  # a bug of this module's: said, with its kind, rather than failing the start
        why = f"internal error: {type(e).__name__}: {e}"
    # what a peer sent (an error's name and text) is one printable line in the log, as the rest
    return f"systemd not told of the GPU nodes of {unit} (a daemon-reload will take them away): {printable(why)}"
