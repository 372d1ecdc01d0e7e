"""A node's way to the API server: `python apiforward.py NETNS PORT READY` listens on 127.0.0.1:PORT
inside the network namespace NETNS (a node of kubecheck's with a network of its own) and joins
each connection made there to 127.0.0.1:PORT in this process's own network namespace, where the
control plane listens. So a node's kubelet and its host-network pods reach the API server at the
address every kubeconfig names, and nothing of this machine's network changes (no interface, no
route, no address). READY is made once it listens. It runs until it is killed.

Standard library only: it runs as `python -I`, with no test module."""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import threading

CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    # os.setns is Python 3.12's; RHEL 9's and Debian 12's Pythons are older.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while True:
            data = source.recv(1 << 16)
            if not data:
                break
            sink.sendall(data)
    except OSError:
        pass  # either side gone: the other is told below
    finally:
        for close in (lambda: sink.shutdown(socket.SHUT_WR), source.close):
            try:
                close()
            except OSError:
                pass


def _join(client: socket.socket, port: int) -> None:
    try:
        upstream = socket.create_connection(("127.0.0.1", port), timeout=10)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
    _pipe(client, upstream)


def main(netns: str, port: int, ready: str) -> None:
    own = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    theirs = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    # Only this thread moves, and back again before any other exists: the listening socket stays
    # in the node's namespace, every connection upstream is made in this one.
    _setns(theirs)
    listener = socket.create_server(("127.0.0.1", port), backlog=128)
    _setns(own)
    os.close(theirs)
    os.close(own)
    open(ready, "w").close()
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_join, args=(client, port), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
