"""A hostile peer on a D-Bus socket, standing where systemd's private socket is (issue 46, item 5).

It speaks as much D-Bus as the hook's client (start/linux/systemd.py) needs to reach the reply it
waits for: it accepts AUTH EXTERNAL, reads each method call whole (by the lengths in its header),
and answers it with the next reply of a list, as bytes chosen by the test (garbage, a mutation of
a real reply), at once or dribbled a byte at a time; after the last one it shuts its side of the
connection, so a client that waits for more sees the end at once instead of its deadline.
Importable from any test (pytest puts tests/ on sys.path); `python dbuspeer.py SOCKET MODE` serves
one of MODES until it is stopped (privatehost's daemons, in a namespace where SOCKET is
/run/systemd/private).

reply() marshals a little-endian reply as libdbus and sd-bus do; the tests' seeds and the modes'
answers are made with it (written here, not with the client's own marshaller).
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time

METHOD_RETURN, ERROR, SIGNAL = 2, 3, 4
PATH, INTERFACE, MEMBER, ERROR_NAME, REPLY_SERIAL, DESTINATION, SENDER, SIGNATURE = 1, 2, 3, 4, 5, 6, 7, 8


def reply(kind: int, serial: int, fields, body: bytes = b"") -> bytes:
    """A message: fields [(code, type, value)] of type s, o, g or u, each 8-aligned, then body."""
    out = bytearray(b"l" + bytes([kind, 0, 1]) + struct.pack("<III", len(body), serial, 0))
    for code, kind_of, value in fields:
        out += b"\0" * (-len(out) % 8)
        out += bytes([code, 1]) + kind_of.encode() + b"\0"
        if kind_of in ("s", "o"):
            out += b"\0" * (-len(out) % 4)
            raw = value.encode()
            out += struct.pack("<I", len(raw)) + raw + b"\0"
        elif kind_of == "g":
            out += bytes([len(value)]) + value.encode() + b"\0"
        else:
            out += b"\0" * (-len(out) % 4) + struct.pack("<I", value)
    struct.pack_into("<I", out, 12, len(out) - 16)
    out += b"\0" * (-len(out) % 8)
    return bytes(out + body)


def string_variant(value: str) -> bytes:
    """The body of a Properties.Get reply whose value is a string (signature v)."""
    return b"\x01s\0\0" + struct.pack("<I", len(value)) + value.encode() + b"\0"


def property_reply(serial: int, value: str) -> bytes:
    return reply(METHOD_RETURN, 7, [(REPLY_SERIAL, "u", serial), (SENDER, "s", ":1.0"), (SIGNATURE, "g", "v")],
                 string_variant(value))  # fmt: skip


def error_reply(serial: int, name: str, text: str) -> bytes:
    body = struct.pack("<I", len(text.encode())) + text.encode() + b"\0"
    return reply(ERROR, 8, [(ERROR_NAME, "s", name), (REPLY_SERIAL, "u", serial), (SIGNATURE, "g", "s")], body)


# Once a UnicodeDecodeError out of the client (the type of a header field, read as UTF-8): a whole,
# well-sized message whose one header field has the type b"\xff".
GARBAGE = reply(METHOD_RETURN, 1, [(REPLY_SERIAL, "u", 1)]).replace(b"\x05\x01u\x00", b"\x05\x01\xff\x00", 1)

MODES = {
    "garbage": ([GARBAGE], 0.0),
    # a DevicePolicy of strict, one byte every half second: about 30 s for the whole reply
    "dribble": ([property_reply(1, "strict")], 0.5),
}


def _read_call(conn, buffered: bytes):
    """(one whole method call, what came after it), or None at the end of the connection."""
    while True:
        if buffered.startswith(b"BEGIN\r\n"):
            buffered = buffered[7:]
        if len(buffered) >= 16:
            body_length, _, fields_length = struct.unpack_from("<III", buffered, 4)
            total = 16 + fields_length + (-(16 + fields_length) % 8) + body_length
            if len(buffered) >= total:
                return buffered[:total], buffered[total:]
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buffered += chunk


def serve_connection(conn, replies, interval: float = 0.0, stop=None) -> None:
    """One client: authentication, then each reply for a call (a byte per interval when
    interval); then the end of what it sends, and the connection drained and closed."""
    try:
        buffered = b""
        while b"\r\n" not in buffered:
            chunk = conn.recv(512)
            if not chunk:
                return
            buffered += chunk
        conn.sendall(b"OK 0123456789abcdef0123456789abcdef\r\n")
        buffered = buffered.split(b"\r\n", 1)[1]
        for answer in replies:
            got = _read_call(conn, buffered)
            if got is None:
                return
            buffered = got[1]
            if not interval:
                conn.sendall(answer)
                continue
            for i in range(len(answer)):
                if stop is not None and stop.is_set():
                    return
                conn.sendall(answer[i : i + 1])
                time.sleep(interval)
        conn.shutdown(socket.SHUT_WR)
        while conn.recv(65536):
            pass
    except OSError:
        pass  # the client gave up (its deadline): what it saw is the test's to check
    finally:
        conn.close()


class Peer:
    """A peer listening at path in a thread of the test, serving one connection at a time:
    replies_for() gives each connection's (replies, interval). with Peer(...) as peer: ...;
    peer.connections counts the clients served."""

    def __init__(self, path: str, replies_for):
        self.path, self.replies_for, self.connections = path, replies_for, 0
        self.stop = threading.Event()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)
        self.listener.settimeout(0.2)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Peer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)
        self.listener.close()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            conn.settimeout(30)
            self.connections += 1
            replies, interval = self.replies_for()
            serve_connection(conn, replies, interval, self.stop)


def main(path: str, mode: str) -> None:
    replies, interval = MODES[mode]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)  # root's, as systemd's is
    listener.listen(16)
    while True:
        conn, _ = listener.accept()
        conn.settimeout(60)
        threading.Thread(target=serve_connection, args=(conn, replies, interval), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
