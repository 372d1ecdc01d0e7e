"""`oci-gpu-hook device-plugin`: the kubelet device plugin API (v1beta1, gRPC) for the resources
plugin_devices.py computes, with the answers plugin_allocation.py gives.

One gRPC server per resource, each on its own socket in the kubelet's device-plugins directory,
each registered with the kubelet under its resource name (the API allows one resource per
registration). A supervisor loop, every interval:
- notices a kubelet restart (the kubelet wipes the directory, our sockets with it, and makes a
  new kubelet.sock), then serves again and registers again;
- checks each device's health: its device nodes (present, character devices, the right numbers)
  and NVML (a device NVML does not list, or NVML failing, is Unhealthy); a change is sent to the
  kubelet through ListAndWatch at once;
- beside it, a thread waits on NVML events (plugin_health.py): a critical XID makes its GPU or MIG
  device Unhealthy at once, until that GPU goes and comes back (a reset, a driver reload);
- notices a driver change (the inventory fingerprint the hook's cache uses) and re-reads the
  inventory; resources that appear or go away are registered or stopped.
The configuration is checked before anything is served: a mistake stops the start with one line.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from oci_gpu_hook.errors import HookError, NvmlError, PrerequisiteError
from oci_gpu_hook.node import plugin_allocation, plugin_devices, plugin_health, plugin_topology
from oci_gpu_hook.node import say as node_say

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
SOCKET_PREFIX = "oci-gpu-hook-"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"


def _identity(path: str):
    """Which file is at path now (None: none). The change time too: a socket made again at once
    may get the inode number the old one had."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def _count(devices) -> str:
    return f"{len(devices)} device" + ("" if len(devices) == 1 else "s")


def say(message: str) -> None:
    node_say("device-plugin", message)


def socket_name(resource_name: str) -> str:
    """oci-gpu-hook-nvidia.com_mig-1g.5gb.sock: one per resource, ours by the prefix."""
    return SOCKET_PREFIX + resource_name.replace("/", "_") + ".sock"


def _api():
    """The generated API modules and grpc: imported here, where the plugin starts, so that the
    rest of the toolkit (and the hook) never load them."""
    try:
        import grpc

        from oci_gpu_hook.node.kubelet_api import deviceplugin_pb2, deviceplugin_pb2_grpc
    except ImportError as e:
        raise PrerequisiteError(f"the device plugin needs grpcio and protobuf ({e}); install "
                                "oci-gpu-hook[kubernetes]") from None  # fmt: skip
    return grpc, deviceplugin_pb2, deviceplugin_pb2_grpc


def _options(pb2):
    """What the plugin tells the kubelet it offers: preferred allocations, no PreStartContainer."""
    return pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


def device_health(inventory, reader, gone: set | None = None) -> dict:
    """{unit uuid: None when healthy, else why not} for every GPU and MIG device. gone, if given,
    gets the GPUs that are not there themselves (their node, or NVML does not list them), as
    opposed to NVML failing as a whole."""
    from oci_gpu_hook.start.discover import check_node
    from oci_gpu_hook.start.inventory import device_key

    def node_problem(node):
        checked = check_node(inventory.dev_root, node.path, node.major, node.minor)
        return f"{node.path}: {checked.problem}" if checked.problem else None

    try:
        listed = {sample.device.uuid for sample in reader.read()}
        nvml_problem = None
    except NvmlError as e:
        listed, nvml_problem = set(), e.message
    health = {}
    for gpu in inventory.gpus:
        gpu_problem = node_problem(gpu.node)
        if gpu_problem is None and nvml_problem is None and gpu.uuid not in listed:
            gpu_problem = "NVML does not list it"
        if gpu_problem is not None and gone is not None:
            gone.add(gpu.uuid)
        gpu_problem = gpu_problem or nvml_problem
        health[gpu.uuid] = gpu_problem
        for mig in gpu.mig:
            uuid = device_key(gpu, mig)
            problem = gpu_problem or node_problem(mig.gi_cap) or node_problem(mig.ci_cap)
            if problem is None and mig.uuid and mig.uuid not in listed:
                problem = "NVML does not list it"
            health[uuid] = problem
    return health


class DirectoryWatch:
    """inotify on the kubelet's directory: a restarted kubelet wipes our sockets and makes a new
    kubelet.sock, and it re-admits running pods within a fraction of a second, against the devices
    registered by then. Waking on those events, rather than on the next interval, registers the
    plugin again before that. Without inotify (or on error) wait() just sleeps: the interval
    still catches every change."""

    _EVENTS = 0x100 | 0x200 | 0x80 | 0x40  # IN_CREATE | IN_DELETE | IN_MOVED_TO | IN_MOVED_FROM

    def __init__(self, directory: str):
        self.fd = -1
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(directory), self._EVENTS) >= 0:
                self.fd = fd
            elif fd >= 0:
                os.close(fd)
        except (OSError, AttributeError):
            pass

    def wait(self, timeout: float, stopping) -> None:
        """Until an event in the directory, stopping is set, or timeout."""
        if self.fd < 0:
            stopping.wait(timeout)
            return
        import select

        deadline = time.monotonic() + timeout
        # Short slices so that a stop request is seen promptly even without an event.
        while not stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.25))
            if ready:
                try:
                    while os.read(self.fd, 65536):
                        pass
                except BlockingIOError:
                    pass
                return

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ResourceServer:
    """One resource's gRPC server on its socket, and the device list ListAndWatch streams."""

    def __init__(self, plugin, resource):
        self.plugin, self.resource = plugin, resource
        self.path = os.path.join(plugin.socket_dir, socket_name(resource.name))
        self.changed = threading.Condition()
        self.generation = 0
        self.server = None
        self.identity = None  # _identity() of our socket: gone or replaced means serve again

    def devices(self, pb2) -> list:
        health, numa = self.plugin.health, self.plugin.topology.numa
        return [pb2.Device(ID=d.id, health=HEALTHY if health.get(d.unit.uuid, UNHEALTHY) is None else UNHEALTHY,
                           topology=_numa_info(pb2, numa.get(d.unit.gpu.uuid)))
                for d in self.resource.devices]  # fmt: skip

    def update(self, resource=None) -> None:
        """Tell the kubelet (through every open ListAndWatch) that the list or its health changed."""
        with self.changed:
            if resource is not None:
                self.resource = resource
            self.generation += 1
            self.changed.notify_all()

    def serve(self) -> None:
        grpc, _, pb2_grpc = _api()
        from concurrent import futures

        try:
            os.unlink(self.path)  # ours from an earlier run (the name is ours alone)
        except FileNotFoundError:
            pass
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="device-plugin"))
        pb2_grpc.add_DevicePluginServicer_to_server(_Servicer(self), self.server)
        # The socket answers Allocate, which says which device nodes a container gets: the kubelet
        # (root) alone may connect. gRPC makes it with the process's umask, whatever the service
        # was started with: 077 while it binds, so that it is never open to others, not even
        # for a moment.
        previous = os.umask(0o077)
        try:
            bound = self.server.add_insecure_port("unix://" + self.path)
        finally:
            os.umask(previous)
        if bound == 0:
            raise PrerequisiteError(f"{self.path}: cannot serve the device plugin socket there")
        self.server.start()
        self.identity = _identity(self.path)

    def still_served(self) -> bool:
        return self.identity is not None and _identity(self.path) == self.identity

    def register(self, kubelet_socket: str) -> None:
        grpc, pb2, pb2_grpc = _api()
        request = pb2.RegisterRequest(
            version=API_VERSION, endpoint=os.path.basename(self.path), resource_name=self.resource.name,
            options=_options(pb2),
        )  # fmt: skip
        with grpc.insecure_channel("unix://" + kubelet_socket) as channel:
            pb2_grpc.RegistrationStub(channel).Register(request, timeout=10)

    def stop(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            self.update()  # wake ListAndWatch streams so that they end
            # At once (a kubelet restart: the new server must be up within milliseconds), and
            # waited for: gRPC unlinks the socket path as the listener closes, which must not
            # happen to the next server's socket at that path.
            server.stop(grace=None).wait(5)
        if self.identity is not None and self.still_served():
            os.unlink(self.path)
        self.identity = None


def _numa_info(pb2, node):
    """The NUMA node of a device as ListAndWatch gives it (a MIG device or replica: its GPU's), for
    the kubelet's topology manager; none where sysfs names none, as NVIDIA's plugin does."""
    return None if node is None else pb2.TopologyInfo(nodes=[pb2.NUMANode(ID=node)])


class _Servicer:
    """The DevicePlugin service's calls for one ResourceServer."""

    def __init__(self, owner: ResourceServer):
        self.owner = owner

    def GetDevicePluginOptions(self, request, context):
        _, pb2, _ = _api()
        return _options(pb2)

    def ListAndWatch(self, request, context):
        _, pb2, _ = _api()
        owner = self.owner
        while context.is_active() and owner.server is not None:
            with owner.changed:
                seen = owner.generation
                devices = owner.devices(pb2)
            yield pb2.ListAndWatchResponse(devices=devices)
            with owner.changed:
                # Woken by a change; the timeout only notices a kubelet that went away.
                while owner.generation == seen and context.is_active() and owner.server is not None:
                    owner.changed.wait(1.0)

    def GetPreferredAllocation(self, request, context):
        _, pb2, _ = _api()
        resource, topology = self.owner.resource, self.owner.plugin.topology
        policy = self.owner.plugin.config.allocation_policy
        answers = [pb2.ContainerPreferredAllocationResponse(deviceIDs=plugin_allocation.preferred(
            resource, list(r.available_deviceIDs), list(r.must_include_deviceIDs), r.allocation_size, topology,
            policy)) for r in request.container_requests]  # fmt: skip
        return pb2.PreferredAllocationResponse(container_responses=answers)

    def Allocate(self, request, context):
        grpc, pb2, _ = _api()
        plugin, resource = self.owner.plugin, self.owner.resource
        answers = []
        for container in request.container_requests:
            ids = list(container.devices_ids)
            try:
                allocation = plugin_allocation.allocate(resource, ids, plugin.config, plugin.inventory,
                                                        plugin.settings.cdi_kind)  # fmt: skip
            except plugin_allocation.AllocationError as e:
                say(f"Allocate refused: {e}")
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            say(f"Allocate {resource.name}: {', '.join(ids)}")
            answers.append(pb2.ContainerAllocateResponse(
                envs=allocation.envs, annotations=allocation.annotations,
                mounts=[pb2.Mount(container_path=c, host_path=h, read_only=r) for c, h, r in allocation.mounts],
                devices=[pb2.DeviceSpec(container_path=c, host_path=h, permissions=p)
                         for c, h, p in allocation.devices],
                cdi_devices=[pb2.CDIDevice(name=n) for n in allocation.cdi_devices],
            ))  # fmt: skip
        return pb2.AllocateResponse(container_responses=answers)

    def PreStartContainer(self, request, context):
        _, pb2, _ = _api()
        return pb2.PreStartContainerResponse()


# --- XID health (plugin_health.py's thread reports; the marks live here) ----------------------------


class _XidHealth:
    """DevicePlugin's XID health: the watch thread, and the marks it leaves on devices."""

    def _init_xid_health(self) -> None:
        self.topology = plugin_topology.EMPTY
        self.xids = plugin_health.policy(self.config, os.environ)
        self.xid_watch = None
        self.xid_marks: dict = {}  # unit uuid -> "XID n", until its GPU is seen gone
        self._health_lock = threading.RLock()  # check_health runs in the loop and on an XID

    def _start_xid_watch(self) -> None:
        """(Re)start the thread for the inventory's GPUs and NVML library; none when XID health is off."""
        if self.xid_watch is not None:
            self.xid_watch.stop()
            self.xid_watch = None
        if self.xids.off or self.reader.path is None or not self.inventory.gpus:
            return
        self.xid_watch = plugin_health.XidWatch(self.reader.path, [g.uuid for g in self.inventory.gpus], self.xids,
                                                self._on_xid, say).start()  # fmt: skip

    def _on_xid(self, event) -> None:
        """A critical XID (from the watch thread): its devices Unhealthy now, not at the next round."""
        with self._health_lock:
            gpu = next((g for g in self.inventory.gpus if g.uuid == event.gpu_uuid), None)
            if gpu is None:
                say(f"XID {event.xid} on {plugin_health.describe(event)}, a GPU this plugin does not offer: ignored")
                return
            from oci_gpu_hook.start.inventory import device_key

            why = f"XID {event.xid} (a critical XID: health.criticalXids)"
            if event.gi is None:
                keys = [gpu.uuid] + [device_key(gpu, m) for m in gpu.mig]
            else:  # a MIG device's instances: that MIG device alone, as NVIDIA's plugin does
                keys = [device_key(gpu, m) for m in gpu.mig if (m.gi, m.ci) == (event.gi, event.ci)]
                if not gpu.mig:
                    keys = [gpu.uuid]
            for key in keys:
                self.xid_marks.setdefault(key, why)
            self._check_health()

    def _forget_xids_not_in(self, inventory) -> None:
        """A re-read inventory: the marks of devices it no longer has go (their GPU went)."""
        from oci_gpu_hook.start.inventory import device_key

        kept = {k for g in inventory.gpus for k in [g.uuid] + [device_key(g, m) for m in g.mig]}
        for key in [k for k in self.xid_marks if k not in kept]:
            del self.xid_marks[key]
            say(f"{key}: no longer on this node; an XID it had no longer counts")

    def _apply_xids(self, health: dict, gone: set) -> None:
        """The XID marks onto health. A GPU seen gone (its node, or NVML no longer lists it) loses its
        marks and those of its MIG devices: when it is back, it is a GPU that came back (reset, driver
        reloaded), and it is as healthy as its nodes and NVML say."""
        from oci_gpu_hook.start.inventory import device_key

        for gpu in self.inventory.gpus:
            if gpu.uuid in gone:
                for key in [gpu.uuid] + [device_key(gpu, m) for m in gpu.mig]:
                    if self.xid_marks.pop(key, None) is not None:
                        say(f"{key}: its GPU is gone; the XID no longer counts once it is back")
        for key, why in self.xid_marks.items():
            if key in health and health[key] is None:
                health[key] = why


class DevicePlugin(_XidHealth):
    def __init__(self, settings, config, socket_dir: str, where: str = "device plugin configuration"):
        self.settings, self.config, self.socket_dir, self.where = settings, config, socket_dir, where
        self.kubelet_socket = os.path.join(socket_dir, KUBELET_SOCKET)
        self.reader = None
        self.inventory = None
        self.fingerprint = None
        self.health: dict = {}
        self.servers: dict = {}  # resource name -> ResourceServer
        self.registered_with = None  # _identity() of the kubelet.sock we registered with
        self._last_problem = None
        self._init_xid_health()
        from oci_gpu_hook.node import mps

        self.mps = mps.Daemons(say)  # the MPS daemons of the resources shared through MPS

    def load(self) -> None:
        """The inventory and the resources it gives; ConfigError when the configuration does not fit."""
        from oci_gpu_hook.node.nvml_reader import NvmlReader, check_library
        from oci_gpu_hook.start import inventory_cache

        # Everything is computed before anything is replaced: a read that fails leaves the
        # previous inventory in service, and the next round tries again.
        fingerprint = inventory_cache.fingerprint(self.settings)
        inventory = inventory_cache.load(self.settings)
        resources = plugin_devices.resources(inventory, self.config, self.where)
        plugin_allocation.imex_nodes(self.config, inventory, self.where)  # a required channel missing stops it
        reader = NvmlReader(inventory)  # bound to the library this inventory found
        if self.reader is not None:
            check_library(self.reader, reader)  # another driver's NVML: the process starts again
            self.reader.close()
        with self._health_lock:
            self.reader = reader
            self.fingerprint, self.inventory, self.resources = fingerprint, inventory, resources
            self.topology = plugin_topology.read(inventory, reader, self.settings.node.sys_root)
            self._forget_xids_not_in(inventory)
        self._start_xid_watch()

    def _kubelet_identity(self):
        return _identity(self.kubelet_socket)

    def _problem(self, message: str | None) -> None:
        """Say a problem once, until it clears."""
        if message and message != self._last_problem:
            say(message)
        self._last_problem = message

    def check_health(self) -> None:
        with self._health_lock:
            self._check_health()

    def _check_health(self) -> None:
        gone: set = set()
        health = device_health(self.inventory, self.reader, gone)
        self._apply_xids(health, gone)
        if health == self.health:
            return
        # One line per cause (a failing NVML makes every device Unhealthy at once), and the
        # devices that became healthy again; devices healthy from the start are not listed.
        causes: dict = {}
        for uuid, problem in sorted(health.items()):
            if problem is not None and self.health.get(uuid) != problem:
                causes.setdefault(problem, []).append(uuid)
        for problem, uuids in causes.items():
            say(f"Unhealthy: {', '.join(uuids)}: {problem}")
        recovered = [u for u, p in sorted(health.items()) if p is None and self.health.get(u) is not None]
        if recovered:
            say(f"Healthy again: {', '.join(recovered)}")
        self.health = health
        for server in self.servers.values():
            server.update()

    def sync_servers(self) -> None:
        """Servers for exactly the current resources; new device lists reach the kubelet. The MPS
        daemons first: a resource shared through MPS is offered once its daemon has its defaults.
        A daemon that cannot start stops the plugin's start; later (a new inventory), its resource
        is held back, and each round tries again (round)."""
        from oci_gpu_hook.node import mps

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
        kubelet = self._kubelet_identity()
        if kubelet is None:
            self._problem(f"waiting for the kubelet: {self.kubelet_socket} is not there")
            return
        fresh_kubelet = kubelet != self.registered_with
        for name, server in self.servers.items():
            if server.server is not None and server.still_served() and not fresh_kubelet:
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
        self.check_health()
        self.ensure_registered()

    def stop(self) -> None:
        if self.xid_watch is not None:
            self.xid_watch.stop()
        for server in self.servers.values():
            server.stop()
        self.mps.stop_all()


def run(settings, config, socket_dir: str, interval: float, where: str) -> int:
    """Serve until SIGTERM or SIGINT. The configuration and the inventory are checked first.
    where: what the configuration came from, for messages."""
    from oci_gpu_hook.node.nvml_reader import RESTART, DriverChanged

    _api()  # a missing grpcio says so before anything else
    if not os.path.isdir(socket_dir):
        raise PrerequisiteError(f"{socket_dir}: no such directory: is the kubelet installed here? "
                                "(--socket-dir sets it)")  # fmt: skip
    plugin = DevicePlugin(settings, config, socket_dir, where)
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
