"""Helpers for tests of the node services: the exporter run as a program, on a port of its own."""

from __future__ import annotations

import resource
import socket
import subprocess
import time
import urllib.request

import pytest

from oci_gpu_hook.toolkit.containers import hook_command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Exporter:
    def __init__(self, config: str, tmp_path, open_files: int | None = None, listen: str = "127.0.0.1"):
        """open_files: the exporter's RLIMIT_NOFILE (soft and hard), to run it short of descriptors;
        listen: the host part of --listen ("" for every address); the tests connect to 127.0.0.1."""
        self.port = free_port()
        self.last_reply = None  # when the last page came: text() asks again only REUSE_SECONDS later
        self.log = open(tmp_path / f"exporter-{self.port}.log", "w+")

        def limit():
            if open_files is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

        self.proc = subprocess.Popen(
            [*hook_command(config), "exporter", "--listen", f"{listen}:{self.port}"],
            stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL,
            preexec_fn=limit,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                self.text()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"the exporter did not start: {self.output()}")
                time.sleep(0.1)

    def text(self) -> str:
        """The page, rendered after the last page this read came: a page answers every GET for
        REUSE_SECONDS after its render began, so this asks again only that long after the last
        (as Prometheus, which scrapes every 10 s or more, always does)."""
        from oci_gpu_hook.node.scrape_server import REUSE_SECONDS

        if self.last_reply is not None:
            time.sleep(max(0.0, self.last_reply + REUSE_SECONDS - time.monotonic()))
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = r.read().decode()
        self.last_reply = time.monotonic()
        return text

    def scrape(self) -> list:
        """[(name, labels, value)], through prometheus_client's own parser (the format is checked)."""
        from prometheus_client.parser import text_string_to_metric_families

        return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(self.text()) for s in f.samples]

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()
