"""The node services: long-running daemons on a GPU node (Prometheus exporter, NFD labels, GPU
memory watchdog, Kubernetes device plugin). They share one NVML reader and one store of the
hook's per-container records, and may import heavy libraries. Nothing here is on the start path,
and the start path never imports from here.
"""


def say(service: str, message: str) -> None:
    """One line on stderr (the journal's), as every node service writes its news. Printable only:
    ids and names in it may come from the kubelet or from images."""
    import sys

    from oci_gpu_hook.errors import printable

    sys.stderr.write(f"oci-gpu-hook {service}: {printable(message)}\n")
    sys.stderr.flush()
