"""The exporter's HTTP endpoint: one thread, one selector, and a bound on everything a client holds.

The endpoint listens on every address by default (as DCGM's exporter does), so any pod or host on
the network can connect. http.server's threading server gave each connection a thread with no
timeout: about a thousand idle connections used up the process's descriptors, /metrics stopped
answering and the accept loop spun on EMFILE. Here instead:

- at most max_connections are open (fewer when RLIMIT_NOFILE is low); a new one closes the
  oldest that has not yet sent its request (a scrape sends it at once, an idle client never does);
- a client has `timeout` seconds from connecting to send its request and read the reply;
- a request is at most MAX_REQUEST_BYTES of headers, and only GET and HEAD are answered;
- out of descriptors (EMFILE, from whatever cause), the oldest waiting connection is closed to
  make room, and with none to close the listener rests for a moment rather than spin;
- each connection gets one reply and is closed (Connection: close), so nothing is kept alive.

The reply is built by respond(path, head) -> (status, content type, body bytes), in this thread.
Each request is checked on its own (its size, its line, its method): a bad request's error is its
own and never another client's reply. What is shared is only a render's outcome (a GET's 200, or
the 500 of a render that failed: no client's request causes either), and it is keyed by what a
page depends on: the path, without the query string (respond never sees one). A page is reused
for every GET of its path until REUSE_SECONDS after its render ended, or as long as the render
took where that is longer, so renders are bounded however many clients ask, with whatever query
strings: a flood costs at most one render a second, and never more than half the server's time
(counted from the render's start, a render slower than REUSE_SECONDS was stale when it was done,
and a flood had the server render without a pause). A real scrape among it waits for at most one
render. Clients meanwhile wait in the
kernel's backlog, not in memory here. A render that fails (500) bounds the next one as a page
does: its 500 answers the GETs of its path for REUSE_SECONDS, then the next GET renders again.
Otherwise, while renders failed (from whatever cause), every request was a render and a logged
line: 16,000 of each in 3 s from one client asking in turn.

An empty host listens on every address: IPv6 and IPv4 on one socket (IPV6_V6ONLY off, as DCGM's
exporter does), or IPv4 alone where the host has no IPv6.
"""

from __future__ import annotations

import errno
import resource
import selectors
import socket
import time

MAX_CONNECTIONS = 64
# Descriptors kept for the scrape itself (NVML, the records, /proc) when the cap on connections is
# set from the process's RLIMIT_NOFILE: the clients must never be able to starve the answer.
RESERVED_DESCRIPTORS = 32
REQUEST_TIMEOUT = 10.0
MAX_REQUEST_BYTES = 8192
# How long a rendered page answers GETs of its path: Prometheus scrapes every 10 s or more, and a
# render reads NVML and every container record, so no client may ask for more than one a second.
REUSE_SECONDS = 1.0
REST_SECONDS = 0.1  # how long the listener rests when no descriptor can be freed
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# What an empty host falls back from, to IPv4 alone: a kernel without IPv6 (ipv6.disable=1), or
# one where :: cannot be bound.
_NO_IPV6 = (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT, errno.EADDRNOTAVAIL)
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}  # fmt: skip


class _Connection:
    __slots__ = ("sock", "deadline", "inbox", "outbox")

    def __init__(self, sock, deadline: float):
        self.sock, self.deadline = sock, deadline
        self.inbox = b""
        self.outbox = None  # the reply still to send, once the request is in


def reply(status: int, kind: str, body: bytes, head_only: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: {kind}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")  # fmt: skip
    return head.encode("ascii") + (b"" if head_only else body)


def _listen(family: int, host: str, port: int, dual_stack: bool = False) -> socket.socket:
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        if dual_stack:  # whatever net.ipv6.bindv6only says: IPv4 clients arrive as ::ffff:a.b.c.d
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener


class ScrapeServer:
    def __init__(self, host: str, port: int, respond, log, max_connections: int = MAX_CONNECTIONS,
                 timeout: float = REQUEST_TIMEOUT, clock=time.monotonic):  # fmt: skip
        """host: an address, or "" for every address (IPv6 and IPv4 where the host has IPv6)."""
        self.respond, self.log, self.clock = respond, log, clock
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY:
            max_connections = max(1, min(max_connections, soft - RESERVED_DESCRIPTORS))
        self.max_connections, self.timeout = max_connections, timeout
        if host:
            self.listener = _listen(socket.AF_INET6 if ":" in host else socket.AF_INET, host, port)
        else:
            try:
                self.listener = _listen(socket.AF_INET6, "::", port, dual_stack=True)
            except OSError as e:
                if e.errno not in _NO_IPV6:
                    raise
                self.listener = _listen(socket.AF_INET, "0.0.0.0", port)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.connections: dict = {}  # socket -> _Connection, oldest first
        self.resting_until = None  # the listener is unregistered until then
        self.full = False  # said once per episode of evictions
        # path -> (until when it is reused, its reply): a rendered page (200), or a render that
        # failed (500); never a reply to one client's own bad request
        self.renders: dict = {}

    def close(self) -> None:
        for conn in list(self.connections.values()):
            self._drop(conn)
        self.selector.close()
        self.listener.close()

    def serve_forever(self) -> None:
        while True:
            self.serve_once()

    def serve_once(self) -> None:
        now = self.clock()
        wake = [c.deadline for c in self.connections.values()]
        if self.resting_until is not None:
            wake.append(self.resting_until)
        complete = []  # (connection, request head) of the requests that came in on this turn
        for key, mask in self.selector.select(max(0.0, min(wake) - now) if wake else None):
            if key.fileobj is self.listener:
                self._accept()
            elif mask & selectors.EVENT_READ:
                self._read(key.data, complete)
            else:
                self._write(key.data)
        turn = self.clock()  # every request answered below came in by now
        # Pages reused long enough by this turn are done with (and the table stays small).
        self.renders = {path: done for path, done in self.renders.items() if turn < done[0]}
        for conn, head in complete:
            if conn.sock in self.connections:  # not closed meanwhile to make room
                self._answer(conn, self._reply_to(head))
        now = self.clock()
        for conn in [c for c in self.connections.values() if c.deadline <= now]:
            self._drop(conn)
        if self.resting_until is not None and now >= self.resting_until:
            self.resting_until = None
            self.selector.register(self.listener, selectors.EVENT_READ)

    # --- connections --------------------------------------------------------------------------

    def _accept(self) -> None:
        # A burst of a quarter of the cap, then the requests already in get read: a scrape that
        # came in among a flood of idle clients is answered before enough newer ones arrive to
        # make it the oldest waiting, the one closed to make room.
        for _ in range(max(1, self.max_connections // 4)):
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno not in _OUT_OF_DESCRIPTORS:
                    return  # the client gave up before we accepted it (ECONNABORTED, ...)
                if self._evict_one("out of file descriptors"):
                    continue
                self.selector.unregister(self.listener)
                self.resting_until = self.clock() + REST_SECONDS
                return
            if len(self.connections) >= self.max_connections:
                self._evict_one(f"{self.max_connections} connections open")
            sock.setblocking(False)
            conn = _Connection(sock, self.clock() + self.timeout)
            self.connections[sock] = conn
            self.selector.register(sock, selectors.EVENT_READ, conn)
        if len(self.connections) < self.max_connections // 2:
            self.full = False

    def _evict_one(self, why: str) -> bool:
        """Close the oldest connection still waiting for its request (else the oldest of all)."""
        if not self.connections:
            return False
        waiting = [c for c in self.connections.values() if c.outbox is None]
        self._drop((waiting or list(self.connections.values()))[0])
        if not self.full:
            self.log(f"{why}: closing the oldest idle connections to keep answering")
            self.full = True
        return True

    def _drop(self, conn: _Connection) -> None:
        self.connections.pop(conn.sock, None)
        try:
            self.selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _read(self, conn: _Connection, complete: list) -> None:
        try:
            data = conn.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.inbox += data
        end = conn.inbox.find(b"\r\n\r\n")
        if end < 0:
            end = conn.inbox.find(b"\n\n")
        if end < 0:
            if len(conn.inbox) > MAX_REQUEST_BYTES:
                self._answer(conn, reply(431, "text/plain", b"request too large\n"))
            return
        self.selector.unregister(conn.sock)  # nothing more is read: it gets its reply after this turn
        complete.append((conn, conn.inbox[:end]))

    def _reply_to(self, head: bytes) -> bytes:
        """This request's reply. Its own checks first, so that nothing about one client's request
        (its size, its line, its method) reaches another's reply; then the outcome of a render of
        its path that is still reused (its page, or its 500), else a render."""
        if len(head) > MAX_REQUEST_BYTES:
            return reply(431, "text/plain", b"request too large\n")
        parts = head.split(b"\n", 1)[0].strip().split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return reply(400, "text/plain", b"bad request\n")
        method = parts[0]
        # The query string is dropped: respond() is given the path alone, so no page depends on it.
        path = parts[1].split(b"?", 1)[0].decode("ascii", "replace")
        if method not in (b"GET", b"HEAD"):
            return reply(405, "text/plain", b"only GET and HEAD\n")
        if method == b"HEAD":  # renders nothing (respond's contract), so nothing to share
            return reply(*self._respond(path, True), head_only=True)
        if path in self.renders:
            return self.renders[path][1]
        began = self.clock()
        status, kind, body = self._respond(path, False)
        answer = reply(status, kind, body)
        # A render that failed is a render all the same (NVML, the records, a logged line):
        # bounded per second as pages are, whatever made it fail.
        if status == 200 or status >= 500:
            ended = self.clock()
            self.renders[path] = (ended + max(REUSE_SECONDS, ended - began), answer)
        return answer

    def _respond(self, path: str, head: bool) -> tuple:
        try:
            return self.respond(path, head)
        except Exception as e:  # one bad scrape must not stop the endpoint; the next may succeed
            self.log(f"internal error answering a request: {type(e).__name__}: {e}")
            return 500, "text/plain", b"internal error\n"

    def _answer(self, conn: _Connection, data: bytes) -> None:
        conn.outbox = memoryview(data)
        try:
            self.selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        except KeyError:  # unregistered while its request waited for the turn's replies
            self.selector.register(conn.sock, selectors.EVENT_WRITE, conn)
        self._write(conn)

    def _write(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except BlockingIOError:
            return
        except OSError:
            self._drop(conn)
            return
        conn.outbox = conn.outbox[sent:]
        if not conn.outbox:
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self._drop(conn)
