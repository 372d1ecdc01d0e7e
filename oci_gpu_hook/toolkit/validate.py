"""`oci-gpu-hook validate`: after installing, prove the hook works: for every GPU, start a small
container with the hook (runc, or podman through a hooks.d directory, with the OCI runtime podman
is configured with unless told another), ask for that GPU by UUID and run nvidia-smi in it; the GPU
passes when the container sees exactly it. On a real GPU host a CUDA sample (deviceQuery), when one
is installed, runs in the container too.

The container is the demo's: busybox-static plus the host's glibc loader and libc. Nothing is read
from the source tree: an installed copy of the package validates the same way.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

from oci_gpu_hook.errors import InventoryError, PrerequisiteError
from oci_gpu_hook.frozen import Frozen
from oci_gpu_hook.toolkit import containers

CUDA_SAMPLES = (
    "/usr/local/cuda/extras/demo_suite/deviceQuery",
    "/usr/local/cuda/bin/deviceQuery",
    "/usr/bin/deviceQuery",
)
_UUID = re.compile(r"UUID: (GPU-[0-9a-fA-F-]+)")
# Driver libraries come from the hook; everything else a sample needs is copied into the rootfs.
_DRIVER_LIBRARY = re.compile(r"^lib(cuda|nvidia-|nvcuvid|GLX_nvidia|EGL_nvidia)")


class GpuResult(Frozen):
    __slots__ = ("index", "uuid", "bus_id", "ok", "detail")
    index: int
    uuid: str
    bus_id: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  GPU {self.index} {self.uuid} ({self.bus_id}): {self.detail}"


def find_sample(settings) -> str | None:
    """A CUDA sample on a real host (all roots /); none on a simulated one."""
    if (settings.driver_root, settings.dev_root, settings.proc_root) != ("/", "/", "/"):
        return None
    return next((p for p in CUDA_SAMPLES if os.access(p, os.X_OK)), None)


def add_sample(rootfs: str, sample: str) -> str:
    """Copy the sample and its non-driver libraries (as ldd lists them) into the rootfs."""
    target = os.path.join(rootfs, "usr/bin", os.path.basename(sample))
    shutil.copy2(sample, target)
    out = subprocess.run(["ldd", sample], capture_output=True, text=True).stdout
    for line in out.splitlines():
        match = re.match(r"\s*(\S+) => (/\S+)", line)
        if match and not _DRIVER_LIBRARY.match(match.group(1)):
            dest = os.path.join(rootfs, "usr/lib64", match.group(1))
            if not os.path.exists(dest):
                shutil.copy2(os.path.realpath(match.group(2)), dest)
    return "/usr/bin/" + os.path.basename(sample)


def _hook_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "oci-gpu-hook:" in line:
            return line[line.index("oci-gpu-hook:") :].rstrip('"\\n')
    return lines[-1] if lines else "the container failed with no message"


def judge(gpu, returncode: int, stdout: str, stderr: str, sample: str | None, runtime: str) -> GpuResult:
    def result(ok, detail):
        return GpuResult(gpu.index, gpu.uuid, gpu.bus_id, ok, detail)

    if returncode != 0 and not _UUID.search(stdout):
        return result(False, _hook_error(stderr))
    seen = _UUID.findall(stdout)
    if seen != [gpu.uuid]:
        shown = ", ".join(seen) or "no GPU"
        return result(False, f"nvidia-smi -L in the container saw {shown}, expected only this one")
    if sample:
        if "Result = PASS" not in stdout:
            return result(False, f"{os.path.basename(sample)} did not pass in the container")
        return result(True, f"nvidia-smi and {os.path.basename(sample)} in a {runtime} container see exactly this GPU")
    if returncode != 0:
        return result(False, f"the container exited with status {returncode}: {_hook_error(stderr)}")
    return result(True, f"nvidia-smi -L in a {runtime} container sees exactly this GPU")


def podman_oci_runtime(oci_runtime: str | None) -> str:
    """The OCI runtime podman runs containers with (oci_runtime, a name or a path, or podman's
    configured default), as podman names it; PrerequisiteError when podman cannot use it."""
    argv = ["podman"] + (["--runtime", oci_runtime] if oci_runtime else [])
    argv += ["info", "--format", "{{.Host.OCIRuntime.Name}}"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise PrerequisiteError("podman info did not answer in 60 s") from None
    lines = (out.stderr.strip() or out.stdout.strip()).splitlines()
    if out.returncode != 0 or not out.stdout.strip():
        raise PrerequisiteError(f"podman cannot use the OCI runtime {oci_runtime or '(its default)'}: "
                                f"{lines[-1] if lines else f'podman info exited with {out.returncode}'}")  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


def run(settings, config_file: str | None, runtime: str = "runc", workdir: str | None = None, on_result=None,
        oci_runtime: str | None = None):  # fmt: skip
    """Validate every GPU; returns [GpuResult]. on_result(result) is called as each one finishes.
    oci_runtime: the OCI runtime podman uses (its own default when None); only with podman."""
    from oci_gpu_hook.start import inventory_cache

    if oci_runtime is not None and runtime != "podman":
        raise ValueError("an OCI runtime can be chosen only for podman")
    if os.geteuid() != 0:
        raise PrerequisiteError("validate needs root: it starts containers")
    shown = runtime
    if runtime == "podman":
        if shutil.which("podman") is None:
            raise PrerequisiteError("podman is not installed")
        shown = f"podman ({podman_oci_runtime(oci_runtime)})"
    inventory = inventory_cache.load(settings)
    if not inventory.gpus:
        raise InventoryError("the driver lists no GPUs: there is nothing to validate")
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="oci-gpu-hook-validate-")
    sample = find_sample(settings)
    results = []
    try:
        bundle = os.path.join(workdir, "bundle")
        rootfs = containers.make_rootfs(os.path.join(bundle, "rootfs"))
        program = add_sample(rootfs, sample) if sample else None
        command = ["sh", "-c", f"nvidia-smi -L && {program}" if program else "nvidia-smi -L"]
        image = hooks_dir = None
        if runtime == "podman":
            # The hook as the runc bundle runs it: this interpreter with this copy of the package.
            hooks_dir = containers.write_hooks_dir(os.path.join(workdir, "hooks.d"), config_file)
            image = containers.podman_image(rootfs, f"localhost/oci-gpu-hook-validate-{os.getpid()}:latest")
        try:
            for gpu in inventory.gpus:
                env = {"NVIDIA_VISIBLE_DEVICES": gpu.uuid}
                if runtime == "podman":
                    # The OCI runtime is podman's own unless --oci-runtime names one.
                    out = containers.podman_run(hooks_dir, image, command, env, oci_runtime=oci_runtime)
                else:
                    containers.write_config(bundle, args=command, env=env, config_file=config_file)
                    out = containers.runc_run(bundle, f"oci-gpu-hook-validate-{os.getpid()}-{gpu.index}")
                result = judge(gpu, out.returncode, out.stdout, out.stderr, sample, shown)
                results.append(result)
                if on_result:
                    on_result(result)
        finally:
            if image:
                subprocess.run(["podman", "rmi", "-f", image], capture_output=True)
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    return results
