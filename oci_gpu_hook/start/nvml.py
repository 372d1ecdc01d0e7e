"""Facts only NVML knows (CUDA version, brand, compute capability, memory, MIG UUIDs), asked of
the driver root's libnvidia-ml through NVIDIA's official bindings (nvidia-ml-py).

The query runs in a child process with a deadline: NVML initialisation can take seconds or hang
on hosts without persistence mode, and a process can bind only one libnvidia-ml (by SONAME), so
a toolkit command looking at two driver roots needs two processes. The hook's start path uses it
only when the inventory cache is stale (after a driver change), and then only for what is left of
the hook's time budget (inventory_cache.load); otherwise the cache carries these facts.
"""

from __future__ import annotations  # `str | None` below: Python 3.9 would evaluate it and fail

import json
import os
import subprocess
import sys

import oci_gpu_hook
from oci_gpu_hook.errors import NvmlError

DEFAULT_TIMEOUT = 20.0


class NvmlTimeout(NvmlError):
    """NVML did not answer in time: a hung driver. Unlike an answer that is an error, this stops
    the start (the GPUs may be unusable), and nothing is cached."""


def advice(message: str) -> str:
    """What to do about NVML's failure, from its own words (nvmlErrorString)."""
    lowered = message.lower()
    if "mismatch" in lowered:
        return ("the loaded kernel module and the driver's libraries differ (a driver upgraded without a "
                "reboot): reboot, or unload and reload the nvidia modules")  # fmt: skip
    if "not loaded" in lowered:
        return "the NVIDIA kernel module is not loaded: load it (modprobe nvidia, or nvidia-modprobe)"
    if "insufficient permissions" in lowered or "no permission" in lowered:
        return "NVML cannot open the device nodes: run as root"
    return "check the driver's installation (nvidia-smi says more)"


def query(library_path: str, timeout: float = DEFAULT_TIMEOUT) -> dict:
    """{'cuda_version': '12.4', 'gpus': {uuid: {...}}} from the NVML library at library_path."""
    # -I keeps the caller's environment out; the package (and pynvml beside it) is imported from
    # where this process found it, which -I alone would not search for a non-system install.
    parent = os.path.dirname(os.path.dirname(os.path.abspath(oci_gpu_hook.__file__)))
    code = (
        f"import sys; sys.path.insert(0, {parent!r}); "
        "from oci_gpu_hook.start.nvml import _main; sys.exit(_main(sys.argv[1:]))"
    )
    try:
        result = subprocess.run(
            [sys.executable, "-I", "-c", code, library_path],
            capture_output=True,
            timeout=timeout,
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
            cwd="/",
        )
    except subprocess.TimeoutExpired:
        raise NvmlTimeout(f"NVML ({library_path}) did not answer within {timeout:.1f} s") from None
    if result.returncode != 0:
        message = result.stderr.decode("utf-8", "replace").strip().splitlines()
        raise NvmlError(f"NVML ({library_path}): {message[-1] if message else 'failed'}")
    return json.loads(result.stdout)


def text(value) -> str:
    """NVML's strings: bytes from older bindings, str from newer."""
    return value.decode() if isinstance(value, bytes) else value


def library(files, driver_root: str) -> str | None:
    """The host path of the driver's libnvidia-ml.so.1 among its files (inventory.DriverFile):
    the library NVML is loaded from, by discovery and by the node services alike."""
    from oci_gpu_hook.start.inventory import host_path

    for f in files:
        if f.kind == "library" and f.soname == "libnvidia-ml.so.1":
            return host_path(driver_root, f.path)
    return None


def bind(library_path: str):
    """pynvml, bound to the NVML library at library_path (once per process: see above). Loading
    it by full path first makes pynvml's dlopen("libnvidia-ml.so.1") find this library (glibc
    matches the SONAME already loaded), so no LD_LIBRARY_PATH reaches any process."""
    import ctypes

    ctypes.CDLL(library_path, mode=ctypes.RTLD_GLOBAL)
    import pynvml

    return pynvml


def mig_attributes(pynvml, mig) -> dict | None:
    """A MIG device's engines and SMs under GFD's label names (nvidia.com/mig-<profile>.<name>);
    None where the library has no such call."""
    try:
        a = pynvml.nvmlDeviceGetAttributes(mig)
    except pynvml.NVMLError:
        return None
    return {
        "multiprocessors": a.multiprocessorCount,
        "engines.copy": a.sharedCopyEngineCount,
        "engines.decoder": a.sharedDecoderCount,
        "engines.encoder": a.sharedEncoderCount,
        "engines.jpeg": a.sharedJpegCount,
        "engines.ofa": a.sharedOfaCount,
    }


def _collect(library_path: str) -> dict:
    pynvml = bind(library_path)
    pynvml.nvmlInit()
    try:
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        facts = {
            "driver_version": text(pynvml.nvmlSystemGetDriverVersion()),
            "cuda_version": f"{cuda // 1000}.{cuda % 1000 // 10}",
            "gpus": {},
        }
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpu = {
                "minor": pynvml.nvmlDeviceGetMinorNumber(handle),
                "brand": pynvml.nvmlDeviceGetBrand(handle),
                "compute_capability": f"{major}.{minor}",
                "memory_total": pynvml.nvmlDeviceGetMemoryInfo(handle).total,
                "mig": [],
            }
            try:
                current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
            except pynvml.NVMLError:
                current = 0
            if current:
                for mig_index in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                    try:
                        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
                    except pynvml.NVMLError_NotFound:
                        continue
                    gpu["mig"].append(
                        {
                            "index": len(gpu["mig"]),
                            "gi": pynvml.nvmlDeviceGetGpuInstanceId(mig),
                            "ci": pynvml.nvmlDeviceGetComputeInstanceId(mig),
                            "uuid": text(pynvml.nvmlDeviceGetUUID(mig)),
                            # Named "<GPU name> MIG <profile>", by the real library and ours.
                            "profile": text(pynvml.nvmlDeviceGetName(mig)).rpartition(" MIG ")[2] or None,
                            "memory_total": pynvml.nvmlDeviceGetMemoryInfo(mig).total,
                            "attributes": mig_attributes(pynvml, mig),
                        }
                    )
            facts["gpus"][text(pynvml.nvmlDeviceGetUUID(handle))] = gpu
        return facts
    finally:
        pynvml.nvmlShutdown()


def _main(argv) -> int:
    if len(argv) != 1 or not os.path.isabs(argv[0]):
        sys.stderr.write("usage: python -m oci_gpu_hook.start.nvml /abs/path/libnvidia-ml.so.1\n")
        return 2
    try:
        facts = _collect(argv[0])
    except ImportError:
        sys.stderr.write("the NVML bindings (python package nvidia-ml-py) are not installed\n")
        return 1
    except OSError as e:
        sys.stderr.write(f"cannot load the library: {e}\n")
        return 1
    except Exception as e:  # pynvml.NVMLError and friends: one line for the parent
        sys.stderr.write(f"{type(e).__name__}: {e}\n")
        return 1
    sys.stdout.write(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
