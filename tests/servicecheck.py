"""Helpers for tests of the node services: the exporter run as a program, on a port of its own."""

from __future__ import annotations

import resource
import socket
import subprocess
import time
import urllib.request

import pytest

from oci_gpu_hook.start.linux import _linux
from oci_gpu_hook.toolkit.containers import hook_command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Exporter:
    def __init__(self, config: str, tmp_path, open_files: int | None = None, listen: str = "127.0.0.1",
                 hostname: str | None = None, port: int | None = None, args=()):  # fmt: skip
        """open_files: the exporter's RLIMIT_NOFILE (soft and hard), to run it short of descriptors;
        listen: the host part of --listen ("" for every address); the tests connect to 127.0.0.1;
        hostname: the host name it sees (its Hostname label), in a UTS namespace of its own, as if
        it ran on that node of a cluster (needs root); port: the one to listen on (a stopped
        exporter's, to start it again where Prometheus scrapes it), else a free one; args: more of
        its options."""
        self.port = port or free_port()
        self.last_reply = None  # when the last page came: text() asks again only REUSE_SECONDS later
        self.log = open(tmp_path / f"exporter-{self.port}.log", "w+")

        def limit():
            if open_files is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))
            if hostname is not None:
                _linux.unshare(_linux.CLONE_NEWUTS)
                socket.sethostname(hostname)

        self.proc = subprocess.Popen(
            [*hook_command(config), "exporter", "--listen", f"{listen}:{self.port}", *args],
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


class Prometheus:
    """Debian's Prometheus server (the `prometheus` requirement), with its own port, configuration
    and data directory under tmp_path, scraping target (an address, or a list of them in the one
    job) every `scrape` seconds; stopped by its pid.
    rules: rule files it evaluates (every `scrape` seconds too); job: the scrape config's text
    below its job_name line, beyond the targets (honor_labels, relabelling...)."""

    def __init__(self, tmp_path, target: str | list, rules=(), scrape: float = 1, job: str = "",
                 labels: dict | None = None, job_name: str = "gpu"):  # fmt: skip
        import json

        self.port = free_port()
        config = tmp_path / "prometheus.yml"
        targets = [target] if isinstance(target, str) else list(target)  # one job: several exporters
        static = {"targets": targets, **({"labels": labels} if labels else {})}
        config.write_text(
            "global:\n"
            f"  scrape_interval: {scrape}s\n"
            f"  evaluation_interval: {scrape}s\n"
            + (f"rule_files: {json.dumps([str(r) for r in rules])}\n" if rules else "")
            + "scrape_configs:\n"
            f"  - job_name: {job_name}\n"
            f"    static_configs: [{json.dumps(static)}]\n" + "".join(f"    {line}\n" for line in job.splitlines())
        )
        self.log = open(tmp_path / "prometheus.log", "w+")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL, cwd=str(tmp_path),
        )  # fmt: skip

    def api(self, path: str, **params):
        import json
        import urllib.parse

        url = f"http://127.0.0.1:{self.port}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.load(r)
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def wait_for(self, expr: str, timeout: float = 60) -> list:
        return self.wait_until(lambda: self.query(expr), f"an answer to {expr!r}", timeout)

    def wait_until(self, probe, what: str, timeout: float = 60):
        """probe()'s first truthy answer; fails the test with Prometheus's log after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                found = probe()
                if found:
                    return found
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.log.seek(0)
                pytest.fail(f"Prometheus never gave {what}: {self.log.read()[-2000:]}")
            time.sleep(0.2)

    def alerts(self, annotations: bool = False) -> dict:
        """{alert name: [its alerts' labels with their state]} as the rules evaluate now; with
        annotations, each also with "annotations": {name: the text its template rendered}."""
        found = {}
        for alert in self.api("alerts")["alerts"]:
            shown = dict(alert["labels"], state=alert["state"])
            if annotations:
                shown["annotations"] = alert["annotations"]
            found.setdefault(alert["labels"]["alertname"], []).append(shown)
        return found

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


# A Kubernetes pod's names, as containerd's CRI plugin annotates its containers.
ANNOTATIONS = {"io.kubernetes.cri.sandbox-name": "pod-a", "io.kubernetes.cri.sandbox-namespace": "team",
               "io.kubernetes.cri.container-name": "cuda"}  # fmt: skip


def values(samples, name, **labels) -> list:
    """The values of name's series in samples (Exporter.scrape()) that carry labels."""
    return [v for n, ls, v in samples if n == name and all(ls.get(k) == w for k, w in labels.items())]


def start_gpu_container(live_container, host, devices, annotations=None):
    """A live container (the live_container fixture) given devices by the hook, as a runtime would
    run it at prestart, with annotations in its config.json; (its id, its pid)."""
    import json
    import os

    import hookcheck

    state, bundle, pid, cgroup, _ = live_container({"NVIDIA_VISIBLE_DEVICES": devices})
    if annotations:
        config_path = os.path.join(bundle, "config.json")
        with open(config_path) as f:
            config = json.load(f)
        config["annotations"] = annotations
        with open(config_path, "w") as f:
            json.dump(config, f)
    done = hookcheck.run_hook(f"{host['root']}/config.yaml", state)
    assert done.returncode == 0, done.stderr
    return json.loads(state)["id"], pid
