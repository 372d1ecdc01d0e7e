"""Every alert of deploy/monitoring/oci-gpu-hook.rules.yml fires for real, then resolves (issue 49,
item 4): the simulated NVML, the hook, the device plugin's verdict file and the watchdog produce
each fault as it would come on a node, the exporter runs as a program on each simulated host, and
Debian's Prometheus scrapes the two exporters every second in the job `oci-gpu-hook-exporter`
(honor_labels, as docs/alerts.md says to), evaluates the shipped rules and shows each alert
firing through its API (/api/v1/alerts), with labels and annotations naming the node, the GPU or
the pod, and then gone once the fault is removed or its window has passed.

Time compressed, meaning kept. The rules speak of hours and minutes; the test runs them with every
duration divided by one factor, FACTOR (each rule's `for:`, and each range, subquery and offset
inside `expr`), derived mechanically from the shipped file by compress_rules(), never edited or
written by hand. The expressions, their thresholds, labels and annotations stay the same, and
every window keeps its proportion to every other and to every `for:`, so each rule still asks the
same question of the series, over a shorter clock: "an XID in the last hour" becomes "in the last
36 s", "idle for an hour, judged by 5-minute peaks" becomes "idle for 36 s, judged by 3-second
peaks". That holds because what these rules compute does not depend on how long a second is:
increase() over a window (a count of events), ratios of two such counts, *_over_time maxima,
comparisons with gauges. A rule whose meaning would change (a per-second rate, a count of samples,
the clock: rate, irate, deriv, count_over_time, time, ...) is refused by compress_expr(), so a
future rule cannot pass here on a changed meaning. The scrape interval is not compressed: one
second is the floor (the exporter reuses a page for scrape_server.REUSE_SECONDS), so the factor is
bounded by the shortest window, GpuAllocatedButIdle's [5m], which must keep a few scrapes: 5m/100
is 3 s, and the hour is 36 s.

The faults, all injected at once when the module's stack is up (so the compressed hours run
together), on host A (twelve A100s: row remapping needs compute capability 8.0) and host B:
- XIDs 48, 79, 94, 95, 63, 64: nvmlevents.inject_xid on GPUs 0 to 5 of A;
- a failed row remap, and rows remapped for uncorrectable errors: control's remap_failure on GPU 6,
  remapped_uncorrectable going from 0 to 2 on GPU 7;
- GPU 8 marked unhealthy: the device plugin's verdict file, written by health.write_health in a
  child process that stays alive (the exporter believes only a verdict whose writer runs);
- a container over its GPU memory limit (OCI_GPU_HOOK_GPU_MEMORY_LIMIT=1GiB, given by the hook at
  its start) on GPU 9, its process using 1 GiB + 1 MiB; then the real watchdog, started once that
  alert fires, kills it: the kill alert fires and the over-limit alert resolves;
- a container holding GPU 10 at 0 % utilization, until its process starts using it;
- on B, NVML failing (control's fail=999): stale facts; and a GPU container start the hook fails
  for a node reason, for real: /dev/nvidia1 moved aside for the start ("device node missing",
  reason "inventory"), then put back;
- B's exporter stopped, then started again on its port (down, then up); and, last, the job's
  targets taken out of Prometheus's configuration and put back, each by a reload (SIGHUP): the
  exporter absent, as when the Service has no endpoints.
A thread polls the alerts API four times a second and keeps each alert's episode (first seen,
firing, gone), so a test looks at an alert that fired while an earlier test waited. The last test
checks that every rule fired and resolved, and that no alert fired that the test did not cause.
It takes about 75 s here (2 CPUs), most of it the compressed hour.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import nvmlevents
import pytest
import yaml
from hookcheck import runc_delete, runc_detached
from servicecheck import Exporter, Prometheus

from oci_gpu_hook.node import watchdog
from oci_gpu_hook.node.plugin import health
from oci_gpu_hook.start.memory_limit import ENV as MEMORY_LIMIT_ENV
from oci_gpu_hook.toolkit import containers
from oci_gpu_hook.toolkit.simulate import control

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RULES = os.path.join(REPO, "deploy", "monitoring", "oci-gpu-hook.rules.yml")
JOB = "oci-gpu-hook-exporter"  # the job the rules' GpuExporterDown and GpuExporterAbsent select
FACTOR = 100  # every duration of the rules divided by it (the module's docstring says why this one)
SCRAPE = 1  # s: Prometheus's scrape and evaluation interval
POLL = 0.25  # s: how often the alerts API is read
GIB, MIB = 1 << 30, 1 << 20
XIDS = (48, 79, 94, 95, 63, 64)  # on GPUs 0 to 5 of host A, in this order
REMAP_FAILURE, REMAPPED, UNHEALTHY, OVER, IDLE = 6, 7, 8, 9, 10  # host A's GPUs
FAILED_GPU = 1  # host B's GPU whose device node is missing at one start
UNHEALTHY_WHY = "NVML does not list it"  # one of the plugin's own verdicts (health.device_health)


# --- time compressed: the shipped rules, every duration divided by one factor ------------------------

_UNIT_MS = {"y": 365 * 86_400_000, "w": 7 * 86_400_000, "d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1000,
            "ms": 1}  # fmt: skip
_DURATION = r"(?:[0-9]+(?:ms|[smhdwy]))+"
_RANGE = re.compile(rf"\[\s*({_DURATION})\s*(?::\s*({_DURATION})?\s*)?\]")
_OFFSET = re.compile(rf"\boffset(\s+)(-?)({_DURATION})(?![0-9A-Za-z_])")
# What PromQL leaves alone: string literals (a label value may look like "[5m]") and comments.
_UNTOUCHED = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`|#[^\n]*')
# Functions whose answer depends on how long a second is or how many samples a window holds, or
# on the clock: compressed, a rule using them would ask something else.
_REFUSED = re.compile(r"\b(rate|irate|deriv|predict_linear|holt_winters|double_exponential_smoothing|"
                      r"count_over_time|sum_over_time|time|timestamp|minute|hour|day_of_week|day_of_month|"
                      r"day_of_year|days_in_month|month|year)\s*\(|@")  # fmt: skip


def milliseconds(text: str) -> int:
    return sum(int(n) * _UNIT_MS[unit] for n, unit in re.findall(r"([0-9]+)(ms|[smhdwy])", text))


def duration(ms: int) -> str:
    """A Prometheus duration of ms milliseconds, in hours, minutes, seconds and milliseconds."""
    parts = []
    for unit in ("h", "m", "s", "ms"):
        n, ms = divmod(ms, _UNIT_MS[unit])
        if n:
            parts.append(f"{n}{unit}")
    return "".join(parts) or "0s"


def shorter(text: str, factor: int) -> str:
    ms = milliseconds(text)
    if ms % factor:
        raise ValueError(f"{text} divided by {factor} is no whole number of milliseconds")
    return duration(ms // factor)


def compress_expr(expr: str, factor: int) -> str:
    """expr with every range, subquery range and step, and offset divided by factor; nothing else
    changed. Raises ValueError for what compressing would change the meaning of (_REFUSED)."""

    def code(part: str) -> str:
        refused = _REFUSED.search(part)
        if refused:
            raise ValueError(f"{expr!r}: {refused.group(0)!r} does not keep its meaning when time is compressed")

        def one_range(m):
            step = f":{shorter(m.group(2), factor)}" if m.group(2) else (":" if ":" in m.group(0) else "")
            return f"[{shorter(m.group(1), factor)}{step}]"

        part = _RANGE.sub(one_range, part)
        if part.count("[") != len(_RANGE.findall(part)) or re.search(r"\boffset\b", _OFFSET.sub("", part)):
            raise ValueError(f"{expr!r}: a range or offset that is no duration literal")
        return _OFFSET.sub(lambda m: f"offset{m.group(1)}{m.group(2)}{shorter(m.group(3), factor)}", part)

    out, at = [], 0
    for m in _UNTOUCHED.finditer(expr):
        out += [code(expr[at : m.start()]), m.group(0)]
        at = m.end()
    return "".join(out + [code(expr[at:])])


def compress_rules(doc: dict, factor: int) -> dict:
    """A rules file (groups:) with every duration divided by factor: each group's interval, each
    rule's for and keep_firing_for, and the durations in each expr."""
    doc = copy.deepcopy(doc)
    for group in doc["groups"]:
        if "interval" in group:
            group["interval"] = shorter(group["interval"], factor)
        for rule in group["rules"]:
            for key in ("for", "keep_firing_for"):
                if key in rule:
                    rule[key] = shorter(rule[key], factor)
            rule["expr"] = compress_expr(rule["expr"], factor)
    return doc


def shipped() -> dict:
    with open(RULES, encoding="utf-8") as f:
        return yaml.safe_load(f)


def alerting_rules(doc: dict) -> dict:
    return {rule["alert"]: rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule}


def write_compressed(path) -> dict:
    doc = compress_rules(shipped(), FACTOR)
    path.write_text(yaml.safe_dump(doc, sort_keys=False, width=120))
    return doc


def test_compressing_divides_every_duration_and_nothing_else():
    expr = ('increase(x{a="5m", b=~"[1h]"}[1h] offset 5m) > 0 # over [2h]\n'
            "and max_over_time(y[5m:30s]) < 5 or z[1h30m:] offset -90s")  # fmt: skip
    assert compress_expr(expr, 100) == (
        'increase(x{a="5m", b=~"[1h]"}[36s] offset 3s) > 0 # over [2h]\n'
        "and max_over_time(y[3s:300ms]) < 5 or z[54s:] offset -900ms"
    )
    assert duration(36_000) == "36s" and duration(3_723_004) == "1h2m3s4ms"
    for refused in ("rate(x[5m]) > 1", "count_over_time(up[5m]) < 3", "time() - x > 3600", "x @ 100"):
        with pytest.raises(ValueError, match="compressed"):
            compress_expr(refused, 100)
    with pytest.raises(ValueError, match="whole number"):
        compress_expr("x[1s]", 3)


def test_the_compressed_rules_are_the_shipped_ones_on_a_shorter_clock(require, tmp_path):
    require("promtool")
    original = shipped()
    path = tmp_path / "compressed.rules.yml"
    compressed = write_compressed(path)
    before, after = alerting_rules(original), alerting_rules(compressed)
    assert (after["GpuAllocatedButIdle"]["for"], after["GpuExporterAbsent"]["for"]) == ("36s", "9s")
    assert "[18s]" in after["GpuHookStartFailures"]["expr"] and "30m" not in after["GpuHookStartFailures"]["expr"]

    def masked(doc):  # the durations out: what is left must not have changed at all
        doc = copy.deepcopy(doc)
        for group in doc["groups"]:
            for rule in group["rules"]:
                rule.pop("for", None)
                rule["expr"] = re.sub(_DURATION, "D", rule["expr"])
        return doc

    assert masked(compressed) == masked(original)
    assert {n: milliseconds(r["for"]) for n, r in after.items() if "for" in r} == {
        n: milliseconds(r["for"]) / FACTOR for n, r in before.items() if "for" in r
    }
    ranges = [milliseconds(m.group(1)) for r in after.values() for m in _RANGE.finditer(r["expr"])]
    assert min(ranges) >= 3 * SCRAPE * 1000, "every window keeps a few scrapes"
    proc = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- what Prometheus's API shows, over time ---------------------------------------------------------


class Episode:
    """One alert, from the poll that first showed it to the first that no longer did."""

    def __init__(self, name: str, labels: dict, now: float):
        self.name, self.labels = name, labels
        self.seen_at, self.firing_at, self.resolved_at = now, None, None
        self.annotations = {}

    def describe(self) -> str:
        state = ("fired" if self.firing_at else "pending") + (", then gone" if self.resolved_at else "")
        return f"{self.name} ({state}) {self.labels}"


class AlertLog:
    """Every alert the API shows, polled every POLL s in a thread: a test finds an alert that
    fired, and went, while an earlier test waited."""

    def __init__(self, prometheus: Prometheus):
        self.prometheus = prometheus
        self.episodes: list = []
        self.shown: dict = {}  # (name, labels) -> its open Episode
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="alert-log", daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.wait(POLL):
            try:
                alerts = self.prometheus.alerts(annotations=True)
            except (OSError, ValueError):
                continue  # Prometheus busy (a reload): the next poll
            now = time.monotonic()
            with self.lock:
                present = set()
                for name, shown in alerts.items():
                    for alert in shown:
                        labels = {k: v for k, v in alert.items() if k not in ("state", "annotations")}
                        key = (name, tuple(sorted(labels.items())))
                        present.add(key)
                        episode = self.shown.get(key)
                        if episode is None:
                            episode = self.shown[key] = Episode(name, labels, now)
                            self.episodes.append(episode)
                        if alert["state"] == "firing" and episode.firing_at is None:
                            episode.firing_at, episode.annotations = now, alert["annotations"]
                for key in set(self.shown) - present:
                    self.shown.pop(key).resolved_at = now

    def stop(self):
        self.done.set()
        self.thread.join(timeout=10)

    def report(self) -> str:
        with self.lock:
            return "\n".join(e.describe() for e in self.episodes)

    def wait(self, found, what: str, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                answer = found()
            if answer:
                return answer
            if time.monotonic() > deadline:
                pytest.fail(f"not within {timeout:g} s: {what}; the alerts seen:\n{self.report()}", pytrace=False)
            time.sleep(0.1)

    def firing(self, name: str, timeout: float, **labels) -> Episode:
        """The first episode of alert `name` with these labels that fired."""

        def found():
            return next((e for e in self.episodes if e.name == name and e.firing_at is not None
                         and labels.items() <= e.labels.items()), None)  # fmt: skip

        return self.wait(found, f"{name} firing with {labels}", timeout)

    def resolved(self, episode: Episode, timeout: float) -> None:
        self.wait(lambda: episode.resolved_at is not None, f"{episode.describe()} resolved", timeout)


# --- the stack: two simulated nodes, their exporters, one Prometheus --------------------------------


class Node:
    """A simulated host, its exporter, and the live values of its simulated NVML (one control file,
    written whole at every change)."""

    def __init__(self, host: dict, hostname: str):
        self.host, self.root, self.hostname = host, host["root"], hostname
        self.config = f"{host['root']}/config.yaml"
        self.records = f"{host['root']}/containers"
        self.devices, self.processes, self.utilization, self.fail = {}, [], [], None
        self.exporter = None

    def uuid(self, index: int) -> str:
        return self.host["gpus"][index]["uuid"]

    def write(self) -> None:
        control.write(self.root, self.devices, self.processes, self.fail, self.utilization)

    def set(self, index: int, **values) -> None:
        self.devices.setdefault(self.uuid(index), {}).update(values)
        self.write()

    @property
    def instance(self) -> str:
        return f"127.0.0.1:{self.exporter.port}"

    def gpu_labels(self, index: int) -> dict:
        """What a device-wide alert on GPU index carries of its series' labels."""
        return {"gpu": str(index), "UUID": self.uuid(index), "Hostname": self.hostname, "instance": self.instance,
                "job": JOB}  # fmt: skip


# The device plugin as far as the exporter sees it: the verdict file, written by the plugin's own
# function, from a process that stays alive; one line of JSON ({uuid: why or null}) per verdict.
PLUGIN = """
import json, sys
from oci_gpu_hook.node.plugin.health import write_health
for line in sys.stdin:
    write_health(sys.argv[1], json.loads(line))
    print("written", flush=True)
"""


class Stack:
    def __init__(self, tmp, simulated_host):
        self.tmp = tmp
        self.a = Node(simulated_host(gpus=12, model="a100"), "gpu-a.cluster.example")
        self.b = Node(simulated_host(gpus=2, model="a100"), "gpu-b.cluster.example")
        self.rules = alerting_rules(write_compressed(tmp / "rules.yml"))
        self.prometheus = self.log = self.plugin = self.watchdog = None
        self.started = []  # runc container ids
        self.pids = {}  # pod name -> its container's init pid
        self.claimed = set()  # (name, labels) of the episodes the tests expected

    def start(self):
        for node in (self.a, self.b):
            node.exporter = Exporter(node.config, self.tmp, hostname=node.hostname)
        self.prometheus = Prometheus(self.tmp, [self.a.instance, self.b.instance], rules=[self.tmp / "rules.yml"],
                                     scrape=SCRAPE, job="honor_labels: true", job_name=JOB)  # fmt: skip
        self.config_text = (self.tmp / "prometheus.yml").read_text()
        self.log = AlertLog(self.prometheus)
        for node in (self.a, self.b):  # the XID thread waits on NVML's events
            self.prometheus.wait_until(lambda e=node.exporter: "XID counts: waiting on NVML events" in e.output(),
                                       "the exporters' XID threads")  # fmt: skip
        self.pids["overreach"] = self.pod("overreach", OVER, {MEMORY_LIMIT_ENV: "1GiB"})
        self.pids["notebook"] = self.pod("notebook", IDLE)
        # Every counter an alert reads seen at 0 (the recorded ones too) before the faults, so
        # that increase() sees each fault as one.
        for expr in ("min(count_over_time(device:oci_gpu_hook_gpu_xid_errors_total:max[1m])) >= 2",
                     "min(count_over_time(device:DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS:max[1m])) >= 2",
                     'count(count_over_time(oci_gpu_hook_watchdog_actions_total{action="kill"}[1m]) >= 2) == 2',
                     "count(count_over_time(oci_gpu_hook_gpu_container_starts_total[1m]) >= 2) == 2",
                     "count(oci_gpu_hook_container_gpu_allocated) == 2"):  # fmt: skip
            self.prometheus.wait_for(expr)

    def pod(self, name: str, gpu: int, env: dict | None = None) -> int:
        """A container of pod `name` (namespace ml, container main) on host A's GPU, given it by
        the hook; its init pid."""
        container_id = f"ocigpu-alerts-{os.getpid()}-{name}"
        bundle = containers.make_bundle(
            str(self.tmp / name), args=["busybox", "sleep", "600"],
            env={"NVIDIA_VISIBLE_DEVICES": str(gpu), **(env or {})}, config_file=self.a.config,
            annotations={"io.kubernetes.cri.sandbox-name": name, "io.kubernetes.cri.sandbox-namespace": "ml",
                         "io.kubernetes.cri.container-name": "main"},
        )  # fmt: skip
        self.started.append(container_id)
        return runc_detached(bundle, container_id)

    def verdict(self, unhealthy: dict) -> None:
        """The plugin's verdicts on every device of host A: those named unhealthy, the rest healthy."""
        doc = {gpu["uuid"]: unhealthy.get(gpu["uuid"]) for gpu in self.a.host["gpus"]}
        self.plugin.stdin.write(json.dumps(doc) + "\n")
        self.plugin.stdin.flush()
        assert self.plugin.stdout.readline() == "written\n"

    def inject(self):
        """Every fault that does not wait for another, at once."""
        for index, xid in enumerate(XIDS):
            nvmlevents.inject_xid(self.a.root, self.a.uuid(index), xid)
        self.a.devices = {self.a.uuid(REMAP_FAILURE): {"remap_failure": 1},
                          self.a.uuid(REMAPPED): {"remapped_uncorrectable": 2},
                          self.a.uuid(OVER): {"util_gpu": 50}}  # fmt: skip
        self.a.processes = [(self.a.uuid(OVER), self.pids["overreach"], GIB + MIB)]
        self.a.utilization = [(self.a.uuid(OVER), self.pids["overreach"], 50, 10, 0, 0)]
        self.a.write()
        self.plugin = subprocess.Popen([sys.executable, "-c", PLUGIN, self.a.records], cwd=REPO, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
        self.verdict({self.a.uuid(UNHEALTHY): UNHEALTHY_WHY})
        self.b.fail = 999  # NVML_ERROR_UNKNOWN from every call
        self.b.write()
        node = f"{self.b.root}/dev/nvidia{self.b.host['gpus'][FAILED_GPU]['minor']}"
        os.rename(node, node + ".away")  # gone for one start, as a driver being unloaded takes it
        try:
            bundle = containers.make_bundle(str(self.tmp / "refused"), args=["busybox", "true"],
                                            env={"NVIDIA_VISIBLE_DEVICES": str(FAILED_GPU)},
                                            config_file=self.b.config)  # fmt: skip
            with pytest.raises(RuntimeError, match="device node missing"):
                runc_detached(bundle, f"ocigpu-alerts-{os.getpid()}-refused")
        finally:
            os.rename(node + ".away", node)

    def reload(self, text: str) -> None:
        """Prometheus's configuration replaced, as the operator's config reloader does (SIGHUP);
        returns once Prometheus has the configuration's targets."""
        (self.tmp / "prometheus.yml").write_text(text)
        self.prometheus.proc.send_signal(signal.SIGHUP)
        wanted = sorted(t for job in yaml.safe_load(text)["scrape_configs"] for group in job["static_configs"]
                        for t in group["targets"])  # fmt: skip
        self.prometheus.wait_until(
            lambda: sorted(t["labels"]["instance"] for t in self.prometheus.api("targets")["activeTargets"]) == wanted,
            "the configuration's targets")  # fmt: skip

    def stop(self):
        if self.log is not None:
            self.log.stop()
        for container_id in self.started:
            runc_delete(container_id)
        for process in (self.plugin, self.watchdog):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
        if self.prometheus is not None:
            self.prometheus.stop()
        for node in (self.a, self.b):
            if node.exporter is not None and node.exporter.proc.poll() is None:
                node.exporter.stop()
            control.clear(node.root)
            nvmlevents.clear_events(node.root)
            for path in (health.health_path(node.records), watchdog.counters_path(node.records)):
                if os.path.exists(path):
                    os.unlink(path)

    def expect(self, name: str, timeout: float, **labels) -> Episode:
        """The alert firing with these labels, its severity and annotations those of its rule,
        after its (compressed) `for:` pending."""
        episode = self.log.firing(name, timeout, **labels)
        self.claimed.add((name, tuple(sorted(episode.labels.items()))))
        rule = self.rules[name]
        assert episode.labels["severity"] == rule["labels"]["severity"]
        assert set(episode.annotations) == set(rule["annotations"]) and all(episode.annotations.values())
        if "for" in rule:
            held = milliseconds(rule["for"]) / 1000
            assert episode.firing_at - episode.seen_at >= held - 2 * POLL, (name, "fired before its for:")
        return episode


@pytest.fixture(scope="module")
def stack(simulated_host, require, tmp_path_factory):
    require("root", "gcc", "runc", "busybox", "pynvml", "prometheus", "promtool")
    stack = Stack(tmp_path_factory.mktemp("alerts"), simulated_host)
    try:
        stack.start()
        stack.inject()
        yield stack
    finally:
        stack.stop()


# Generous bounds: each alert comes within a few seconds of its compressed window; only its never
# coming fails.
SOON, HOUR = 30, 36 + 45


def summary(episode: Episode) -> str:
    return episode.annotations["summary"]


# --- the tests, those that act on an alert first (the others' windows run meanwhile) -----------------


def test_a_failed_row_remap_fires_until_the_flag_clears(stack):
    a = stack.a
    episode = stack.expect("GpuRowRemapFailure", SOON, **a.gpu_labels(REMAP_FAILURE))
    assert f"{a.hostname} GPU {REMAP_FAILURE} ({a.uuid(REMAP_FAILURE)})" in summary(episode)
    a.set(REMAP_FAILURE, remap_failure=0)  # the GPU replaced, or reset with spare rows
    stack.log.resolved(episode, SOON)


def test_a_gpu_the_device_plugin_marks_unhealthy(stack):
    a = stack.a
    episode = stack.expect("GpuMarkedUnhealthy", SOON, reason=UNHEALTHY_WHY, **a.gpu_labels(UNHEALTHY))
    assert f"{a.hostname} GPU {UNHEALTHY} ({a.uuid(UNHEALTHY)}) unhealthy" in summary(episode)
    stack.verdict({})  # the plugin sees the GPU healthy again
    stack.log.resolved(episode, SOON)


def test_a_container_over_its_limit_until_the_watchdog_kills_it(stack):
    a = stack.a
    over = stack.expect("GpuContainerOverMemoryLimit", SOON, pod="overreach", namespace="ml", container="main",
                        **a.gpu_labels(OVER))  # fmt: skip
    assert summary(over).startswith("Container ml/overreach/main uses ")
    assert f"{a.hostname} GPU {OVER} ({a.uuid(OVER)}), over its GPU memory limit" in summary(over)
    with open(stack.tmp / "watchdog.log", "w") as log:
        stack.watchdog = subprocess.Popen([*containers.hook_command(a.config), "watchdog", "--interval", "0.5"],
                                          stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    killed = stack.expect("GpuWatchdogKilledContainer", SOON, action="kill", instance=a.instance, job=JOB)
    assert a.instance in summary(killed)
    stack.log.resolved(over, SOON)  # its process is gone
    assert watchdog.read_counters(a.records) == {"kill": 1}
    stack.log.resolved(killed, SOON)  # the watchdog still runs: 15 minutes (compressed) without a kill
    assert stack.watchdog.poll() is None
    stack.watchdog.terminate()
    stack.watchdog.wait(timeout=30)


def test_stale_facts_while_nvml_fails(stack):
    b = stack.b
    episode = stack.expect("GpuFactsStale", SOON, instance=b.instance, job=JOB)
    assert b.instance in summary(episode)
    b.fail = None
    b.write()
    stack.log.resolved(episode, SOON)


def test_start_failures_for_a_node_reason(stack):
    b = stack.b
    episode = stack.expect("GpuHookStartFailures", SOON, instance=b.instance, job=JOB)
    assert summary(episode).endswith(f"% of GPU container starts failed on {b.instance} in the last 30 minutes")
    (failed,) = stack.prometheus.query(f'oci_gpu_hook_gpu_container_failures_total{{instance="{b.instance}"}} > 0')
    assert (failed["metric"]["reason"], failed["value"][1]) == ("inventory", "1")  # the node's, not the request's
    stack.log.resolved(episode, SOON)  # 30 minutes (compressed) without another


def test_the_exporter_down_then_started_again(stack):
    b = stack.b
    port = b.exporter.port
    b.exporter.stop()
    episode = stack.expect("GpuExporterDown", SOON, instance=b.instance, job=JOB)
    assert b.instance in summary(episode)
    again = stack.tmp / "again"
    again.mkdir()
    b.exporter = Exporter(b.config, again, hostname=b.hostname, port=port)
    stack.log.resolved(episode, SOON)


@pytest.mark.parametrize("xid", XIDS)
def test_an_xid_fires_on_its_gpu_for_an_hour(stack, xid):
    a = stack.a
    index = XIDS.index(xid)
    (name,) = [name for name, rule in stack.rules.items() if f'{{xid="{xid}"}}' in rule["expr"]]
    episode = stack.expect(name, HOUR, xid=str(xid), **a.gpu_labels(index))
    assert summary(episode).startswith(f"XID {xid} (")
    assert f"{a.hostname} GPU {index} ({a.uuid(index)})" in summary(episode)
    stack.log.resolved(episode, HOUR)  # the hour (compressed) after it passed


def test_rows_remapped_for_uncorrectable_errors_fire_for_an_hour(stack):
    a = stack.a
    episode = stack.expect("GpuUncorrectableRowsRemapped", HOUR, **a.gpu_labels(REMAPPED))
    assert f"{a.hostname} GPU {REMAPPED} ({a.uuid(REMAPPED)})" in summary(episode)
    stack.log.resolved(episode, HOUR)


def test_a_gpu_allocated_but_idle_until_it_is_used(stack):
    a = stack.a
    episode = stack.expect("GpuAllocatedButIdle", HOUR, pod="notebook", namespace="ml", container="main",
                           **a.gpu_labels(IDLE))  # fmt: skip
    assert summary(episode).startswith(f"ml/notebook/main has held {a.hostname} GPU {IDLE} ({a.uuid(IDLE)})")
    pid = stack.pids["notebook"]
    a.processes.append((a.uuid(IDLE), pid, 4 * GIB))
    a.utilization.append((a.uuid(IDLE), pid, 60, 20, 0, 0))
    a.set(IDLE, util_gpu=60)
    stack.log.resolved(episode, SOON)


def test_the_exporter_absent_from_prometheus(stack):
    """The job's targets taken out of Prometheus's configuration, as when the Service has no
    endpoints, then put back: each a reload, as the operator's config reloader does it. (Not the
    whole job: Prometheus writes no staleness markers for a job it drops, so `up` would answer for
    the 5 minutes of its lookback, a setting of Prometheus's that the compressed rules leave alone.)"""
    without = yaml.safe_load(stack.config_text)
    (job,) = without["scrape_configs"]
    job["static_configs"] = [{"targets": []}]
    stack.reload(yaml.safe_dump(without))
    episode = stack.expect("GpuExporterAbsent", SOON, job=JOB)
    stack.reload(stack.config_text)
    stack.log.resolved(episode, SOON)


def test_every_rule_fired_and_resolved_and_nothing_else_fired(stack):
    fired = {(e.name, tuple(sorted(e.labels.items()))) for e in stack.log.episodes if e.firing_at is not None}
    assert {name for name, _ in fired} == set(stack.rules), stack.log.report()
    assert fired == stack.claimed, "alerts no test caused:\n" + "\n".join(
        f"{name} {dict(labels)}" for name, labels in sorted(fired - stack.claimed)
    )
    assert all(e.resolved_at is not None for e in stack.log.episodes if e.firing_at is not None), stack.log.report()
