"""`oci-gpu-hook plan`: the dry run: what the hook would do for a bundle, without doing it."""

import json
import os

import click


@click.command()
@click.option("--bundle", required=True, type=click.Path(file_okay=False), help="OCI bundle directory (config.json).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (stable, see docs/plan.md).")
@click.option("--no-cache", is_flag=True, help="Discover the host now instead of using the inventory cache.")
@click.pass_obj
def plan(obj, bundle, as_json, no_cache):
    """Print the operations the hook would perform for the container in BUNDLE.

    The rootfs may be absent; libraries then go to /usr/lib64 (as for a non-Debian image).
    """
    from oci_gpu_hook.errors import printable
    from oci_gpu_hook.start import inventory_cache, spec
    from oci_gpu_hook.start.discover import discover
    from oci_gpu_hook.start.plan import decide

    container = spec.load(os.path.abspath(bundle))
    settings = obj.settings
    # The hook's own decision (start/plan.decide): what it would refuse, this refuses alike.
    result = decide(container, settings, lambda: discover(settings) if no_cache else inventory_cache.load(settings))
    if result is None:
        if as_json:
            click.echo(json.dumps({"gpu_container": False, "operations": []}, indent=2))
        else:
            click.echo("not a GPU container for the hook (NVIDIA_VISIBLE_DEVICES unset, empty or void, or the "
                       "runtime applied its CDI devices itself): the hook does nothing")  # fmt: skip
        return
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))  # ASCII: json escapes every control character
    else:
        # One line per item whatever the image put in its env: the request and notes are escaped
        # where they are built; this keeps any later image text in the plan off the terminal too.
        click.echo("\n".join(printable(line) for line in result.describe().split("\n")))
