"""One resource's gRPC server: its socket in the kubelet's device-plugins directory (one per
resource, ours by its name's prefix), its registration with the kubelet under the resource's
name (the API allows one resource per registration), and the change notices ListAndWatch waits
on. What it answers is service.py's."""

from __future__ import annotations

import os
import threading

from oci_gpu_hook.errors import PrerequisiteError
from oci_gpu_hook.node.plugin import api
from oci_gpu_hook.node.plugin.service import DevicePluginService

KUBELET_SOCKET = "kubelet.sock"
SOCKET_PREFIX = "oci-gpu-hook-"


def socket_name(resource_name: str) -> str:
    """oci-gpu-hook-nvidia.com_mig-1g.5gb.sock: one per resource, ours by the prefix."""
    return SOCKET_PREFIX + resource_name.replace("/", "_") + ".sock"


def file_identity(path: str):
    """Which file is at path now (None: none). The change time too: a socket made again at once
    may get the inode number the old one had."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class ResourceServer:
    """One resource's gRPC server on its socket, and the device list ListAndWatch streams."""

    def __init__(self, plugin, resource):
        self.plugin, self.resource = plugin, resource
        self.path = os.path.join(plugin.socket_dir, socket_name(resource.name))
        self.changed = threading.Condition()
        self.generation = 0
        self.grpc_server = None
        self.identity = None  # file_identity() of our socket: gone or replaced means serve again

    def update(self, resource=None) -> None:
        """Tell the kubelet (through every open ListAndWatch) that the list or its health changed."""
        with self.changed:
            if resource is not None:
                self.resource = resource
            self.generation += 1
            self.changed.notify_all()

    def serve(self) -> None:
        grpc, _, pb2_grpc = api.modules()
        from concurrent import futures

        try:
            os.unlink(self.path)  # ours from an earlier run (the name is ours alone)
        except FileNotFoundError:
            pass
        self.grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="device-plugin"))
        pb2_grpc.add_DevicePluginServicer_to_server(DevicePluginService(self), self.grpc_server)
        # The socket answers Allocate, which says which device nodes a container gets: the kubelet
        # (root) alone may connect. gRPC makes it with the process's umask, whatever the service
        # was started with: 077 while it binds, so that it is never open to others, not even
        # for a moment.
        previous = os.umask(0o077)
        try:
            bound = self.grpc_server.add_insecure_port("unix://" + self.path)
        finally:
            os.umask(previous)
        if bound == 0:
            raise PrerequisiteError(f"{self.path}: cannot serve the device plugin socket there")
        self.grpc_server.start()
        self.identity = file_identity(self.path)

    def still_served(self) -> bool:
        return self.identity is not None and file_identity(self.path) == self.identity

    def register(self, kubelet_socket: str) -> None:
        grpc, pb2, pb2_grpc = api.modules()
        request = pb2.RegisterRequest(
            version=api.API_VERSION, endpoint=os.path.basename(self.path), resource_name=self.resource.name,
            options=api.options(pb2),
        )  # fmt: skip
        with grpc.insecure_channel("unix://" + kubelet_socket) as channel:
            pb2_grpc.RegistrationStub(channel).Register(request, timeout=10)

    def stop(self) -> None:
        if self.grpc_server is not None:
            grpc_server, self.grpc_server = self.grpc_server, None
            self.update()  # wake ListAndWatch streams so that they end
            # At once (a kubelet restart: the new server must be up within milliseconds), and
            # waited for: gRPC unlinks the socket path as the listener closes, which must not
            # happen to the next server's socket at that path.
            grpc_server.stop(grace=None).wait(5)
        if self.identity is not None and self.still_served():
            os.unlink(self.path)
        self.identity = None
