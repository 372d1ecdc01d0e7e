"""`oci-gpu-hook demo`: a real runc container on a simulated GPU host, with the hook wired in
(then podman, when installed)."""

import contextlib
import os
import shutil
import subprocess
import sys

from oci_gpu_hook.start import settings
from oci_gpu_hook.toolkit.containers import make_bundle, podman_image, podman_run, runc_run, write_hooks_dir

SHOW = (
    "echo '$ nvidia-smi -L'; nvidia-smi -L; "
    "echo '$ ls -l /dev/nvidia*'; ls -l /dev/nvidia* /dev/nvidia-caps 2>/dev/null; "
    "echo '$ mounted driver files'; grep -E 'nvidia|libcuda|/lib/firmware' /proc/self/mountinfo | "
    'while read a b c d e rest; do echo "  $e"; done'
)


IMAGE = "localhost/oci-gpu-hook-demo:latest"  # podman's part: imported from the bundle's rootfs, removed after


def run_demo(directory: str, devices: str = "1") -> int:
    """Leaves directory (the simulated host, the bundle, hooks.d) for a look, and nothing else: the
    podman image and the hook's compiled copy of the demo's configuration go at the end."""
    from oci_gpu_hook.toolkit.simulate import simulate

    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    host = simulate(os.path.join(directory, "host"), gpus=4, mig=[2])
    print(f"simulated GPU host: {host['root']} ({len(host['gpus'])} GPUs, driver {host['driver_version']})")
    config = os.path.join(host["root"], "config.yaml")
    try:
        return _containers(directory, config, devices)
    finally:
        # The hook keeps it in /run/oci-gpu-hook for as long as the file is there; it is the demo's.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(settings.compiled_path(config))


def _containers(directory: str, config: str, devices: str) -> int:
    bundle = os.path.join(directory, "bundle")
    if os.path.isdir(bundle):
        shutil.rmtree(bundle)
    make_bundle(bundle, args=["sh", "-c", SHOW], env={"NVIDIA_VISIBLE_DEVICES": devices}, config_file=config)
    print(f"runc run with NVIDIA_VISIBLE_DEVICES={devices} (bundle {bundle}):")
    result = runc_run(bundle, f"oci-gpu-hook-demo-{os.getpid()}")
    sys.stdout.write(result.stdout)
    if result.returncode != 0:
        sys.stderr.write(result.stderr)
        return result.returncode
    if shutil.which("podman") is None:
        print("(podman is not installed: skipping the podman part of the demo)")
        return 0
    hooks_dir = write_hooks_dir(os.path.join(directory, "hooks.d"), config)
    image = podman_image(os.path.join(bundle, "rootfs"), IMAGE)
    try:
        print(f"podman --hooks-dir {hooks_dir} run -e NVIDIA_VISIBLE_DEVICES={devices} {image} nvidia-smi -L:")
        result = podman_run(hooks_dir, image, ["nvidia-smi", "-L"], {"NVIDIA_VISIBLE_DEVICES": devices})
    finally:
        subprocess.run(["podman", "rmi", "-f", image], capture_output=True)
    sys.stdout.write(result.stdout)
    if result.returncode != 0:
        sys.stderr.write(result.stderr)
    return result.returncode
