"""The calls the kubelet makes on one resource's socket (the DevicePlugin service of the API):
ListAndWatch streams the resource's devices with their health and NUMA node, and every change;
GetPreferredAllocation and Allocate are answered by allocation.py. The server it serves on is
server.py's."""

from __future__ import annotations

from oci_gpu_hook.node.plugin import allocation, api, say

HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"


def device_list(server, pb2) -> list:
    """ListAndWatch's devices of the server's resource: health as the supervisor last checked it
    (a device it has no word on is Unhealthy), and the NUMA node of its GPU."""
    health, numa = server.plugin.health, server.plugin.topology.numa
    return [pb2.Device(ID=d.id, health=HEALTHY if health.get(d.unit.uuid, UNHEALTHY) is None else UNHEALTHY,
                       topology=_numa_info(pb2, numa.get(d.unit.gpu.uuid)))
            for d in server.resource.devices]  # fmt: skip


def _numa_info(pb2, node):
    """The NUMA node of a device as ListAndWatch gives it (a MIG device or replica: its GPU's), for
    the kubelet's topology manager; none where sysfs names none, as NVIDIA's plugin does."""
    return None if node is None else pb2.TopologyInfo(nodes=[pb2.NUMANode(ID=node)])


class DevicePluginService:
    """The service's calls for one server.ResourceServer (its resource, its change notices)."""

    def __init__(self, server):
        self.server = server

    def GetDevicePluginOptions(self, request, context):
        _, pb2, _ = api.modules()
        return api.options(pb2)

    def ListAndWatch(self, request, context):
        _, pb2, _ = api.modules()
        server = self.server
        while context.is_active() and server.grpc_server is not None:
            with server.changed:
                seen = server.generation
                devices = device_list(server, pb2)
            yield pb2.ListAndWatchResponse(devices=devices)
            with server.changed:
                # Woken by a change; the timeout only notices a kubelet that went away.
                while server.generation == seen and context.is_active() and server.grpc_server is not None:
                    server.changed.wait(1.0)

    def GetPreferredAllocation(self, request, context):
        _, pb2, _ = api.modules()
        resource, topology = self.server.resource, self.server.plugin.topology
        policy = self.server.plugin.config.allocation_policy
        answers = [pb2.ContainerPreferredAllocationResponse(deviceIDs=allocation.preferred(
            resource, list(r.available_deviceIDs), list(r.must_include_deviceIDs), r.allocation_size, topology,
            policy)) for r in request.container_requests]  # fmt: skip
        return pb2.PreferredAllocationResponse(container_responses=answers)

    def Allocate(self, request, context):
        grpc, pb2, _ = api.modules()
        plugin, resource = self.server.plugin, self.server.resource
        answers = []
        for container in request.container_requests:
            ids = list(container.devices_ids)
            try:
                given = allocation.allocate(resource, ids, plugin.config, plugin.inventory, plugin.settings.cdi_kind)
            except allocation.AllocationError as e:
                say(f"Allocate refused: {e}")
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            say(f"Allocate {resource.name}: {', '.join(ids)}")
            answers.append(pb2.ContainerAllocateResponse(
                envs=given.envs, annotations=given.annotations,
                mounts=[pb2.Mount(container_path=c, host_path=h, read_only=r) for c, h, r in given.mounts],
                devices=[pb2.DeviceSpec(container_path=c, host_path=h, permissions=p) for c, h, p in given.devices],
                cdi_devices=[pb2.CDIDevice(name=n) for n in given.cdi_devices],
            ))  # fmt: skip
        return pb2.AllocateResponse(container_responses=answers)

    def PreStartContainer(self, request, context):
        _, pb2, _ = api.modules()
        return pb2.PreStartContainerResponse()
