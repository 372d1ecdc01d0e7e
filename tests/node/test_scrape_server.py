"""The exporter's HTTP endpoint (node/scrape_server.py) on real sockets, with a page that reads a
real file: what no client can make it do, whatever the page's own state."""

import socket
import threading
import time

import pytest

from oci_gpu_hook.node import scrape_server


@pytest.fixture
def server(tmp_path):
    """A server whose page is the content of tmp_path/page, read at each render (so a render fails,
    with the OSError a real read gives, while that file is missing): (port, renders, log)."""
    page = tmp_path / "page"
    renders, log = [], []

    def respond(path, head=False):
        if path != "/metrics":
            return 404, "text/plain", b"not found\n"
        if not head:
            renders.append(path)
        return 200, "text/plain", page.read_bytes()

    s = scrape_server.ScrapeServer("127.0.0.1", 0, respond, log.append)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            s.serve_once()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield page, s.listener.getsockname()[1], renders, log
    stop.set()
    socket.create_connection(("127.0.0.1", s.listener.getsockname()[1])).close()  # wakes the loop
    thread.join(60)
    s.close()


def _status(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as client:
        client.sendall(request)
        data = b""
        while chunk := client.recv(65536):
            data += chunk
    return data.split(b"\r\n", 1)[0]


def test_failing_renders_are_bounded_per_second_as_pages_are(server):
    """Round 4, class 3, again: a failed render (500) was kept for the one turn of the loop only,
    so while the page could not be rendered, from whatever cause, each request was a render of its
    own and a logged line: one client asking in turn got 16,000 of each in 3 s. A render that fails
    is a render all the same: its 500 answers its path's GETs for REUSE_SECONDS, then the next GET
    renders again (and gets the page once it can be read). The bound follows from the elapsed time,
    so a slow machine loosens it and never fails it."""
    page, port, renders, log = server
    started = time.monotonic()
    statuses = set()
    for n in range(300):
        statuses.add(_status(port, f"GET /metrics?{n} HTTP/1.1\r\nHost: x\r\n\r\n".encode()))
    elapsed = time.monotonic() - started
    assert statuses == {b"HTTP/1.1 500 Internal Server Error"}
    assert 1 <= len(renders) <= elapsed / scrape_server.REUSE_SECONDS + 1, (len(renders), elapsed)
    assert len(log) == len(renders) and all("FileNotFoundError" in line for line in log), log[:3]
    page.write_bytes(b"metric 1\n")
    time.sleep(scrape_server.REUSE_SECONDS)
    assert _status(port, b"GET /metrics HTTP/1.1\r\n\r\n") == b"HTTP/1.1 200 OK"


def test_a_slow_render_cannot_keep_the_server_rendering(tmp_path):
    """A page reused for REUSE_SECONDS from its render's start was stale when a render slower than
    that ended: clients asking in turn then had the server render without a pause. A page is now
    reused from its render's end, for as long as the render took where that is longer. Each
    render here takes 3 s of the server's clock (the clock moves on in respond, so the test need
    not wait): before, every one of 30 requests in turn was a render; now the first is the only."""
    offset = [0.0]
    renders = []

    def respond(path, head=False):
        renders.append(path)
        offset[0] += 3.0
        return 200, "text/plain", b"metric 1\n"

    s = scrape_server.ScrapeServer(
        "127.0.0.1", 0, respond, lambda line: None, clock=lambda: time.monotonic() + offset[0]
    )
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [s.serve_once() for _ in iter(stop.is_set, True)], daemon=True)
    thread.start()
    port = s.listener.getsockname()[1]
    try:
        statuses = {_status(port, f"GET /metrics?{n} HTTP/1.1\r\n\r\n".encode()) for n in range(30)}
    finally:
        stop.set()
        socket.create_connection(("127.0.0.1", port)).close()  # wakes the loop
        thread.join(60)
        s.close()
    assert statuses == {b"HTTP/1.1 200 OK"}
    assert len(renders) == 1, len(renders)
