"""The node services: long-running daemons on a GPU node (Prometheus exporter, NFD labels, GPU
memory watchdog, Kubernetes device plugin). They share one NVML reader and one store of the
hook's per-container records, and may import heavy libraries. Nothing here is on the start path,
and the start path never imports from here.
"""


def say(service: str, message: str) -> None:
    """One line on stderr (the journal's), as every node service writes its news. Printable only:
    ids and names in it may come from the kubelet or from images. A line that cannot be written is
    lost, and the service goes on: in a pod stderr is a pipe the runtime's monitor reads (conmon,
    the shim), and with that reader gone every line failed with EPIPE, the device plugin's
    Allocate with it (a pod refused at admission)."""
    import sys

    from oci_gpu_hook.errors import printable

    try:
        sys.stderr.write(f"oci-gpu-hook {service}: {printable(message)}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # ValueError: stderr closed
        pass


_unwritable: set = set()  # heartbeat files already said to be unwritable


def beat(service: str, path: str | None) -> None:
    """The service's loop went round: path's modification time is now. A liveness probe reads it
    (deploy/kubernetes/30-daemonset.yaml): a loop stuck in NVML stops beating, while its process
    still runs and the kubelet would see nothing wrong. A file that cannot be written is said
    once; the service goes on, and the probe that reads it restarts the container."""
    import os

    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        try:
            os.utime(fd)
        finally:
            os.close(fd)
        _unwritable.discard(path)
    except OSError as e:
        if path not in _unwritable:
            say(service, f"cannot write the heartbeat {path}: {e.strerror or e}")
        _unwritable.add(path)
