"""The device plugin's loop (`oci-gpu-hook device-plugin`): the configuration is checked before
anything is served (a mistake stops the start with one line); then a server for each resource
resources.py computes (server.py), registered with the kubelet, and every interval:
- a kubelet restart noticed (the kubelet wipes the directory, our sockets with it, and makes a
  new kubelet.sock; directory_watch.py wakes the loop at once): served and registered again;
- each device's health checked (health.py); a change reaches the kubelet through ListAndWatch
  at once. Beside the loop, a thread waits on NVML events (xid_watch.py): a critical XID makes
  its GPU or MIG device Unhealthy at once, until that GPU goes and comes back;
- a driver change noticed (the inventory fingerprint the hook's cache uses): the inventory read
  again, and resources that appear or go away registered or stopped.
"""

from __future__ import annotations

import os
import signal
import threading

from oci_gpu_hook.errors import HookError, PrerequisiteError
from oci_gpu_hook.node.plugin import allocation, api, health, mps, resources, say, topology, xid_watch
from oci_gpu_hook.node.plugin.server import KUBELET_SOCKET, ResourceServer, file_identity


def _count(devices) -> str:
    return f"{len(devices)} device" + ("" if len(devices) == 1 else "s")


class DevicePlugin:
    def __init__(self, settings, config, socket_dir: str, where: str = "device plugin configuration",
                 gate: str | None = None):  # fmt: skip
        self.settings, self.config, self.socket_dir, self.where = settings, config, socket_dir, where
        # The validation gates' file this plugin follows (node/gates.py), or None: registered only
        # once the toolkit gate first passed; every device withdrawn while gate toolkit has failed.
        self.gate, self.gate_passed = gate, False
        self.withdrawn: str | None = None
        self.kubelet_socket = os.path.join(socket_dir, KUBELET_SOCKET)
        self.reader = None
        self.inventory = None
        self.fingerprint = None
        self.resources: tuple = ()
        self.topology = topology.EMPTY
        self.health: dict = {}
        self.health_kept = False  # health as written for the exporter (health.write_health)
        self._health_problem = None
        self.servers: dict = {}  # resource name -> ResourceServer
        self.registered_with = None  # file_identity() of the kubelet.sock we registered with
        self._last_problem = None
        self.xids = xid_watch.policy(self.config, os.environ)
        self.xid_watch = None
        self.xid_marks = health.XidMarks()
        self._health_lock = threading.RLock()  # health is checked in the loop and on an XID
        self.mps = mps.Daemons(say)  # the MPS daemons of the resources shared through MPS

    def load(self) -> None:
        """The inventory and the resources it gives; ConfigError when the configuration does not fit."""
        from oci_gpu_hook.node.nvml_reader import NvmlReader, check_library
        from oci_gpu_hook.start import inventory_cache

        # Everything is computed before anything is replaced: a read that fails leaves the
        # previous inventory in service, and the next round tries again.
        fingerprint = inventory_cache.fingerprint(self.settings)
        inventory = inventory_cache.load(self.settings)
        offered = resources.resources(inventory, self.config, self.where)
        allocation.imex_nodes(self.config, inventory, self.where)  # a required channel missing stops it
        reader = NvmlReader(inventory)  # bound to the library this inventory found
        if self.reader is not None:
            check_library(self.reader, reader)  # another driver's NVML: the process starts again
            self.reader.close()
        with self._health_lock:
            self.reader = reader
            self.fingerprint, self.inventory, self.resources = fingerprint, inventory, offered
            self.topology = topology.read(inventory, reader, self.settings.node.sys_root)
            self.xid_marks.forget_not_in(inventory)
        self._start_xid_watch()

    # --- XID health: the watch thread reports, the marks are health.py's ----------------------------

    def _start_xid_watch(self) -> None:
        """(Re)start the thread for the inventory's GPUs and NVML library; none when XID health is off."""
        if self.xid_watch is not None:
            self.xid_watch.stop()
            self.xid_watch = None
        if self.xids.off or self.reader.path is None or not self.inventory.gpus:
            return
        self.xid_watch = xid_watch.XidWatch(self.reader.path, [g.uuid for g in self.inventory.gpus], self.xids,
                                            self._on_xid, say).start()  # fmt: skip

    def _on_xid(self, event) -> None:
        """A critical XID (from the watch thread): its devices Unhealthy now, not at the next round."""
        with self._health_lock:
            if self.xid_marks.mark(self.inventory, event):
                self._check_health()

    def _problem(self, message: str | None) -> None:
        """Say a problem once, until it clears."""
        if message and message != self._last_problem:
            say(message)
        self._last_problem = message

    def check_health(self) -> None:
        with self._health_lock:
            self._check_health()

    def read_gate(self) -> None:
        """The gates' verdicts now: whether this plugin may register (the toolkit gate passed once),
        and whether its devices are withdrawn (gate toolkit failed; after the first pass, a file
        that is gone or not to be trusted too)."""
        from oci_gpu_hook.node import gates

        if self.gate is None:
            return
        try:
            verdicts = gates.read(self.gate)
        except ValueError as e:
            withdrawn = f"the gates' verdicts cannot be trusted: {e}"
        else:
            if gates.toolkit_passed(verdicts) and not self.gate_passed:
                say("gate toolkit passed: serving and registering")
                self.gate_passed = True
            # Gate toolkit alone: a hook that does not work. A failed gate plugin is said on the
            # Node, but withdrawing for it would keep its next pod from ever being placed.
            toolkit = verdicts["toolkit"]
            withdrawn = gates.line("toolkit", toolkit) if toolkit["state"] == "failed" else None
            if withdrawn is None and self.gate_passed and not gates.toolkit_passed(verdicts):
                withdrawn = f"gate toolkit is {verdicts['toolkit']['state']} again"
        with self._health_lock:  # one assignment, under the lock an XID's health check takes
            self.withdrawn = withdrawn

    def _check_health(self) -> None:
        gone: set = set()
        found = health.device_health(self.inventory, self.reader, gone)
        self.xid_marks.apply(self.inventory, found, gone)
        if self.withdrawn is not None:
            found = {uuid: self.withdrawn for uuid in found}  # every device, with the gate's line
        if found != self.health:
            # One line per cause (a failing NVML makes every device Unhealthy at once), and the
            # devices that became healthy again; devices healthy from the start are not listed.
            causes: dict = {}
            for uuid, problem in sorted(found.items()):
                if problem is not None and self.health.get(uuid) != problem:
                    causes.setdefault(problem, []).append(uuid)
            for problem, uuids in causes.items():
                say(f"Unhealthy: {', '.join(uuids)}: {problem}")
            recovered = [u for u, p in sorted(found.items()) if p is None and self.health.get(u) is not None]
            if recovered:
                say(f"Healthy again: {', '.join(recovered)}")
            self.health = found
            self.health_kept = False
            for server in self.servers.values():
                server.update()
        if not self.health_kept:  # for the exporter; tried again each round until it is written
            try:
                health.write_health(self.settings.records_path, found)
                self.health_kept = True
            except OSError as e:
                if self._health_problem != str(e):
                    say(f"cannot keep its devices' health for the exporter: {e.strerror or e}; trying each round")
                self._health_problem = str(e)

    def sync_servers(self) -> None:
        """Servers for exactly the current resources; new device lists reach the kubelet. The MPS
        daemons first: a resource shared through MPS is offered once its daemon has its defaults.
        A daemon that cannot start stops the plugin's start; later (a new inventory), its resource
        is held back, and each round tries again (round)."""
        try:
            self.mps.sync(self.resources, self.inventory)
        except mps.MpsError as e:
            if not self.servers:
                raise
            self._problem(e.message)
        wanted = {r.name: r for r in self.resources if not r.mps_root or r.name in self.mps.running}
        for name in [n for n in self.servers if n not in wanted]:
            say(f"{name}: no longer offered")
            self.servers.pop(name).stop()
        for name, resource in wanted.items():
            server = self.servers.get(name)
            if server is None:
                self.servers[name] = ResourceServer(self, resource)
            elif server.resource != resource:
                server.update(resource)

    def ensure_registered(self) -> None:
        """Serve and register every resource that is not (a kubelet restart wiped its socket, or
        a new kubelet.sock appeared)."""
        if self.gate is not None and not self.gate_passed:
            self._problem(f"waiting for gate toolkit to pass ({self.gate}): nothing is offered until it does")
            return
        kubelet = file_identity(self.kubelet_socket)
        if kubelet is None:
            self._problem(f"waiting for the kubelet: {self.kubelet_socket} is not there")
            return
        fresh_kubelet = kubelet != self.registered_with
        for name, server in self.servers.items():
            if server.grpc_server is not None and server.still_served() and not fresh_kubelet:
                continue
            server.stop()
            try:
                server.serve()
                server.register(self.kubelet_socket)
            except Exception as e:  # noqa: BLE001
                # The kubelet refused, went away, or is wiping its directory as it starts (our new
                # socket with it): serve and register again on the next round, or the next event.
                server.stop()
                details = e.details() if hasattr(e, "details") else str(e)
                self._problem(f"registering {name} with the kubelet failed: {details}")
                return
            say(f"{name}: registered with the kubelet ({_count(server.resource.devices)}, socket {server.path})")
        self.registered_with = kubelet
        self._problem(None)

    def round(self) -> None:
        from oci_gpu_hook.start import inventory_cache

        if self.health:
            # Registration first: after a kubelet restart every millisecond counts (DirectoryWatch).
            self.ensure_registered()
        if inventory_cache.fingerprint(self.settings) != self.fingerprint:
            say("the driver or the GPUs changed: reading the inventory again")
            try:
                self.load()
                self.sync_servers()
            except HookError as e:
                # The previous inventory stays in service, its health checked below (a GPU
                # whose node went is Unhealthy); the next round reads again.
                self._problem(f"the inventory cannot be read again: {e.message}")
        if self.mps.lost() or any(r.mps_root and r.name not in self.mps.running for r in self.resources):
            self.sync_servers()  # an MPS daemon that died, or did not start: again
        self.read_gate()
        self.check_health()
        self.ensure_registered()

    def stop(self) -> None:
        if self.xid_watch is not None:
            self.xid_watch.stop()
        for server in self.servers.values():
            server.stop()
        self.mps.stop_all()


def run(settings, config, socket_dir: str, interval: float, where: str, gate: str | None = None) -> int:
    """Serve until SIGTERM or SIGINT. The configuration and the inventory are checked first.
    where: what the configuration came from, for messages; gate: the gates' file to follow."""
    from oci_gpu_hook.node.nvml_reader import RESTART, DriverChanged
    from oci_gpu_hook.node.plugin.directory_watch import DirectoryWatch

    api.modules()  # a missing grpcio says so before anything else
    if not os.path.isdir(socket_dir):
        raise PrerequisiteError(f"{socket_dir}: no such directory: is the kubelet installed here? "
                                "(--socket-dir sets it)")  # fmt: skip
    plugin = DevicePlugin(settings, config, socket_dir, where, gate)
    plugin.load()
    plugin.sync_servers()
    stopping = threading.Event()

    def stop(signum, frame):
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    watch = DirectoryWatch(socket_dir)
    say(f"offering {', '.join(f'{r.name} ({_count(r.devices)})' for r in plugin.resources)}")
    try:
        while not stopping.is_set():
            try:
                plugin.round()
            except HookError as e:
                plugin._problem(e.message)
            except DriverChanged as e:
                say(str(e))
                return RESTART
            watch.wait(interval, stopping)
    finally:
        watch.close()
        plugin.stop()
        say("stopped")
    return 0
