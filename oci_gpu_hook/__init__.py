"""oci-gpu-hook: give OCI containers NVIDIA GPUs, with a host toolkit around the hook.

Data flow (one module per step): state -> spec -> request -> inventory -> plan -> apply -> report.
`hook.py` is the entry point every container start goes through; it imports only the standard
library. `cli/` holds the commands for people and loads heavier libraries lazily.
"""

__version__ = "0.1.0"
