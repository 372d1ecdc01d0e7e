"""`oci-gpu-hook demo`: the main job on a simulated GPU host, with a real runc."""

import click


@click.command()
@click.option(
    "--dir",
    "directory",
    default="/tmp/oci-gpu-hook-demo",
    show_default=True,
    help="Where the simulated host and the bundle are built.",
)
@click.option("--devices", default="1", show_default=True, help="NVIDIA_VISIBLE_DEVICES for the container.")
def demo(directory, devices):
    """Build a simulated GPU host and a minimal rootfs, start a real `runc run` with the hook and
    NVIDIA_VISIBLE_DEVICES, and show what the container sees (needs root, gcc, runc, busybox-static)."""
    from oci_gpu_hook.toolkit.demo import run_demo

    return run_demo(directory, devices)
