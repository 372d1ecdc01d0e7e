"""Descriptors passed over a Unix socket (SCM_RIGHTS): the one receiving side, for the start
server's offers, its workers' "go" and the ldconfig helper's start.

Not socket.recv_fds: it ignores its flags argument (3.9 to 3.13 alike), and callers need
MSG_DONTWAIT (the server: never wait on the start's path) and MSG_CMSG_CLOEXEC (the helper:
nothing received may leak into the ldconfig it execs). And _socket, not socket: socket's enum
wrappers and selectors would cost the ldconfig helper, which imports this at idle, some 5 ms of
its start (docs/performance.md).
"""

from __future__ import annotations

import _socket as socket
import array


def receive(sock: socket.socket, size: int, most: int, flags: int = 0) -> tuple[bytes, list, int]:
    """(message, descriptors, message flags) of one recvmsg of at most size bytes and of most
    descriptors at most (CMSG_LEN, not CMSG_SPACE: its padding would fit one more). The
    descriptors are the caller's to close, whatever the message says. More sent than fit sets
    MSG_CTRUNC, and the kernel closes those left out; a message longer than size sets MSG_TRUNC.
    OSError as recvmsg raises it (nothing received then)."""
    fds = array.array("i")
    message, ancillary, message_flags, _ = sock.recvmsg(size, socket.CMSG_LEN(most * fds.itemsize), flags)
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return message, list(fds), message_flags
