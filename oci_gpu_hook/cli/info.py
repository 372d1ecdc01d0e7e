"""`oci-gpu-hook info`: what the host offers, as the hook sees it."""

import json

import click


def _node(node) -> str:
    text = f"{node.path} ({node.major}:{node.minor})"
    return text + (f" PROBLEM: {node.problem}" if node.problem else "")


def print_inventory(inventory) -> None:
    click.echo(f"NVRM version:   {inventory.driver_version}")
    click.echo(f"CUDA version:   {inventory.cuda_version or 'unknown (NVML unavailable)'}")
    if inventory.nvml_error:
        from oci_gpu_hook.errors import printable
        from oci_gpu_hook.start.nvml import advice

        click.echo(f"NVML:           failed: {printable(inventory.nvml_error)} ({advice(inventory.nvml_error)})")
    for gpu in inventory.gpus:
        click.echo("")
        click.echo(f"Device Index:   {gpu.index}")
        click.echo(f"Device Minor:   {gpu.minor}")
        click.echo(f"Model:          {gpu.model}")
        click.echo(f"Brand:          {gpu.brand or 'unknown'}")
        click.echo(f"GPU UUID:       {gpu.uuid}")
        click.echo(f"Bus Location:   {gpu.bus_id}")
        click.echo(f"Architecture:   {gpu.compute_capability or 'unknown'}")
        if gpu.memory_total:
            click.echo(f"Memory:         {gpu.memory_total >> 20} MiB")
        click.echo(f"Device Node:    {_node(gpu.node)}")
        for mig in gpu.mig:
            click.echo(f"MIG Device {gpu.index}:{mig.index}: gi {mig.gi} ci {mig.ci} {mig.uuid or ''}".rstrip())
            click.echo(f"    caps:       {_node(mig.gi_cap)}, {_node(mig.ci_cap)}")
    if not inventory.gpus:
        click.echo("\nNo GPUs found.")
    click.echo("")
    click.echo("Control devices:")
    for node in inventory.control_devices.values():
        click.echo(f"  {_node(node)}")
    for kind, title in (
        ("library", "Libraries"),
        ("library32", "32-bit libraries"),
        ("binary", "Programs"),
        ("firmware", "Firmware"),
        ("ipc", "IPC sockets"),
        ("config", "Graphics config files"),
    ):
        files = [f for f in inventory.files if f.kind == kind]
        if files:
            click.echo(f"{title}:")
            for f in files:
                click.echo(f"  {f.capability:9} {f.path}")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON (stable, see docs/cli.md).")
@click.option("--no-nvml", is_flag=True, help="Do not ask NVML (procfs and files only; faster, fewer facts).")
@click.pass_obj
def info(obj, as_json, no_nvml):
    """Show the driver, GPUs, MIG devices, device nodes and driver files the hook would use."""
    from oci_gpu_hook.start.discover import discover

    inventory = discover(obj.settings, use_nvml=not no_nvml)
    if as_json:
        click.echo(json.dumps(inventory.to_json(), indent=2, sort_keys=True))
    else:
        print_inventory(inventory)
