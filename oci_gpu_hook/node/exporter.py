"""`oci-gpu-hook exporter`: GPU metrics for Prometheus, with the container, pod and namespace
holding each device, and the hook's own counters.

Each scrape reads the container records (collecting those of containers that are gone), asks
NVML through the one reader, attributes devices and GPU processes to containers, and renders the
page (metrics.py). NVML failing does not take the endpoint down: the page keeps the last facts
read, oci_gpu_hook_gpu_facts_stale says so, and one line is logged when that starts and ends.
XIDs come from NVML's events, which a thread of the exporter waits on (XidCounting).
"""

from __future__ import annotations

import socket
import threading
import time

from oci_gpu_hook.errors import HookError, NvmlError, UsageError
from oci_gpu_hook.node import attribution, metrics, say, watchdog
from oci_gpu_hook.node.nvml_reader import RESTART, DriverChanged
from oci_gpu_hook.node.plugin import health, xid_watch
from oci_gpu_hook.node.scrape_server import REUSE_SECONDS, ScrapeServer
from oci_gpu_hook.start import container_record
from oci_gpu_hook.start.digits import decimal


def log(message: str) -> None:
    say("exporter", message)


def parse_listen(value: str) -> tuple[str, int]:
    """HOST:PORT, :PORT or [IPv6]:PORT -> (host, port); an empty host means every address, IPv6 and
    IPv4 (IPv4 alone on a host without IPv6)."""
    host, sep, port = value.rpartition(":")
    number = decimal(port) if sep else None
    if number is None or not 0 < number < 65536:
        raise UsageError(f"--listen {value!r}: expected HOST:PORT or :PORT (port 1-65535)")
    return host.strip("[]"), number


class XidCounting(xid_watch.XidWatch):
    """The device plugin's XID thread, counting every XID for the page rather than marking health."""

    name = "XID counts"
    unwatched = "no XID is counted for it"
    EVERY_XID = xid_watch.XidPolicy(xid_watch.ALL_XIDS, frozenset(), frozenset())

    def __init__(self, library_path: str, gpu_uuids, counts: metrics.XidCounts):
        def report(event):
            counts.record(event.gpu_uuid, event.xid)

        super().__init__(library_path, gpu_uuids, self.EVERY_XID, report, log)


class Exporter:
    def __init__(self, reader, records_directory: str, hostname: str | None = None, proc: str = "/proc"):
        self.reader = reader
        self.records_directory = records_directory
        self.hostname = hostname or socket.gethostname()
        self.proc = proc
        self.counters = metrics.StartCounters()
        self.samples = ()
        self.read_at = None  # time.monotonic() of the samples' read
        self.stale = False
        self.renders = 0  # pages rendered: what clients can make the exporter do (NVML, records)
        self.garbage_seen = set()
        self.warned_namespace = False
        self.records = attribution.Records(records_directory, log, "removed")
        self.lock = threading.Lock()
        self.xids = metrics.XidCounts()
        self.xid_watch = None
        if hasattr(reader, "before_restart"):
            reader.before_restart = self.stop  # started again on the new inventory (_follow_inventory)
        self.watched = None  # (library, GPU uuids) the XID thread waits on
        self.followed = None  # the inventory the XID thread and the sharing were set from
        self.sharing = {}  # sharing()

    def scrape(self) -> str:
        with self.lock:
            self.renders += 1
            records = self.records.read() or {}
            if not attribution.sees_host_processes(self.proc):
                # In a PID namespace of its own (a pod without hostPID) every container's pid looks
                # gone: nothing is attributed, and above all nothing is collected.
                if not self.warned_namespace:
                    log("not in the host's PID namespace: containers cannot be seen (run with hostPID)")
                self.warned_namespace = True
                records = {}
            for name in sorted(n for n, r in records.items() if r is None and n not in self.garbage_seen):
                if name not in self.records.refused:  # those the reader has said
                    log(f"{self.records_directory}/{name}: not a container record; removed")
            self.garbage_seen = {n for n, r in records.items() if r is None}
            self.counters.observe(records)
            running = container_record.live(records, self.proc)
            container_record.remove(self.records_directory, [n for n in records if n not in running])
            live = attribution.started(running)
            try:
                self.samples = self.reader.read()
                self.read_at = time.monotonic()
                if self.stale:
                    log("NVML answers again; GPU facts are current")
                self.stale = False
            except NvmlError as e:
                if not self.stale:
                    kept = "the last GPU facts read" if self.samples else "no GPU facts"
                    log(f"{e.message}; serving {kept}, marked stale")
                self.stale = True
                # NVML lists the GPUs again only once no one holds it: the XID thread lets go
                # too, and starts again with the next read that succeeds
                self.stop()
            if not self.stale:
                self._follow_inventory()
            owner = attribution.Owners(live, self.proc)
            renders = metrics.Family(
                "oci_gpu_hook_exporter_renders_total", "counter",
                "Pages this exporter rendered (each reads NVML and the records), this one included, since it "
                f"started; a page answers every GET for {REUSE_SECONDS:g} s after its render ended (longer after "
                "a slower render).",
            )  # fmt: skip
            renders.add({}, self.renders)
            inventory = getattr(self.reader, "inventory", None)
            page = metrics.Page(
                hostname=self.hostname,
                driver_version=(inventory.driver_version or "") if inventory else "",
                live=live,
                memory=attribution.memory_by_container(self.samples, live, self.proc, owner),
                utilization=attribution.utilization_by_container(self.samples, live, self.proc, owner),
                stale=self.stale,
                age=None if self.read_at is None else time.monotonic() - self.read_at,
                counters=self.counters,
                xids=self.xids,
                watchdog=watchdog.read_counters(self.records_directory),
                sharing=self.sharing,
                health=health.read_health(self.records_directory),
                extra=(renders,),
            )
            return metrics.render(self.samples, page)

    def _follow_inventory(self) -> None:
        """Keep the devices' sharing as the device plugin offers them, from the inventory read,
        and the XID thread on its GPUs and library: both from the first inventory, and again
        when it changes (a GPU gone or added, a driver); the thread also after it was stopped
        (NVML failing, or started afresh)."""
        inventory = getattr(self.reader, "inventory", None)
        path = getattr(self.reader, "path", None)
        if inventory is None or path is None:
            return
        settings = getattr(self.reader, "settings", None)
        if inventory is not self.followed and settings is not None:
            self.sharing = sharing(settings, inventory)
        self.followed = inventory
        wanted = (path, tuple(sorted(g.uuid for g in inventory.gpus)))
        if wanted == self.watched and self.xid_watch is not None:
            return
        self.stop()
        self.xid_watch = XidCounting(path, wanted[1], self.xids).start()
        self.watched = wanted

    def stop(self) -> None:
        if self.xid_watch is not None:
            self.xid_watch.stop()
            self.xid_watch = None
            self.watched = None


def sharing(settings, inventory) -> dict:
    """{device uuid: (mechanism, replicas, resource)}: how the device plugin offers each device
    under this node's configuration (the one source the plugin and the labels read): whole,
    time-sliced, mps or mig. {} where the configuration does not fit the node (the plugin and the
    labels say why)."""
    from oci_gpu_hook.errors import ConfigError
    from oci_gpu_hook.node.plugin import config as plugin_config
    from oci_gpu_hook.node.plugin.resources import resources

    path = settings.node.device_plugin_config
    try:
        offered = resources(inventory, plugin_config.load(path, settings.node), plugin_config.source(path))
    except ConfigError:
        return {}
    words = {"none": "whole", "time-slicing": "time-sliced", "mps": "mps"}
    return {unit.uuid: ("mig" if unit.mig is not None else words[r.sharing_strategy], r.replicas, r.name)
            for r in offered for unit in r.units}  # fmt: skip


def responder(exporter: Exporter, gate: str | None = None):
    """respond(path, head) for the scrape server: the page, or the index, or /ready, or 404. HEAD
    answers with the last page rendered and renders none: anyone who can reach the port can ask,
    and only a GET may make the exporter read NVML (the server reuses a page for every GET of its
    path within scrape_server.REUSE_SECONDS). The page depends on the path alone: no query string
    is read. /ready (the readiness probe's) is 200 once every gate in the gates' file passed
    (gate (d): the exporter is a Service endpoint only on a validated node), else 503 with the
    line of the gate it waits on; without a gate, 200."""
    last = [b""]

    def respond(path: str, head: bool = False):
        if path == "/metrics":
            if not head:
                # Text from containers is made printable where it is rendered (metrics.escape); the
                # encoding replaces whatever else could not be encoded rather than fail the page.
                try:
                    last[0] = exporter.scrape().encode("utf-8", "replace")
                except DriverChanged as e:  # a new driver's NVML needs a new process
                    log(str(e))
                    raise SystemExit(RESTART) from None
            return 200, "text/plain; version=0.0.4; charset=utf-8", last[0]
        if path == "/":
            return 200, "text/html", b'<html><body><a href="/metrics">metrics</a></body></html>\n'
        if path == "/ready":
            waiting = _waiting_on(gate)
            if waiting is None:
                return 200, "text/plain", b"ready\n"
            return 503, "text/plain", f"waiting: {waiting}\n".encode("utf-8", "replace")
        return 404, "text/plain", b"not found\n"

    return respond


def _waiting_on(gate: str | None) -> str | None:
    """Why the exporter is not ready (None: it is): a gate that has not passed, or a gates' file
    not to be trusted."""
    if gate is None:
        return None
    from oci_gpu_hook.node import gates

    try:
        return gates.holding(gates.read(gate))
    except ValueError as e:
        return f"the gates' verdicts cannot be trusted: {e}"


def serve(exporter: Exporter, listen: str, ready=None, gate: str | None = None) -> None:
    host, port = parse_listen(listen)
    try:
        server = ScrapeServer(host, port, responder(exporter, gate), log)  # "": every address, IPv6 and IPv4
    except OSError as e:
        raise HookError(f"cannot listen on {listen}: {e.strerror or e}") from None
    log(f"serving /metrics on {listen} (records: {exporter.records_directory})")
    if ready:
        ready(server)
    try:
        server.serve_forever()
    finally:
        server.close()
        exporter.stop()


def run(settings, listen: str, gate: str | None = None) -> int:
    from oci_gpu_hook.node.nvml_reader import HostReader

    exporter = Exporter(HostReader(settings, detail=True, tell=log), settings.records_path)

    def ready(server):
        started = time.monotonic()
        exporter.scrape()  # NVML started, and a failure logged, before Prometheus's first scrape
        log(f"ready in {time.monotonic() - started:.2f} s")

    serve(exporter, listen, ready, gate)
    return 0
