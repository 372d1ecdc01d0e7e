"""`oci-gpu-hook inventory`: manage the inventory cache the hook reads on every start."""

import os

import click


@click.group()
def inventory():
    """Manage the inventory cache (see inventory_cache in docs/configuration.md)."""


@inventory.command()
@click.pass_obj
def refresh(obj):
    """Discover the host now and rewrite the cache atomically."""
    from oci_gpu_hook.start import inventory_cache

    settings = obj.settings
    result = inventory_cache.refresh(settings)
    click.echo(
        f"{settings.inventory_cache}: driver {result.driver_version}, {len(result.gpus)} GPU(s), "
        f"{len(result.files)} driver files"
    )
    if result.nvml_error:
        from oci_gpu_hook.errors import printable
        from oci_gpu_hook.start.nvml import advice

        # Written all the same: GPUs, device nodes and files come from procfs and the driver root.
        click.echo(f"oci-gpu-hook: warning: {printable(result.nvml_error)}: GPUs and files are from procfs and "
                   f"the driver's files; the CUDA version, brands, memory and MIG UUIDs are unknown until NVML answers "
                   f"({advice(result.nvml_error)}; then run inventory refresh again)", err=True)  # fmt: skip


@inventory.command()
@click.pass_obj
def share(obj):
    """Let containers read the cache where SELinux labels files: its directory and the files in it
    become container_ro_file_t:s0 (the node pod's init container, for the labels pod)."""
    from oci_gpu_hook.node import features

    directory = os.path.dirname(os.path.abspath(obj.settings.inventory_cache))
    if features.share_cache(obj.settings):
        click.echo(f"{directory}: {features.READ_ONLY_CONTAINER_FILE.decode()}")
    else:
        click.echo(f"{directory}: no SELinux labels here: nothing to do")
