"""The simulated GPU host: a directory that looks to our code, to ldconfig and to NVML's
official bindings like a machine with NVIDIA GPUs. model.py decides it, build.py writes it."""

from __future__ import annotations

import os
from collections.abc import Sequence

from oci_gpu_hook.toolkit.simulate.build import build_host, remove_host, used_char_majors
from oci_gpu_hook.toolkit.simulate.model import describe_host


def simulate(
    target: str,
    gpus: int = 2,
    driver_version: str = "550.54.15",
    cuda_version: str = "12.4",
    mig: Sequence[int] = (),
    model: str = "a100",
    scramble_minors: bool = False,
) -> dict:
    host = describe_host(
        os.path.abspath(target),
        gpus=gpus,
        driver_version=driver_version,
        cuda_version=cuda_version,
        mig=mig,
        model=model,
        scramble_minors=scramble_minors,
        used_majors=used_char_majors(),
    )
    return build_host(host)


__all__ = ["simulate", "remove_host", "describe_host"]
