"""The simulated GPU host: a directory that looks to our code, to ldconfig and to NVML's
official bindings like a machine with NVIDIA GPUs. model.py decides it, build.py writes it."""

from __future__ import annotations

import os

from oci_gpu_hook.toolkit.simulate.build import build_host, remove_host, used_char_majors
from oci_gpu_hook.toolkit.simulate.model import describe_host


def simulate(target: str, **options) -> dict:
    """Build a simulated host at target; options (gpus, driver_version, cuda_version, mig, model,
    scramble_minors) and their defaults are describe_host's. Returns the host's summary."""
    return build_host(describe_host(os.path.abspath(target), used_majors=used_char_majors(), **options))


__all__ = ["simulate", "remove_host", "describe_host"]
