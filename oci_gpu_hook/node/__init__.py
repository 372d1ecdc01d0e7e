"""The node services: long-running daemons on a GPU node (Prometheus exporter, NFD labels, GPU
memory watchdog, Kubernetes device plugin). They share one NVML reader and one store of the
hook's per-container records, and may import heavy libraries. Nothing here is on the start path,
and the start path never imports from here.
"""
