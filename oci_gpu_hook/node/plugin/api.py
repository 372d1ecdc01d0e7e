"""The kubelet's device plugin API (v1beta1): its generated modules and grpc, loaded here, where
the plugin starts, so that the rest of the toolkit (and the hook) never load them; and the
options the plugin registers with."""

from __future__ import annotations

from oci_gpu_hook.errors import PrerequisiteError

API_VERSION = "v1beta1"


def modules():
    """(grpc, deviceplugin_pb2, deviceplugin_pb2_grpc); PrerequisiteError where they are not installed."""
    try:
        import grpc

        from oci_gpu_hook.node.kubelet_api import deviceplugin_pb2, deviceplugin_pb2_grpc
    except ImportError as e:
        raise PrerequisiteError(f"the device plugin needs grpcio and protobuf ({e}); install "
                                "oci-gpu-hook[kubernetes]") from None  # fmt: skip
    return grpc, deviceplugin_pb2, deviceplugin_pb2_grpc


def options(pb2):
    """What the plugin tells the kubelet it offers: preferred allocations, no PreStartContainer."""
    return pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)
