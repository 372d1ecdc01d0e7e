"""`oci-gpu-hook info`: what the host offers, as the hook sees it."""

import json

import click


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON (stable, see docs/cli.md).")
@click.pass_obj
def info(obj, as_json):
    """Show the driver and the GPUs of the host (or of the configured roots)."""
    from ..inventory import discover

    inventory = discover(obj.settings)
    if as_json:
        click.echo(json.dumps(inventory.to_json(), indent=2, sort_keys=True))
        return
    click.echo(f"NVRM version:   {inventory.driver_version}")
    for gpu in inventory.gpus:
        click.echo("")
        click.echo(f"Device Index:   {gpu.index}")
        click.echo(f"Device Minor:   {gpu.minor}")
        click.echo(f"Model:          {gpu.model}")
        click.echo(f"GPU UUID:       {gpu.uuid}")
        click.echo(f"Bus Location:   {gpu.bus_id}")
    if not inventory.gpus:
        click.echo("No GPUs found.")
