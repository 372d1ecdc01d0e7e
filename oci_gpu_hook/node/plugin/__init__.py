"""`oci-gpu-hook device-plugin`: the kubelet device plugin, one file per step of what it does.

From the configuration to the kubelet:
- config.py: the plugin's configuration file (NVIDIA's `version: v1` format), checked in full;
- resources.py: what the node offers under it: the Kubernetes resources and their device ids
  (the labels describe the same resources: node/features.py);
- supervisor.py: the loop: reads the inventory, keeps a server per resource, registers them
  with the kubelet (again after a kubelet restart: directory_watch.py), checks health, and reads
  the inventory again when the driver changes;
- server.py: one resource's gRPC server on its socket, and its registration;
- service.py: the calls the kubelet makes on it (ListAndWatch, GetPreferredAllocation,
  Allocate), answered by
- allocation.py: which ids to prefer (topology.py: how the GPUs are joined) and what the
  runtime is told for the ids given; mps.py: the MPS daemons of a resource shared through MPS,
  and what their clients are told;
- health.py: each device's health (its device nodes, NVML, and the XID marks that
  xid_watch.py's thread reports).
api.py loads the generated API modules (kubelet_api/), only where the plugin runs.
"""


def say(message: str) -> None:
    """One line in the plugin's log."""
    from oci_gpu_hook.node import say as node_say

    node_say("device-plugin", message)
