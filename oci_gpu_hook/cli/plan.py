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
    from oci_gpu_hook.errors import ConfigError, printable
    from oci_gpu_hook.start import inventory_cache, prefilter_rule, spec
    from oci_gpu_hook.start.discover import discover
    from oci_gpu_hook.start.plan import decide
    from oci_gpu_hook.start.prestart import may_ask_for_gpus

    container = spec.load(os.path.abspath(bundle))
    if not may_ask_for_gpus(container):
        # The hook lets this container start before it reads its configuration, so a broken one
        # does not stop it: said so (exit 0, as the hook exits), and the configuration's error
        # beside it, which every GPU container would fail on.
        broken = None
        try:
            _ = obj.settings  # read (and checked) only to say whether it is broken
        except ConfigError as e:
            broken = e.message
        r = prefilter_rule
        why = (f"nothing in it can ask for a GPU ({r.VISIBLE_DEVICES} unset, empty or {r.NO_DEVICES}; no "
               f"{r.LEGACY_VARIABLE}, {r.CDI_ANNOTATION_PREFIX} annotation, device volume mount or "
               f"{r.CDI_DEVICE_ENV_PREFIX}* variable)")  # fmt: skip
        _not_a_gpu_container(as_json, broken, why)
        return
    settings = obj.settings
    # The hook's own decision (start/plan.decide): what it would refuse, this refuses alike.
    result = decide(container, settings, lambda: discover(settings) if no_cache else inventory_cache.load(settings))
    if result is None:
        why = ("with this configuration nothing in it names a device for the hook (see accept_* and cdi_kind), "
               f"or its {prefilter_rule.CDI_DEVICE_ENV_PREFIX}* variables name devices whose nodes the runtime did not "
               "make")  # fmt: skip
        _not_a_gpu_container(as_json, None, why)
        return
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))  # ASCII: json escapes every control character
    else:
        # One line per item whatever the image put in its env: the request and notes are escaped
        # where they are built; this keeps any later image text in the plan off the terminal too.
        click.echo("\n".join(printable(line) for line in result.describe().split("\n")))


def _not_a_gpu_container(as_json: bool, broken: str | None, why: str) -> None:
    """broken: the configuration's error, which the hook never meets for this container."""
    if as_json:
        click.echo(json.dumps({"gpu_container": False, "operations": [], "configuration_error": broken}, indent=2))
    else:
        click.echo(f"not a GPU container: {why}; the hook lets it start untouched")
    if broken is not None:
        click.echo(f"oci-gpu-hook: warning: the configuration is broken; this container does not need it, every "
                   f"GPU container fails on it: {broken}", err=True)  # fmt: skip
